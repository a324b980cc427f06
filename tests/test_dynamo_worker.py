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


class Graph:
    """A frontend (KV router mode) and N workers, each with its own SSD directory, on loopback."""

    def __init__(self, tmp_path, workers: int, *worker_args: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.tmp = tmp_path
        env = dict(os.environ, DYN_FILE_KV=str(tmp_path / "discovery"), DYN_TCP_RPC_HOST="127.0.0.1",
                   DYN_EVENT_PLANE_HOST="127.0.0.1", DYN_SYSTEM_HOST="127.0.0.1", HF_HUB_OFFLINE="1",
                   DYN_LOG="warn", FLEXKV_CPU_CACHE_GB="0.02", FLEXKV_SSD_CACHE_GB="0.05")
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "dynamo.frontend", "--router-mode", "kv", "--discovery-backend", "file",
             "--event-plane", "zmq", "--http-host", "127.0.0.1", "--http-port", str(self.port)],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "frontend.log", "w"), start_new_session=True)]
        for i in range(workers):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "dynamo_flexkv.dynamo.worker", "--model", "tiny", "--served-model-name",
                 "flexkv-tiny", "--model-dir", str(tmp_path / "model"), *worker_args],
                env=dict(env, FLEXKV_SSD_CACHE_DIR=str(tmp_path / f"ssd{i}")), stdout=subprocess.DEVNULL,
                stderr=open(tmp_path / f"worker{i}.log", "w"), start_new_session=True))

    def wait_ready(self, workers: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for i, p in enumerate(self.procs):
                assert p.poll() is None, f"process {i} died: " + self.logs()
            try:
                if any(m["id"] == "flexkv-tiny" for m in http("GET", f"{self.base}/v1/models", timeout=2)["data"]):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the model never appeared at /v1/models: " + self.logs()
            time.sleep(0.5)
        time.sleep(1.0 * workers)  # let the router discover every worker, not just the first

    def complete(self, prompt: str, max_tokens: int = 4) -> dict:
        return http("POST", f"{self.base}/v1/completions",
                    {"model": "flexkv-tiny", "prompt": prompt, "max_tokens": max_tokens})

    def logs(self) -> str:
        return "".join(p.read_text()[-1500:] for p in sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def assert_gone(self) -> None:
        for p in self.procs:  # nothing of any process group is left
            with pytest.raises(ProcessLookupError):
                os.killpg(p.pid, 0)
        with socket.socket() as s:  # nobody listens on the HTTP port any more (TIME_WAIT is fine)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", self.port))
            s.listen()


def test_frontend_serves_completions_through_the_worker(tmp_path):
    g = Graph(tmp_path, 1, "--num-device-blocks", "64")
    try:
        g.wait_ready(1)
        prompt = "Offload keeps this long shared prefix around. " * 8
        for _ in range(2):
            r = g.complete(prompt, 6)
            assert r["object"] == "text_completion" and r["choices"][0]["finish_reason"] in ("stop", "length")
            assert 1 <= r["usage"]["completion_tokens"] <= 6 and r["usage"]["prompt_tokens"] > 64
    finally:
        g.stop()
    g.assert_gone()


def test_repeated_prefix_goes_to_the_worker_holding_it_offloaded(tmp_path):
    """Two workers without a device prefix cache: a prompt's KV survives only in the host/disk
    tier of the worker that served it. The router must send each repeat there (a cache hit);
    a request sent to the other worker would find nothing."""
    g = Graph(tmp_path, 2, "--num-device-blocks", "64", "--no-device-prefix-cache")
    try:
        g.wait_ready(2)
        prompts = [f"conversation {i}: " + "a long shared system prompt with history. " * 9 for i in range(4)]
        for p in prompts:
            first = g.complete(p)
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for p in prompts:  # every repeat finds its prefix: the router chose the holder each time
            again = g.complete(p)
            cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= again["usage"]["prompt_tokens"] - 16, (cached, again["usage"])
    finally:
        g.stop()
    g.assert_gone()
