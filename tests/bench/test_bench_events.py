"""bench events at a tiny size: 10 simulated workers for a few seconds, ours against device-only,
through the real KvRouter. Every case has a finite positive baseline, the router applied every
event the relays published (no dropped batch, no event it could not apply), and every probe
became visible. No timing is asserted: this machine is shared."""

import json
import math

import pytest

from dynamo_flexkv.core.sysutil import find_binary

pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is installed by make test")


def check(rows, cases):
    assert {r["format"] for r in rows} == {"ours", "device"}
    for r in rows:
        assert r["published"] > 0 and r["requests"] > 0, r
        assert r["dropped"] == 0 and r["applied"] == r["published"], r
        assert r["applied_not_ok"] == 0 and r["drop_warnings"] == 0, r["drop_warning_sample"]
        assert r["skipped"] == 0, r
        assert r["probes_sent"] > 0 and r["probes_seen"] == r["probes_sent"], r
    ours = next(r for r in rows if r["format"] == "ours")
    device = next(r for r in rows if r["format"] == "device")
    # Ours carries every tier; device-only the device tier alone, whose events are the same.
    assert set(ours["blocks"]) == {"device", "host", "disk", "remote"} and set(device["blocks"]) == {"device"}
    assert ours["block_events_per_s"] > device["block_events_per_s"]
    assert len(cases) == 6
    for c in cases:
        assert math.isfinite(c.baseline) and c.baseline > 0, c
        assert math.isfinite(c.ours) and c.ours > 0, c


def test_bench_events_cli_zmq(tmp_path):
    # bench's run(), not main(): main's exit_past_libnl ends the whole process (os._exit) once this
    # process created a UCX agent, as an earlier NIXL test in the same pytest run may have.
    from dynamo_flexkv.bench import build_parser, run

    out, rows_path, png = tmp_path / "events.json", tmp_path / "rows.jsonl", tmp_path / "events.png"
    cases = run(
        build_parser().parse_args(
            [
                "events",
                "--workers",
                "10",
                "--transports",
                "zmq",
                "--warmup",
                "2",
                "--duration",
                "3",
                "--json",
                str(out),
                "--rows",
                str(rows_path),
                "--plot",
                str(png),
            ]
        )
    )
    assert cases
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    objs = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(o["bench"] == "events" and {"ours", "baseline", "ratio"} <= set(o) for o in objs)
    from dynamo_flexkv.bench.report import Case

    check(rows, [Case(**{k: v for k, v in o.items() if k != "ratio"}) for o in objs])
    assert png.stat().st_size > 10_000


@pytest.mark.slow  # the default suite serves over NATS in test_dynamo_worker (etcd + NATS graph)
@pytest.mark.skipif(find_binary("nats-server") is None, reason="nats-server is installed by scripts/install.sh")
def test_bench_events_nats():
    from dynamo_flexkv.bench.events import cases, measure

    rows = measure(["nats"], [10], rate=0.5, warmup=2, duration=3)
    check(rows, cases(rows))


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--workers", ""], "--workers takes comma-separated worker counts"),
        (["--workers", "abc"], "--workers takes comma-separated worker counts"),
        (["--workers", "0"], "worker counts must be positive integers, got [0]"),
        (["--workers=-5"], "worker counts must be positive integers, got [-5]"),
        (["--transports", "foo"], "unknown transport(s) ['foo']"),
        (["--transports", "zmq,"], "unknown transport(s) ['']"),
        (["--rate", "0"], "need rate > 0"),
        (["--rate", "-1"], "need rate > 0"),
        (["--duration", "0"], "need rate > 0 and duration > 0"),
        (["--plot", "/nonexistent-dir/events.png"], "cannot write the plot to /nonexistent-dir/events.png"),
    ],
)
@pytest.mark.unit
def test_bench_events_refuses_a_plan_that_would_measure_nothing(argv, says, tmp_path, monkeypatch):
    """Bad input is refused before any process starts: no simulated worker, event plane or
    work directory (bench events otherwise runs for minutes and reports nan, or spins)."""
    import tempfile

    from dynamo_flexkv.bench import build_parser, run  # not main(): see test_bench_events_cli_zmq

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = ["events", "--workers", "2", "--transports", "zmq", "--warmup", "1", "--duration", "1", *argv]
    with pytest.raises(ValueError) as e:
        run(build_parser().parse_args(args))
    assert says in str(e.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_measure_refuses_an_unknown_transport_before_running_the_known_ones():
    from dynamo_flexkv.bench.events import measure

    with pytest.raises(ValueError, match="unknown transport"):
        measure(["zmq", "foo"], [2], rate=0.5, warmup=1, duration=1)


@pytest.mark.unit
def test_plot_of_no_rows_says_so(tmp_path):
    from dynamo_flexkv.bench.events import plot

    with pytest.raises(ValueError, match="no measured rows"):
        plot([], str(tmp_path / "p.png"))


@pytest.mark.unit
def test_only_dynamos_lost_event_messages_count_as_drops():
    """The router's shutdown line says "dropped" and loses nothing (it made this bench flaky); the
    lines Dynamo 1.6.1 logs for a lost or unapplied event do count."""
    from dynamo_flexkv.bench.events.orchestrate import lost_event_lines

    ts = "2026-01-01T00:00:00.000000Z"
    harmless = [
        f"{ts}  INFO dynamo_kv_router::scheduling::local: LocalScheduler worker config watch dropped, shutting down",
        f"{ts}  INFO dynamo_kv_router::scheduling::local: LocalScheduler workers monitoring task shutting down",
        f"{ts}  WARN dynamo_runtime::discovery: Broadcast receiver lagged, reconciling from list_state",
        f"{ts}  DEBUG dynamo_llm::kv_router: Applied KV event to global radix tree: event_type=stored",
    ]
    lost = [
        f"{ts}  WARN dynamo_llm::kv_router::indexer::recovery::broker_zmq: Brokered-ZMQ publisher lane is full; "
        "dropping the newest batch",
        f"{ts}  WARN dynamo_kv_router::indexer::metrics: Gap detected: expected seq 41, got 57",
        f"{ts}  WARN dynamo_kv_router::indexer::local: Non-consecutive KV event id; buffer may have gaps",
        f"{ts}  WARN dynamo_llm::kv_router::indexer: Failed to apply event: unknown parent block hash 1234",
        f"{ts}  WARN dynamo_llm::kv_router::subscriber: Event subscriber channel full; dropping event",
        f"{ts}  ERROR dynamo_llm::kv_router: Failed to clear KV state after an event sequence gap; rank remains fenced",
    ]
    assert lost_event_lines("\n".join(harmless)) == []
    assert lost_event_lines("\n".join(harmless[:2] + lost + harmless[2:])) == lost
