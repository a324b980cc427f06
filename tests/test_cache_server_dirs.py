"""``dynamo-flexkv cache-server`` leaves no directory it made for its socket: the socket's
directory (made 0700 when missing, e.g. under the temp folder when no XDG_RUNTIME_DIR is set, or
the directory of its own serve gives a run too deep for a socket path) goes when the server stops."""

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
