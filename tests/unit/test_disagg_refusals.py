"""Adversarial checks of the disaggregated graph's config and of `dynamo-flexkv replay`'s options,
through their public interfaces only: a bad option or request is refused with a message that names
what is wrong, and a refused handover leaks no lease."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repo_paths import ROOT

CLI = [sys.executable, "-m", "dynamo_flexkv.cli"]


def disagg_config_error(tmp_path, *overrides) -> str:
    """The GraphError text building the disagg plan with these overrides, or '' if it builds."""
    from dynamo_flexkv.serve import GraphError, load_graph
    from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config

    config = apply_overrides(
        load_config(str(ROOT / "configs" / "disagg.yaml")), ["Common.model=tiny", "Frontend.http-port=0", *overrides]
    )
    try:
        build_plan(load_graph(str(ROOT / "graphs" / "disagg.py")), config, run_dir=tmp_path / "run")
    except GraphError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("value", [".nan", ".inf"])
def test_handover_lease_s_not_finite_is_a_config_error(tmp_path, value):
    assert "handover-lease-s" in disagg_config_error(tmp_path, f"PrefillWorker.handover-lease-s={value}")


@pytest.mark.parametrize("value", [".nan", ".inf"])
def test_handover_timeout_s_not_finite_is_a_config_error(tmp_path, value):
    assert "handover-timeout-s" in disagg_config_error(tmp_path, f"DecodeWorker.handover-timeout-s={value}")


def test_handover_lease_s_in_e_notation_is_read_as_a_number(tmp_path):
    assert disagg_config_error(tmp_path, "PrefillWorker.handover-lease-s=1e3") == ""


def worker_cli(*args: str) -> subprocess.CompletedProcess:
    # A broker URL in the wrong form: the worker fails at its event plane if it gets that far.
    env = dict(os.environ, DYN_ZMQ_BROKER_URL="tcp://127.0.0.1:1")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "dynamo_flexkv.integrations.dynamo_worker",
            "--model",
            "tiny",
            "--num-device-blocks",
            "8",
            "--discovery-backend",
            "file",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=55,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
@pytest.mark.integration
def test_worker_cli_refuses_a_bad_handover_lease_before_starting(value):
    r = worker_cli("--disaggregation-mode", "prefill", "--handover-lease-s", value)
    assert r.returncode == 2 and "--handover-lease-s" in r.stderr and "Traceback" not in r.stderr, r.stderr[-800:]


def replay_until_start(tmp_path, *args: str, timeout: float = 50) -> tuple[int, str, bool]:
    """Runs `dynamo-flexkv replay ARGS`; if it starts a graph, interrupts it (Ctrl-C) and stops every
    process of that graph. Returns (exit code, stderr, whether a graph was started)."""
    p = subprocess.Popen(
        [*CLI, "replay", *args, "--out", str(tmp_path / "out")],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    lines: list[str] = []
    started = False
    deadline = time.monotonic() + timeout
    for line in p.stderr:
        lines.append(line)
        if "starting" in line and "logs in" in line:
            started = True
            break
        if time.monotonic() > deadline:
            break
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    try:
        rest = p.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        p.kill()
        rest = p.communicate()[1]
    return p.returncode, "".join(lines) + (rest or ""), started


CLOSED = ["--url", "http://127.0.0.1:9", "--model", "x", "--request-timeout", "5"]


@pytest.mark.slow
@pytest.mark.parametrize("value", ["0", "-2"])
@pytest.mark.integration
def test_replay_refuses_conversations_below_one(tmp_path, value):
    rc, err, _ = replay_until_start(tmp_path, *CLOSED, "--conversations", value)
    assert rc != 0 and "--conversations" in err, err[-800:]


@pytest.mark.slow
@pytest.mark.integration
def test_replay_refuses_trace_window_nan(tmp_path):
    rc, err, _ = replay_until_start(tmp_path, *CLOSED, "--trace-window-s", "nan")
    assert rc != 0 and "--trace-window-s" in err, err[-800:]


@pytest.mark.slow
@pytest.mark.integration
def test_replay_refuses_time_scale_nan(tmp_path):
    rc, err, _ = replay_until_start(tmp_path, *CLOSED, "--time-scale", "nan")
    assert rc != 0 and "time-scale" in err, err[-800:]


@pytest.mark.slow
@pytest.mark.parametrize("option", [["--time-scale", "0"], ["--concurrency", "0"], ["--request-timeout", "0"]])
@pytest.mark.integration
def test_replay_refuses_bad_run_options_before_starting_a_graph(tmp_path, option):
    rc, err, started = replay_until_start(
        tmp_path, *option, "--configs", "no-offload", "--set", "Common.model=tiny", "--max-prompt-tokens", "512"
    )
    assert not started and rc != 0 and option[0].lstrip("-") in err, err[-800:]


@pytest.mark.slow
@pytest.mark.parametrize("value", ["-1", "nan"])
@pytest.mark.integration
def test_replay_refuses_a_bad_host_gb(tmp_path, value):
    rc, err, started = replay_until_start(
        tmp_path, "--host-gb", value, "--configs", "host", "--set", "Common.model=tiny", "--max-prompt-tokens", "512"
    )
    assert not started and rc != 0 and "host-gb" in err, err[-800:]


@pytest.mark.slow
@pytest.mark.served
def test_replay_with_every_request_failed_reports_the_request_error(tmp_path):
    rc, err, _ = replay_until_start(tmp_path, *CLOSED, "--conversations", "1", "--sample-every", "1")
    assert rc != 0 and "number sections" not in err and "127.0.0.1:9" in err.splitlines()[-1], err[-800:]


def marked_pids(mark: str) -> list[int]:
    """Pids of this user's processes whose environment carries ADV_MARK=mark."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"ADV_MARK={mark}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


@pytest.mark.slow
@pytest.mark.served
def test_replay_sigterm_stops_the_graph_it_started(tmp_path):
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    p = subprocess.Popen(
        [
            *CLI,
            "replay",
            "--engine",
            "reference",
            "--configs",
            "no-offload",
            "--set",
            "Common.model=tiny",
            "--max-prompt-tokens",
            "512",
            "--conversations",
            "4",
            "--sample-every",
            "1",
            "--out",
            str(tmp_path / "out"),
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, ADV_MARK=mark),
    )
    try:
        for line in p.stderr:  # the graph is ready once the progress bar shows a finished request
            if "no-offload @40:" in line and "1/" in line:
                break
        assert p.poll() is None and marked_pids(mark) != [p.pid], "the replay did not start its graph"
        p.send_signal(signal.SIGTERM)
        p.wait(60)
        for _ in range(50):  # a graph being stopped gets a few seconds
            left = marked_pids(mark)
            if not left:
                break
            time.sleep(0.2)
        assert left == [], f"processes left running: {left}"
    finally:
        for pid in marked_pids(mark):
            os.kill(pid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()


@pytest.mark.slow
@pytest.mark.served
def test_disagg_request_refused_by_decode_releases_the_prefill_lease(tmp_path):
    pytest.importorskip("dynamo.frontend")
    pytest.importorskip("nixl._api")
    import urllib.error

    from disagg_helpers import complete, disagg_plan
    from served import metric, wait_until

    from dynamo_flexkv.serve.launcher import Launcher

    plan = disagg_plan(tmp_path, "disagg", "PrefillWorker.handover-lease-s=60")
    prefill, _ = plan.workers
    with Launcher(plan) as launcher:
        launcher.wait_ready(120)
        prompt = " ".join(["alpha beta gamma delta"] * 6)  # ~100 tokens: 6 full blocks
        with pytest.raises(urllib.error.HTTPError) as refused:
            complete(plan, prompt, 100000)
        assert refused.value.code == 400
        wait_until(
            "the prefill worker's blocks back",
            lambda: metric(prefill.port, "flexkv_device_blocks", state="used") == 0,
            timeout=10,
        )
    assert "expired" not in (plan.run_dir / "logs" / f"{prefill.name}.log").read_text()


@pytest.mark.slow
@pytest.mark.served
def test_disagg_prefill_worker_exits_cleanly_after_a_request_decode_refused(tmp_path):
    pytest.importorskip("dynamo.frontend")
    pytest.importorskip("nixl._api")
    import urllib.error

    from disagg_helpers import complete, disagg_plan

    from dynamo_flexkv.serve.launcher import Launcher

    plan = disagg_plan(tmp_path, "disagg", "PrefillWorker.handover-lease-s=45")
    prefill, _ = plan.workers
    with Launcher(plan) as launcher:
        launcher.wait_ready(120)
        with pytest.raises(urllib.error.HTTPError):
            complete(plan, " ".join(["alpha beta gamma delta"] * 6), 100000)
    assert launcher.running[prefill.name].returncode == 0


@pytest.mark.integration
def test_decode_refuses_a_forged_handover_naming_another_prompts_blocks():
    pytest.importorskip("nixl._api")
    from disagg_helpers import decode_one, engine_pair

    from dynamo_flexkv.integrations.disagg.params import KEY
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine
    from dynamo_flexkv.integrations.reference_engine.request import SamplingParams

    agg = LLMEngine(EngineModelConfig.load("tiny"), num_device_blocks=48)
    # the graph's handover secret, as `dynamo-flexkv serve` gives both workers
    with engine_pair(secret=b"the graph's handover secret") as (prefill, decode, p_side, d_side):
        params = SamplingParams(max_tokens=6)
        a, b = list(range(1, 100)), list(range(200, 299))
        (want,) = agg.generate([a], params)
        handovers = []
        for prompt in (a, b):
            prefill.generate([prompt], SamplingParams(max_tokens=1))
            handovers.append(p_side.hand_over(prompt)[KEY])
        forged = dict(handovers[0], blocks=handovers[1]["blocks"])  # a's lease and hash, b's blocks
        assert decode_one(decode, d_side, "forged", a, params, {KEY: forged}) == want.output
