"""The worker component behind Dynamo's real frontend (KV router mode), all on 127.0.0.1: an
OpenAI completion is served end to end, and everything shuts down leaving no process behind."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, timeout=30):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def test_frontend_serves_completions_through_the_worker(tmp_path):
    port = free_port()
    env = dict(os.environ, DYN_FILE_KV=str(tmp_path / "discovery"), DYN_TCP_RPC_HOST="127.0.0.1",
               DYN_EVENT_PLANE_HOST="127.0.0.1", DYN_SYSTEM_HOST="127.0.0.1", HF_HUB_OFFLINE="1",
               DYN_LOG="warn", FLEXKV_CPU_CACHE_GB="0.02", FLEXKV_SSD_CACHE_GB="0.05",
               FLEXKV_SSD_CACHE_DIR=str(tmp_path / "ssd"))
    procs = [
        subprocess.Popen([sys.executable, "-m", "dynamo.frontend", "--router-mode", "kv", "--discovery-backend",
                          "file", "--event-plane", "zmq", "--http-host", "127.0.0.1", "--http-port", str(port)],
                         env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "frontend.log", "w"),
                         start_new_session=True),
        subprocess.Popen([sys.executable, "-m", "dynamo_flexkv.dynamo.worker", "--model", "tiny",
                          "--served-model-name", "flexkv-tiny", "--num-device-blocks", "64",
                          "--model-dir", str(tmp_path / "model")],
                         env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "worker.log", "w"),
                         start_new_session=True),
    ]
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert all(p.poll() is None for p in procs), (tmp_path / "worker.log").read_text()[-2000:]
            try:
                if any(m["id"] == "flexkv-tiny" for m in http("GET", f"{base}/v1/models", timeout=2)["data"]):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the model never appeared at /v1/models"
            time.sleep(0.5)
        prompt = "Offload keeps this long shared prefix around. " * 8
        for _ in range(2):  # the second one finds its prefix cached on the worker
            r = http("POST", f"{base}/v1/completions", {"model": "flexkv-tiny", "prompt": prompt, "max_tokens": 6})
            assert r["object"] == "text_completion" and r["choices"][0]["finish_reason"] in ("stop", "length")
            assert 1 <= r["usage"]["completion_tokens"] <= 6 and r["usage"]["prompt_tokens"] > 64
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p in procs:  # nothing of either process group is left
        with pytest.raises(ProcessLookupError):
            os.killpg(p.pid, 0)
    with socket.socket() as s:  # nobody listens on the HTTP port any more (TIME_WAIT is fine)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
