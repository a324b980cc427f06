"""The replay measured by NVIDIA's aiperf (``--client aiperf``), the benchmark client Dynamo
documents, instead of ours: the same turns, sent as the same request bodies (the prompt's token ids,
greedy, streamed), each conversation an aiperf session, so aiperf's fixed schedule sends a turn at
its scaled trace time but never before the previous turn of its conversation was answered, as our
client does. aiperf then times TTFT and inter-token gaps by the chunks that carry text, as any
streaming client would. It runs from its own venv (``.venv-aiperf/``, installed on first use, about
2 minutes), in a session of its own that is killed whole when it ends or overruns. Unlike our
client, aiperf gets no cap on requests in flight (its cap is per conversation, see run_aiperf)."""

from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamo_flexkv.core.procgroup import stop_group
from dynamo_flexkv.replay.client import RequestRecord, arrival_times
from dynamo_flexkv.workload import Turn

AIPERF_VERSION = "0.13.0"
AIPERF_VENV = Path(__file__).resolve().parents[2] / ".venv-aiperf"
TOKENIZER = "flexkv/served"  # aiperf's --tokenizer: a repo id in a hub cache laid out from the model directory


def aiperf_exe(venv: Path = AIPERF_VENV) -> Path:
    """aiperf from its own venv, installed there with pip if missing or another version
    (idempotent; a lock keeps two runs from installing at once)."""
    venv.mkdir(parents=True, exist_ok=True)
    py, exe = venv / "bin" / "python", venv / "bin" / "aiperf"
    with open(venv / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        check = [str(py), "-c", "import importlib.metadata as m; print(m.version('aiperf'))"]
        if exe.exists() and subprocess.run(check, capture_output=True, text=True).stdout.strip() == AIPERF_VERSION:
            return exe
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        sys.stderr.write(f"installing aiperf=={AIPERF_VERSION} into {venv} (about 2 minutes)\n")
        pip = subprocess.run(
            [str(py), "-m", "pip", "install", "-q", f"aiperf=={AIPERF_VERSION}"],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if pip.returncode != 0:
            raise RuntimeError(f"pip install aiperf=={AIPERF_VERSION} into {venv} failed:\n{pip.stderr[-3000:]}")
    return exe


def session_id(turn: Turn) -> str:
    return f"conv-{turn.conversation}"


def write_trace(turns: Sequence[Turn], model: str, time_scale: float, path: Path) -> None:
    """The turns as a Mooncake-format trace of pre-built request bodies: one line per turn with
    its session (conversation), scaled arrival in ms and the body our client sends, minus our
    ``nvext`` fields (aiperf is timed as a plain client)."""
    lines = []
    for turn, at in zip(turns, arrival_times(turns, time_scale)):
        body = {
            "model": model,
            "prompt": list(turn.tokens),
            "max_tokens": turn.output_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        lines.append(
            {
                "session_id": session_id(turn),
                "timestamp": round(at * 1000, 3),
                "output_length": turn.output_tokens,
                "payload": body,
            }
        )
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def run_aiperf(
    url: str,
    model: str,
    model_dir: Path,
    turns: Sequence[Turn],
    *,
    time_scale: float,
    concurrency: int,
    workdir: Path,
    request_timeout_s: float = 120,
    timeout_s: float | None = None,
) -> tuple[list[RequestRecord], float]:
    """``aiperf profile`` of the turns against ``url``: one record per turn (in ``turns``' order)
    with no cap on requests in flight: aiperf's --concurrency caps *sessions* (a conversation holds
    its slot until its last turn), which measured delayed later conversations' first turns by up
    to 17.6 s and halved the load; ``concurrency`` only sizes the overall time limit.
    with aiperf's TTFT, inter-chunk gaps, latency and error, and the seconds from the first
    request's start to the last one's end (aiperf's own start-up is not replay time). Raises when
    aiperf fails or overruns."""
    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_hf_cache_entry

    exe = aiperf_exe()
    workdir.mkdir(parents=True, exist_ok=True)
    trace, out, hub = workdir / "trace.jsonl", workdir / "artifacts", workdir / "hub"
    write_trace(turns, model, time_scale, trace)
    write_hf_cache_entry(model_dir, hub, TOKENIZER)
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(workdir / "hf"),
        "XDG_CACHE_HOME": str(workdir / "cache"),
        "MPLCONFIGDIR": str(workdir / "mpl"),
    }
    argv = [
        str(exe),
        "profile",
        "-m",
        model,
        "--url",
        url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        TOKENIZER,
        "--input-file",
        str(trace),
        "--custom-dataset-type",
        "mooncake_trace",
        "--fixed-schedule",
        "--use-server-token-count",
        "--request-timeout-seconds",
        f"{request_timeout_s:g}",
        "--ui",
        "none",
        "--no-gpu-telemetry",
        "--no-server-metrics",
        "--workers-max",
        "2",
        "--random-seed",
        "1",
        "--output-artifact-dir",
        str(out),
    ]
    last = max(arrival_times(turns, time_scale)) if turns else 0.0
    limit = timeout_s or 300 + last + request_timeout_s * max(1, len(turns) // max(1, concurrency))
    log_path = workdir / "aiperf.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            done = stop_group(proc)  # what is left of its session (or aiperf itself, overrun)
            if not done.clean:
                print(f"aiperf: stopping it {done.describe()}", file=sys.stderr, flush=True)
    if code != 0:
        why = f"ran past {limit:.0f} s" if code is None else f"exited {code}"
        raise RuntimeError(f"aiperf {why}; its log {log_path} ends:\n{log_path.read_text()[-3000:]}")
    exports = list(out.rglob("profile_export.jsonl"))
    if not exports:
        raise RuntimeError(f"aiperf wrote no profile_export.jsonl under {out}")
    lines = exports[0].read_text().splitlines()
    return records_from_export(lines, turns, time_scale), replay_seconds(lines)


def replay_seconds(lines: Sequence[str]) -> float:
    """From the first request's start to the last request's end, by aiperf's clock."""
    spans = [
        ((row.get("metadata") or {}).get("request_start_ns"), (row.get("metadata") or {}).get("request_end_ns"))
        for row in (json.loads(x) for x in lines if x.strip())
    ]
    starts, ends = [a for a, _ in spans if a], [b for _, b in spans if b]
    return (max(ends) - min(starts)) / 1e9 if starts and ends else 0.0


def _value(metrics: dict[str, Any], name: str) -> Any:
    m = metrics.get(name)
    return m.get("value") if isinstance(m, dict) else None


def records_from_export(lines: Sequence[str], turns: Sequence[Turn], time_scale: float = 1.0) -> list[RequestRecord]:
    """aiperf's per-request export as our records, matched to the turns by session and turn index
    (the k-th line of a session in the trace is its turn k); a turn aiperf has no record of is an
    error."""
    at = arrival_times(turns, time_scale) if turns else []
    records = [
        RequestRecord(
            index=i,
            conversation=t.conversation,
            turn=t.turn,
            arrival_s=at[i],
            prompt_tokens=len(t.tokens),
            error="aiperf sent no request for it",
        )
        for i, t in enumerate(turns)
    ]
    slot: dict[tuple, int] = {}
    seen: dict[str, int] = {}
    for i, t in enumerate(turns):
        sid = session_id(t)
        slot[(sid, seen.get(sid, 0))] = i
        seen[sid] = seen.get(sid, 0) + 1
    rows = [json.loads(line) for line in lines if line.strip()]
    starts = [(r.get("metadata") or {}).get("request_start_ns") for r in rows]
    t0 = min((t for t in starts if t), default=0)
    for row in rows:
        meta, metrics = row.get("metadata") or {}, row.get("metrics") or {}
        key = (meta.get("conversation_id"), meta.get("turn_index"))
        if key not in slot:
            raise RuntimeError(
                f"aiperf reported a request of session {key[0]!r} turn {key[1]!r}, which the replay did not send"
            )
        rec = records[slot[key]]
        if meta.get("request_start_ns"):
            rec.sent_s = (meta["request_start_ns"] - t0) / 1e9  # from the first request's start
        err = row.get("error")
        rec.error = (err.get("message") or str(err)) if isinstance(err, dict) else (str(err) if err else None)
        ttft = _value(metrics, "time_to_first_token")
        rec.ttft_ms = float(ttft) if ttft is not None else None
        gaps = _value(metrics, "inter_chunk_latency")
        rec.itl_ms = [float(g) for g in gaps] if isinstance(gaps, list) else []
        latency = _value(metrics, "request_latency")
        rec.e2e_ms = float(latency) if latency is not None else None
        osl = _value(metrics, "output_sequence_length")
        rec.output_tokens = int(osl) if osl is not None and not math.isnan(float(osl)) else 0
        if rec.error is None and rec.ttft_ms is None:
            rec.error = "aiperf measured no first token"
    return records
