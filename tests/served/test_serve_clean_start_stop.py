"""A start and a stop of a shipped graph as a user runs it: ``dynamo-flexkv serve`` with its
default quiet console and its own temp run directory. The ready lines name the run directory and
the log files; no component logs an ERROR line (serve's quiet console shows every component line
at WARN and above, so its output is where one would appear); the log files are plain text; once
serve exits 0, nothing of the run is left in the temp folder (serve's TMPDIR: a directory of the
test's own) and none of its processes runs. Reference graphs here; a vLLM graph (slow) too."""

import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from served import Serve, assert_all_gone, post
from vllm_graph import VllmServe

# No ERROR line at all: Dynamo's frontend logs one of its benign races at about half of the stops
# (serve/logs.py STOP_RACES), which serve's quiet console shows as INFO once it is stopping. A start
# or a stop that shows any ERROR line fails.
ERROR_LINE = re.compile(r"\bERROR\b")

# Every shipped graph (graphs/), by its worker sections: agg_router in the default suite, the others slow.
REFERENCE = {
    "agg": ["FlexKVWorker"],
    "agg_router": ["FlexKVWorker"],
    "disagg": ["PrefillWorker", "DecodeWorker"],
    "disagg_router": ["PrefillWorker", "DecodeWorker"],
}
VLLM = {
    "agg_vllm": ["VllmWorker"],
    "agg_router_vllm": ["VllmWorker"],
    "disagg_vllm": ["PrefillWorker", "DecodeWorker"],
    "disagg_router_vllm": ["PrefillWorker", "DecodeWorker"],
}


def reference_sets(tmp_path: Path, workers) -> list:
    out = ["Common.model=tiny", "Common.served-model-name=flexkv-tiny", "Frontend.http-port=0"]
    for w in workers:
        out += [
            f"{w}.num-device-blocks=64",
            f"{w}.cache.cpu_cache_gb=0.02",
            f"{w}.cache.ssd_cache_gb=0.05",
            f"{w}.cache.ssd_cache_dir={tmp_path}/ssd-{w}{{replica}}",
        ]
    return out


def vllm_sets(tmp_path: Path, workers=("VllmWorker",)) -> list:
    out = ["Frontend.http-port=0"]
    for w in workers:
        out += [
            f"{w}.cache.ssd_cache_dir={tmp_path}/ssd-{w}{{replica}}",
            f"{w}.max-model-len=2560",
            f"{w}.num-device-blocks=64",
            f"{w}.cache.cpu_cache_gb=0.0625",
            f"{w}.cache.ssd_cache_gb=0.1",
        ]
    return out


def start_and_stop(serve: Serve, temp: Path, model: str) -> None:
    try:
        run = serve.run
        assert run.parent == temp and run.name.startswith("dynamo-flexkv-"), run  # serve's own temp run dir
        logs = serve.wait_for(r"^  logs: (\S+)$", 5).group(1)
        assert logs.startswith(f"{run}/logs/"), logs
        files = sorted((run / "logs").glob("*.log"))
        assert files, f"no log file in {run}/logs"
        for f in files:
            assert "\x1b" not in f.read_text(errors="replace"), f"{f} carries terminal escape codes"
        code, reply = post(serve.base_url, {"model": model, "prompt": "a start and a stop", "max_tokens": 2})
        assert code == 200, reply
        serve.proc.send_signal(signal.SIGINT)
        assert serve.proc.wait(timeout=120) == 0, "\n".join(serve.lines[-40:])
    finally:
        serve.close()
    serve._reader.join(timeout=10)
    errors = [ln for ln in serve.lines if ERROR_LINE.search(ln)]
    assert not errors, "\n".join(errors)
    assert not run.exists(), f"serve left its run directory {run}"
    assert sorted(os.listdir(temp)) == [], f"left in the temp folder: {sorted(os.listdir(temp))}"
    assert_all_gone(serve.children, [])


@pytest.fixture
def temp():
    """serve's temp folder: short (vLLM makes its IPC sockets there, 107 characters at most) and the
    test's own, so that whatever a run leaves there is seen."""
    path = Path(tempfile.mkdtemp(prefix="fkc-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    "graph", [pytest.param(g, marks=[pytest.mark.slow] if g != "agg_router" else []) for g in sorted(REFERENCE)]
)
def test_a_reference_graph_starts_and_stops_clean(tmp_path, temp, graph):
    """agg_router in the default suite; the other reference graphs with -m slow."""
    serve = Serve(
        tmp_path,
        graph,
        graph=graph,
        base=reference_sets(tmp_path, REFERENCE[graph]),
        console="quiet",
        own_run_dir=True,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    start_and_stop(serve, temp, "flexkv-tiny")


@pytest.mark.slow
@pytest.mark.parametrize("graph", sorted(VLLM))
def test_a_vllm_graph_starts_and_stops_clean(tmp_path, temp, graph):
    serve = VllmServe(
        tmp_path,
        graph,
        graph=graph,
        base=vllm_sets(tmp_path, VLLM[graph]),
        console="quiet",
        own_run_dir=True,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    start_and_stop(serve, temp, "vllm-small")
