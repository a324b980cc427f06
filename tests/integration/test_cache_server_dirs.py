"""``dynamo-flexkv cache-server`` leaves no directory it made for its socket: the socket's
directory (made 0700 when missing, e.g. under the temp folder when no XDG_RUNTIME_DIR is set, or
the directory of its own serve gives a run too deep for a socket path) goes when the server stops."""

import os
import signal
import subprocess
import sys

from dynamo_flexkv.cache_server import READY


def test_the_socket_directory_it_made_goes_when_it_stops(tmp_path):
    sock = tmp_path / "made" / "for-it" / "node.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dynamo_flexkv.cli",
            "cache-server",
            "--socket",
            str(sock),
            "--set",
            "cpu_cache_gb=0.01",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in proc.stdout:  # its READY line, or its end
            lines.append(line)
            if line.startswith(READY):
                break
        assert sock.exists(), "".join(lines)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert list(tmp_path.iterdir()) == []


def test_a_metrics_port_it_cannot_listen_on_is_refused_and_leaves_nothing(tmp_path):
    """Out of range or not this machine's address: exit 2 naming the options and the fix, no
    traceback, and the socket directory it made is gone."""
    for port, host in (("70000", "127.0.0.1"), ("19999", "10.9.9.9")):
        sock = tmp_path / "made" / "node.sock"
        r = subprocess.run(
            [sys.executable, "-m", "dynamo_flexkv.cli", "cache-server", "--socket", str(sock), "--set",
             "cpu_cache_gb=0.01", "--metrics-port", port, "--metrics-host", host],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"--metrics-host/--metrics-port {host}:{port}: cannot listen there" in r.stderr
        assert not (tmp_path / "made").exists()


def _start(sock) -> "tuple[subprocess.Popen, list]":
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dynamo_flexkv.cli",
            "cache-server",
            "--socket",
            str(sock),
            "--set",
            "cpu_cache_gb=0.01",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:  # until its READY line, or its end
        lines.append(line)
        if line.startswith(READY):
            break
    return proc, lines


def test_a_killed_servers_socket_and_directories_go_with_the_next_one_that_stops(tmp_path):
    """SIGKILLed, a cache server leaves its socket and the directory it made; the next one on that
    socket removes the stale socket (nothing listens on it), says so, takes the directories over and
    removes them when it stops. A live server's socket is never taken (exit 2)."""
    sock = tmp_path / "made" / "for-it" / "node.sock"
    first, lines = _start(sock)
    try:
        assert sock.exists(), "".join(lines)
        live = subprocess.run(
            [sys.executable, "-m", "dynamo_flexkv.cli", "cache-server", "--socket", str(sock)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert live.returncode == 2 and "another cache server is listening there" in live.stderr, live.stderr
    finally:
        first.kill()
        first.wait()
    assert sock.exists()  # left behind
    second, lines = _start(sock)
    try:
        said = "".join(lines)
        assert f"node_socket {sock}: removed the socket a cache server that did not stop left" in said, said
        assert f"node_socket's directory {sock.parent}: made by a cache server that did not stop" in said, said
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=60) == 0, second.stdout.read()
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert list(tmp_path.iterdir()) == []


def test_a_host_tier_larger_than_the_machines_memory_is_refused(tmp_path):
    """Exit 2 naming the key, where it was set, the machine's memory and the fix; nothing made."""
    sock = tmp_path / "made" / "node.sock"
    for argv, said in (
        (["--set", "cpu_cache_gb=1000000"], "cpu_cache_gb=1e+06 (--set cpu_cache_gb=1000000): the host tier"),
        (["--set", "cpu_cache_gb=1000", "--max-models", "1000"], "x --max-models 1000 (each model gets its own"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "dynamo_flexkv.cli", "cache-server", "--socket", str(sock), *argv],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert said in r.stderr and "is larger than this machine's memory (" in r.stderr, r.stderr
        assert "set cpu_cache_gb to what the node can spare (e.g. --set cpu_cache_gb=" in r.stderr, r.stderr
        assert not (tmp_path / "made").exists()


def test_a_socket_it_cannot_listen_on_or_a_host_tier_of_0_is_refused_naming_it(tmp_path):
    """Exit 2 naming the path and the flag (not a bare errno), or the key and where it was set."""
    sock = tmp_path / "made" / "node.sock"
    # a directory of this user that bind cannot write to: /proc for root (who ignores modes), else 0500
    locked = tmp_path / "locked"
    locked.mkdir(0o500)
    bad = "/proc/x.sock" if os.geteuid() == 0 else str(locked / "x.sock")
    for argv, said in (
        (["--socket", bad], f"node_socket {bad} (--socket): cannot listen there ("),
        (["--socket", str(sock), "--set", "cpu_cache_gb=0"], "cpu_cache_gb=0 (--set cpu_cache_gb=0): the host tier"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "dynamo_flexkv.cli", "cache-server", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert said in r.stderr, r.stderr
        assert not (tmp_path / "made").exists()
