"""``dynamo-flexkv replay`` (and the main job, ``dynamo-flexkv demo``): the Mooncake conversation
trace replayed with its arrival times and real concurrency against each configuration in turn,
each on a freshly served graph of vLLM workers (``--engine vllm``, the default) or of the
reference engine's workers (``--engine reference``), then the comparison as a markdown table, PNG
plots and JSON lines in a results folder."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dynamo_flexkv.core.durations import is_duration
from dynamo_flexkv.resources import CONFIGS, GRAPHS, resolve
from dynamo_flexkv.workload import TRACE_BLOCK, Scale, Turn, trace_turns

ALL_CONFIGS = "no-offload,host,host+ssd,hints,round-robin,kv-device-only,node"
# Host tier per worker, in blocks of the small preset: the reference engine 512 (float32, 256 KiB a
# block), what a worker serves in the default workload; vLLM 128 (bfloat16, 128 KiB a block), a
# quarter of that, so the SSD tier serves part of the lower-tier hits (with 512 it served none).
HOST_GB = {"reference": 0.125, "vllm": 0.015625}


@dataclass(frozen=True)
class Preset:
    """What a default run and a --full run replay."""

    conversations: int
    sample_every: int  # every K-th conversation: new conversations spread over the trace, not one burst
    trace_window_s: float | None  # turns later than this into the trace are dropped
    time_scale: float
    configs: str
    device_blocks: str
    sweep_configs: str
    higher_rate: float  # the first size's configurations again at this multiple of the rate (0: not)


# The main job (a few minutes on 2 cores): 32 conversations, every 4th of the first 128 (their first
# turns spread over the trace's first 219 s, not one 51 s burst), turns in the trace's first 15 min
# (83 requests; the other 11 trickle in over the next 34 min of trace), at 20x. At 40 device
# blocks a prompt leaves the device before its conversation's next turn; a 512-block host tier
# holds what a worker serves, so a later turn's prefix is on the worker that served the turn before.
# Then every configuration again at 2x the rate (40x), for goodput where queues form: about 10-12
# min on a quiet 2-core machine (a graph's start and stop ~40 s, a replay 45 s / 23 s; issue 49).
# The hints row (vLLM only: host+ssd with router hints on) runs beside host+ssd. Its two stalls of
# 2026-12-07 (both workers frozen 25 s and 2 min) were the kernel holding the disk's write
# completions (docs/HINTS.md); a hung disk now costs refused stores, not a frozen engine.
DEFAULT = Preset(
    conversations=32,
    sample_every=4,
    trace_window_s=900,
    time_scale=20.0,
    configs="no-offload,host+ssd,hints,kv-device-only,node",
    device_blocks="40",
    sweep_configs="no-offload,host+ssd",
    higher_rate=2.0,
)
FULL = Preset(
    conversations=192,
    sample_every=1,
    trace_window_s=None,
    time_scale=40.0,
    configs=ALL_CONFIGS,
    device_blocks="48,64,128,256",
    sweep_configs=ALL_CONFIGS,
    higher_rate=0.0,
)


def _number(kind: type, low: float, inclusive: bool, what: str) -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` at or above (``inclusive``) / above ``low``. argparse names
    the option and exits 2 on a bad value, before anything is served."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not is_duration(value, low, low_ok=inclusive):
            raise argparse.ArgumentTypeError(f"{text} must be {what}")
        return value

    return parse


COUNT = _number(int, 1, True, "a whole number >= 1")
POSITIVE_S = _number(float, 0, False, "a finite number of seconds > 0")
FACTOR = _number(float, 0, False, "a finite number > 0")
GB = _number(float, 0, True, "a finite number of GB >= 0")
WINDOW_S = _number(float, 0, True, "a finite number of seconds >= 0 (0: no window)")
RATE = _number(float, 0, True, "a finite multiple >= 0 (0: none)")


def _listed(parse: Callable[[str], list]) -> Callable[[str], str]:
    """An argparse type for a comma-separated list (--configs, --sweep-configs, --device-blocks):
    refused (exit 2, naming the option) when empty, unknown or naming one item twice, before
    anything is served; "" is not the default, and a row named twice is --repeat's job."""

    def check(text: str) -> str:
        if not any(n.strip() for n in text.split(",")):
            raise argparse.ArgumentTypeError(f"{text!r} is empty: name at least one, comma-separated")
        try:
            items = [str(x) for x in parse(text)]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        twice = sorted({x for x in items if items.count(x) > 1})
        if twice:
            raise argparse.ArgumentTypeError(
                f"{text!r} names {', '.join(twice)} more than once: name each once (--repeat N runs every row N times)"
            )
        return text

    return check


def _config_names(text: str) -> list[str]:
    from dynamo_flexkv.replay.configs import parse_configs

    return [c.name for c in parse_configs(text)]


def _block_sizes(text: str) -> list[int]:
    from dynamo_flexkv.replay.configs import device_block_list

    return device_block_list(text)


def _ttft_target(text: str):
    """--ttft-target: refused by argparse (exit 2, naming it) before anything is served."""
    from dynamo_flexkv.replay.report import TtftTarget

    try:
        return TtftTarget.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--ttft-target {text!r}: ")) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dynamo_flexkv.replay.configs import ENGINES

    g = p.add_argument_group("what to serve")
    g.add_argument(
        "--engine",
        choices=list(ENGINES),
        default="vllm",
        help="the workers: "
        + "; ".join(
            f"{e.name}: {e.description}, graphs/{e.graph}.py with configs/{e.config}.yaml" for e in ENGINES.values()
        )
        + " (default vllm)",
    )
    g.add_argument("--graph", help="graph file (default: the engine's, see --engine)")
    g.add_argument("-f", "--config", help="config file (default: the engine's, see --engine)")
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="config override for every configuration (e.g. VllmWorker.cache.ssd_cache_gb=0.5)",
    )
    g.add_argument(
        "--host-gb",
        type=GB,
        help=f"host tier per worker in GB (default {HOST_GB['vllm']} for vllm: 128 blocks of the small preset in "
        f"bfloat16, a quarter of what a worker serves in the default workload, so the SSD tier serves "
        f"part of the lower-tier hits; {HOST_GB['reference']} for reference: 512 float32 blocks, all of it)",
    )
    g.add_argument(
        "--configs",
        type=_listed(_config_names),
        help=f"configurations compared at the first device size (default {DEFAULT.configs}; "
        f"--full {FULL.configs}; all: {ALL_CONFIGS}; hints: host+ssd with Dynamo's router hints on, "
        f"vLLM only, left out of the defaults with --engine reference; with --engine vllm, lmcache is "
        f"added to the defaults once `make peer-lmcache` installed LMCache: the peer in the same graph)",
    )
    g.add_argument(
        "--device-blocks",
        type=_listed(_block_sizes),
        help="device KV blocks per worker, comma-separated: the first size runs "
        f"--configs, the others --sweep-configs (default {DEFAULT.device_blocks}; --full "
        f"{FULL.device_blocks})",
    )
    g.add_argument(
        "--sweep-configs",
        type=_listed(_config_names),
        help=f"configurations at the other device sizes (default {DEFAULT.sweep_configs}; --full: all of --configs)",
    )
    g.add_argument(
        "--url",
        help="replay against this already served graph (e.g. http://127.0.0.1:8000) instead: one run, no comparison",
    )
    g.add_argument("--model", help="served model name (with --url; default: the config's served-model-name)")
    g.add_argument(
        "--client",
        choices=["ours", "aiperf"],
        default="ours",
        help="who sends and times the requests: ours (default; counts tokens per chunk, names the worker "
        "and the tiers of each response) or aiperf, NVIDIA's benchmark client, from its own venv "
        ".venv-aiperf (installed on first use, ~2 min): the same request bodies and schedule, timed by "
        "the chunks that carry text; hits and accounting then come from the workers' counters",
    )
    g.add_argument(
        "--worker-metrics",
        default="",
        metavar="PORT,PORT",
        help="with --url: the workers' system ports, to attribute requests and check the accounting "
        "(their counters read as --engine's)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="Mooncake-format trace, .jsonl or .jsonl.xz (default: the shipped one)")
    w.add_argument(
        "--conversations",
        type=COUNT,
        help=f"conversations replayed (default {DEFAULT.conversations}; --full {FULL.conversations})",
    )
    w.add_argument("--min-turns", type=int, default=Scale.min_turns)
    w.add_argument("--max-turns", type=int, default=Scale.max_turns)
    w.add_argument(
        "--tokens-per-hash-block",
        type=int,
        default=Scale.tokens_per_hash_block,
        help=f"tokens per {TRACE_BLOCK}-token trace block (scales prompt length)",
    )
    w.add_argument("--max-prompt-tokens", type=int, default=Scale.max_prompt_tokens)
    w.add_argument("--max-output-tokens", type=int, default=Scale.max_output_tokens)
    w.add_argument(
        "--sample-every",
        type=COUNT,
        metavar="K",
        help="replay every K-th conversation of the first K x --conversations, so new conversations arrive "
        f"spread out as in the trace, not in one burst (default {DEFAULT.sample_every}; --full {FULL.sample_every})",
    )
    w.add_argument(
        "--trace-window-s",
        type=WINDOW_S,
        help=f"drop turns that arrive later than this many seconds into "
        f"the trace (default {DEFAULT.trace_window_s:g}; --full: none; 0: none)",
    )
    w.add_argument(
        "--time-scale",
        type=FACTOR,
        help=f"trace seconds per replay second (default {DEFAULT.time_scale:g}: "
        f"the trace's arrivals {DEFAULT.time_scale:g}x faster; --full {FULL.time_scale:g})",
    )
    w.add_argument("--concurrency", type=COUNT, default=8, help="requests in flight at most (default 8)")
    w.add_argument(
        "--ready-timeout",
        type=POSITIVE_S,
        help="seconds a freshly served graph may take to answer "
        "before its configuration counts as failed (default: the engine's, vllm 900, reference 300)",
    )
    w.add_argument(
        "--request-timeout",
        type=POSITIVE_S,
        default=120,
        help="seconds one request may take before it counts as an error (default 120)",
    )
    w.add_argument(
        "--full",
        action="store_true",
        help="a longer replay: more conversations, every configuration at every device size of a wider sweep",
    )
    m = p.add_argument_group("comparing runs")
    m.add_argument(
        "--repeat",
        type=COUNT,
        default=1,
        metavar="N",
        help="run every row N times, interleaved (all rows, then all again), so drift on the machine hits "
        "every row alike; the report gives each row's median and range (min-max) of hit rate, TTFT p50/p90 "
        "and goodput, and says which differences exceed them (default 1)",
    )
    m.add_argument(
        "--higher-rate",
        type=RATE,
        metavar="X",
        help="also replay the first device size's configurations with the arrivals X times as fast "
        "(--time-scale times X), for goodput under more load than the trace's (default "
        f"{DEFAULT.higher_rate:g}; --full {FULL.higher_rate:g}; 0: not)",
    )
    m.add_argument(
        "--ttft-target",
        type=_ttft_target,
        default="2x",
        metavar="MS|Kx",
        help="goodput counts the requests whose TTFT met this: milliseconds (e.g. 200) or K times the "
        "no-offload row's TTFT p50 at the trace's rate (default 2x: what the same graph without offload "
        "gives in the trace's own load, with room for its spread; relative, so a slower machine is judged "
        "by its own baseline)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", help="results folder (default replay-results/<UTC time>)")
    o.add_argument("--json", help="also append each configuration's summary to this JSONL file")
    o.add_argument("--logs", action="store_true", help="stream the components' logs (default: files only)")


def run(args: argparse.Namespace) -> int:
    from dynamo_flexkv.core.sysutil import sigterm_interrupts
    from dynamo_flexkv.serve import GraphError
    from dynamo_flexkv.serve.launcher import ComponentDied

    # SIGTERM as Ctrl-C: the KeyboardInterrupt unwinds through serve_and_replay and Stopping, which
    # stop the graphs this replay started (their processes run in their own sessions: a signal to the
    # replay alone would orphan them).
    try:
        with sigterm_interrupts():
            return _run(args)
    except (GraphError, ComponentDied, TimeoutError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("replay: interrupted; the graphs it started are stopped", file=sys.stderr)
        return 130


def _for_engine(configs: str, engine: str) -> str:
    """The default configurations the engine serves: without the vLLM-only ones (hints) on the
    reference engine."""
    from dynamo_flexkv.replay.configs import CONFIGURATIONS

    if engine == "vllm":
        return configs
    return ",".join(n for n in configs.split(",") if not CONFIGURATIONS[n].vllm_only)


def _with_peer(configs: str, engine: str) -> str:
    """The default configurations, with the LMCache row when the peer is installed (vLLM only)."""
    from dynamo_flexkv.bench.peer_lmcache import INSTALL, missing_reason, prefix_dir

    if engine != "vllm":
        return configs
    why = missing_reason(prefix_dir())
    if why:
        sys.stderr.write(f"replay: no lmcache row ({why}; {INSTALL} adds it)\n")
        return configs
    return configs + ",lmcache"


def _check_peers(configs, engine: str) -> None:
    """A peer or hints configuration runs on vLLM, with its peer installed: refused before anything is served."""
    from dynamo_flexkv.bench.peer_lmcache import INSTALL, missing_reason, prefix_dir

    for c in configs:
        if c.vllm_only and engine != "vllm":
            raise ValueError(f"configuration {c.name} runs vLLM workers: use --engine vllm")
        why = missing_reason(prefix_dir()) if c.peer == "lmcache" else None
        if why:
            raise ValueError(f"configuration {c.name}: {why}; install it with {INSTALL}")


def _run(args: argparse.Namespace) -> int:
    from dynamo_flexkv.replay.accounting import AccountingError
    from dynamo_flexkv.replay.configs import (
        ENGINES,
        ConfigRun,
        Configuration,
        ReplaySettings,
        ServeSettings,
        device_block_list,
        parse_configs,
        replay_url,
        serve_and_replay,
    )
    from dynamo_flexkv.replay.report import apply_goodput, first_error, markdown, summarize, write_jsonl
    from dynamo_flexkv.serve.launcher import ComponentDied

    preset = FULL if args.full else DEFAULT
    engine = ENGINES[args.engine]
    args.graph = args.graph or resolve(GRAPHS, engine.graph)
    args.config = args.config or resolve(CONFIGS, engine.config)
    every = args.sample_every if args.sample_every is not None else preset.sample_every
    if every < 1:
        raise ValueError(f"--sample-every {every} must be >= 1")
    args.time_scale = args.time_scale if args.time_scale is not None else preset.time_scale
    conversations = args.conversations if args.conversations is not None else preset.conversations
    if conversations < 1:
        raise ValueError(f"--conversations {conversations} must be >= 1")
    scale = Scale(
        conversations=conversations * every,
        min_turns=args.min_turns,
        max_turns=args.max_turns,
        tokens_per_hash_block=args.tokens_per_hash_block,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
    )
    args.set = [*engine_overrides(engine, args, scale), *args.set]  # an explicit --set still wins
    window = args.trace_window_s if args.trace_window_s is not None else preset.trace_window_s
    window = window or None  # 0: no window
    turns = within_window(sampled(trace_turns(scale, args.trace), every), window)
    picked = (f"every {every}th of " if every > 1 else "") + scale.describe()
    if window:
        picked += f"; turns within the trace's first {window:g} s"
    workload = (
        f"{len(turns)} requests: {picked}; arrivals at trace time / {args.time_scale:g}, a turn "
        f"never before the previous turn of its conversation answered, at most {args.concurrency} in flight"
    )
    if args.url:
        plan = [(Configuration("served", f"the graph at {args.url}", ()), 0)]
    else:
        sizes = device_block_list(args.device_blocks or preset.device_blocks)
        main = parse_configs(args.configs or _with_peer(_for_engine(preset.configs, args.engine), args.engine))
        sweep = (
            parse_configs(args.sweep_configs)
            if args.sweep_configs
            else (main if args.full else parse_configs(_for_engine(preset.sweep_configs, args.engine)))
        )
        _check_peers([*main, *sweep], args.engine)
        plan = [(c, sizes[0]) for c in main] + [(c, b) for b in sizes[1:] for c in sweep]
        _check_context(args, scale, min(sizes))
    higher = args.higher_rate if args.higher_rate is not None else preset.higher_rate
    if 0 < higher <= 1:
        raise ValueError(f"--higher-rate {higher:g} must be > 1 (a faster rate than the trace's) or 0 (none)")
    schedule = interleaved(plan, higher, args.repeat)
    out = Path(args.out or f"replay-results/{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    out.mkdir(parents=True, exist_ok=True)
    setup = _setup(args, plan)
    sys.stderr.write(
        f"replay: {workload}\nreplay: {len(schedule)} runs: "
        f"{', '.join(_run_label(c.name, b, r, k, args.repeat) for c, b, r, k in schedule)}; results in {out}\n"
    )
    base = ReplaySettings(
        turns,
        args.time_scale,
        args.concurrency,
        args.request_timeout,
        args.engine,
        args.client,
        _block_size(args),
    )
    serve = ServeSettings(args.graph, args.config, args.set, args.logs, args.ready_timeout)
    t_start = time.perf_counter()
    runs: list[ConfigRun] = []
    failed: list[str] = []
    stopping = Stopping()
    try:
        for config, blocks, rate, rep in schedule:
            label = _run_label(config.name, blocks, rate, rep, args.repeat)
            replay = replace(base, time_scale=base.time_scale * rate)
            progress = Progress(len(turns), label)
            t_run = time.perf_counter()  # the row's own time: its graph's start and its replay
            try:
                if args.url:
                    progress.start()
                    run = replay_url(
                        args.url,
                        args.model or _served_name(args),
                        replay,
                        ports=_ports(args.worker_metrics),
                        on_done=progress.done,
                        model_dir=_tokenizer_dir(args) if args.client == "aiperf" else None,
                    )
                else:

                    def ready(progress=progress) -> None:
                        stopping.wait()  # the previous graph is gone before this one is measured
                        progress.start()

                    run, launcher = serve_and_replay(
                        config, blocks, replay, serve, on_done=progress.done, on_ready=ready
                    )
                    stopping.start(launcher)  # stops while the next graph starts
            except (ComponentDied, TimeoutError, RuntimeError, OSError) as e:  # this run only: the others count
                failed.append(f"{label}: {e}")
                sys.stderr.write(f"error: {failed[-1]}\n")
                continue
            finally:
                progress.close()
            run.repeat = rep
            try:
                s = summarize(run, base.time_scale)
            except AccountingError as e:  # a table that does not add up explains nothing: loudly
                failed.append(f"{label}: the accounting does not add up: {e}")
                sys.stderr.write(f"error: {failed[-1]}\n")
                continue
            runs.append(run)
            # written now: kept if a later run fails (rewritten with goodput at the end)
            write_jsonl(out / "results.jsonl", [s], [run], workload, setup, per_request=True)
            sys.stderr.write(
                f"{label}: {s.requests} requests, {s.errors} errors, TTFT p50 "
                f"{s.ttft_p50_ms:.0f} ms, {s.hit_rate['all']:.0%} of prompt tokens cached, "
                f"{run.wall_s:.0f} s of replay, {time.perf_counter() - t_run:.0f} s since its graph started; "
                f"accounting {s.account_check}"
                + (
                    f"; hints seen {s.hints.get('hints_seen', 0):.0f}, used {s.hints.get('hints_used', 0):.0f}"
                    if run.config.hints
                    else ""
                )
                + "\n"
            )
    finally:
        stopping.wait()
    if not runs:
        print("error: no configuration ran: " + "; ".join(failed), file=sys.stderr)
        return 1
    summaries = [summarize(r, base.time_scale) for r in runs]
    why = apply_goodput(summaries, runs, args.ttft_target)
    (out / "results.jsonl").unlink(missing_ok=True)
    write_jsonl(out / "results.jsonl", summaries, runs, workload, setup, per_request=True)
    report = markdown(summaries, workload, setup, why)
    if failed:
        report += "\nRuns that failed (not in the table): " + "; ".join(failed) + "\n"
    (out / "report.md").write_text(report)
    if args.json:
        write_jsonl(Path(args.json), summaries, runs, workload, setup, per_request=False)
    from dynamo_flexkv.replay.plots import write_plots

    first = [i for i, s in enumerate(summaries) if s.rate == 1.0 and s.repeat == 1]  # one curve per row
    pngs = write_plots(out, [runs[i] for i in first], [summaries[i] for i in first], runs[0].device_blocks)
    print(report)
    print(
        f"Wall time {time.perf_counter() - t_start:.0f} s for {len(runs)} runs. Results in {out}/: report.md, "
        f"results.jsonl (summaries and every request)"
        + (f", {', '.join(p.name for p in pngs)}" if pngs else " (no plots: no request succeeded)")
        + (f"; summaries appended to {args.json}" if args.json else "")
    )
    err = first_error(runs)
    if err:
        print(f"error: {sum(s.errors for s in summaries)} requests failed; the first: {err}", file=sys.stderr)
    return 1 if err or failed else 0


def interleaved(plan: list[tuple[Any, int]], higher: float, repeats: int) -> list[tuple[Any, int, float, int]]:
    """(configuration, device blocks, rate, repetition) in the order they run: every row at the
    trace's rate, then the first size's rows at the ``higher`` rate (0: none), then all of it again
    for the next repetition, so drift on the machine hits every row alike."""
    faster = [(c, b) for c, b in plan if b == plan[0][1]] if higher else []
    out: list[tuple[Any, int, float, int]] = []
    for rep in range(1, repeats + 1):
        out += [(c, b, 1.0, rep) for c, b in plan] + [(c, b, higher, rep) for c, b in faster]
    return out


def _run_label(config: str, blocks: int, rate: float, rep: int, repeats: int) -> str:
    return f"{config} @{blocks}" + (f" x{rate:g}" if rate != 1.0 else "") + (f" #{rep}" if repeats > 1 else "")


def _block_size(args: argparse.Namespace) -> int:
    """Tokens per KV block of the engine's workers (the accounting's unit)."""
    if args.engine == "vllm":
        return _vllm_block_size(args)
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

    return EngineModelConfig.load(_worker_section(args).get("model") or "small").block_size


class Stopping:
    """Stops one served graph in the background (its drain and exit take a while), so the next
    graph starts meanwhile; ``wait`` before measuring anything."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def start(self, launcher) -> None:
        self.wait()
        self.thread = threading.Thread(target=launcher.shutdown, name="stop-graph")
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


class Progress:
    """A progress bar per run that starts when its graph is ready (startup is not replay time)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.bar = total, label, None

    def start(self) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, desc=self.label, unit="req", file=sys.stderr, dynamic_ncols=True)

    def done(self, rec) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if rec.error:
                self.bar.set_postfix_str(f"error: {rec.error[:60]}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def engine_overrides(engine, args: argparse.Namespace, scale: Scale) -> list[str]:
    """What the replay sets on the engine's workers before the user's --set: the host tier size,
    and for vLLM a --max-model-len of the longest prompt plus output, in whole blocks (vLLM's
    device cache must hold one such request besides the block it keeps back, so a small device
    cache needs a short max-model-len; 4096 would need 65 blocks of 64 tokens)."""
    host_gb = args.host_gb if args.host_gb is not None else HOST_GB[engine.name]
    out = [f"{engine.worker}.cache.cpu_cache_gb={host_gb}"]
    if engine.name == "vllm":
        block = _vllm_block_size(args)
        need = scale.max_prompt_tokens + scale.max_output_tokens
        out.append(f"{engine.worker}.max-model-len={-(-need // block) * block}")
    return out


def _worker_section(args: argparse.Namespace, overrides: list[str] | None = None) -> dict:
    from dynamo_flexkv.replay.configs import ENGINES
    from dynamo_flexkv.serve.plan import apply_overrides, load_config

    cfg = apply_overrides(load_config(args.config), args.set if overrides is None else overrides)
    return {**(cfg.get("Common") or {}), **(cfg.get(ENGINES[args.engine].worker) or {})}


def _vllm_block_size(args: argparse.Namespace) -> int:
    return int(_worker_section(args).get("block-size") or 64)


def _tokenizer_dir(args: argparse.Namespace) -> Path:
    """For aiperf against --url: a model directory of the config's preset (its tokenizer; aiperf
    counts tokens by the server's usage), or the config's model when it is a local directory."""
    import tempfile

    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

    model = str(_worker_section(args).get("model") or "small")
    if Path(model).is_dir():
        return Path(model)
    return write_model_dir(EngineModelConfig.load(model), Path(tempfile.mkdtemp(prefix="dynamo-flexkv-tokenizer-")))


def _served_name(args: argparse.Namespace) -> str:
    return str(_worker_section(args).get("served-model-name") or "flexkv-small")


def _check_context(args: argparse.Namespace, scale: Scale, device_blocks: int) -> None:
    """A worker holds a request's prompt and output in its device cache and refuses what cannot fit
    (vLLM: its --max-model-len must hold them, and the device cache one max-model-len request
    besides the block vLLM keeps back)."""
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

    w = _worker_section(args)
    need = scale.max_prompt_tokens + scale.max_output_tokens
    if args.engine == "vllm":
        block, max_len = int(w.get("block-size") or 64), int(w.get("max-model-len") or 4096)
        if need > max_len:
            raise ValueError(
                f"--max-prompt-tokens {scale.max_prompt_tokens} + --max-output-tokens "
                f"{scale.max_output_tokens} exceed VllmWorker.max-model-len={max_len}, which vLLM "
                f"would refuse: lower them or raise max-model-len (--set)"
            )
        if -(-max_len // block) > device_blocks - 1:
            raise ValueError(
                f"a device cache of {device_blocks} blocks of {block} tokens cannot hold one request of "
                f"max-model-len {max_len} (vLLM keeps one block back): raise the smallest "
                f"--device-blocks to {-(-max_len // block) + 1} or lower --max-prompt-tokens"
            )
        return
    block = EngineModelConfig.load(w.get("model") or "small").block_size
    if need > device_blocks * block:
        raise ValueError(
            f"--max-prompt-tokens {scale.max_prompt_tokens} + --max-output-tokens "
            f"{scale.max_output_tokens} do not fit a device cache of {device_blocks} blocks of {block} "
            f"tokens ({device_blocks * block} tokens), so the worker would refuse such requests: "
            f"lower --max-prompt-tokens or raise the smallest --device-blocks"
        )


def sampled(turns: list[Turn], every: int) -> list[Turn]:
    """Every ``every``-th conversation, renumbered 0, 1, ..."""
    return [replace(t, conversation=t.conversation // every) for t in turns if t.conversation % every == 0]


def within_window(turns: list[Turn], window_s: float | None) -> list[Turn]:
    """The turns that arrive within the trace's first ``window_s`` seconds (all when None)."""
    if window_s is None:
        return turns
    if window_s < 0:
        raise ValueError(f"--trace-window-s {window_s:g} must be >= 0 seconds (0: no window)")
    t0 = min(t.timestamp_ms for t in turns)
    return [t for t in turns if t.timestamp_ms - t0 <= window_s * 1000]


def _ports(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--worker-metrics {text!r}: expected comma-separated ports") from None


def _setup(args: argparse.Namespace, plan) -> str:
    from dynamo_flexkv.replay.configs import ENGINES

    engine = ENGINES[args.engine]
    if args.url:
        return f"the graph served at {args.url} ({engine.description})"
    from dynamo_flexkv.serve.plan import apply_overrides, load_config

    cfg = apply_overrides(load_config(args.config), args.set)
    w, fe = cfg.get(engine.worker, {}), cfg.get("Frontend", {})
    cache = w.get("cache", {})
    common = cfg.get("Common", {})
    vllm = f", max-model-len {w.get('max-model-len')}" if args.engine == "vllm" else ""
    return (
        f"{Path(args.graph).name} with {Path(args.config).name}: {w.get('replicas', 1)} {engine.description} "
        f"of model {w.get('model', common.get('model'))}{vllm}, "
        f"each with the device KV cache of the run (blocks per worker "
        f"in the table), host tier {cache.get('cpu_cache_gb')} GB and SSD tier {cache.get('ssd_cache_gb')} GB "
        f"(a fresh directory per run) unless the configuration removes them; router "
        f"{fe.get('router-mode', 'kv')} with host/disk hit weights {fe.get('router-host-cache-hit-weight')}/"
        f"{fe.get('router-disk-cache-hit-weight')} unless the configuration changes them; every configuration "
        f"on a freshly started graph"
    )
