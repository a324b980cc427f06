"""Benchmarks: ``python -m dynamo_flexkv.bench <name> [--json FILE]``.

Each measures its baseline in the same run and prints ours, baseline and their ratio.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dynamo_flexkv.bench.report import Case, print_table, write_json

# name -> (module, one-line description).
BENCHES: dict[str, tuple] = {
    "index": ("dynamo_flexkv.bench.index", "hash + longest-prefix match, insert, evict vs Dynamo's RadixTree"),
    "links": (
        "dynamo_flexkv.bench.links",
        "device<->host and host<->disk bandwidth vs same-run contiguous copy / sequential disk batch",
    ),
    "ttft": ("dynamo_flexkv.bench.ttft", "reference-engine TTFT with cached prefixes vs same-run recompute"),
    "throttled": (
        "dynamo_flexkv.bench.throttled",
        "reference-engine TTFT, cost-aware loading vs always-load with a "
        "throttled disk tier (slower than recompute) and a host hit, vs same-run recompute",
    ),
    "remote": ("dynamo_flexkv.bench.remote", "Redis put/get GB/s (standalone and cluster) vs same-run redis-benchmark"),
    "disagg": ("dynamo_flexkv.bench.disagg", "prefill->decode KV handover GB/s over NIXL vs same-run raw NIXL READ"),
    "vllm": (
        "dynamo_flexkv.bench.vllm_ttft",
        "real vLLM TTFT, FlexKVConnector host/disk/remote hits vs same-run recompute and vLLM's own prefix-cache hit",
    ),
    "node": (
        "dynamo_flexkv.bench.node",
        "node cache vs embedded tiers at the engine contract: host-90 loads, lookup "
        "round trips, attach; the engine-driven data path vs the service copying into the engine's KV",
    ),
    "events": (
        "dynamo_flexkv.bench.events",
        "Dynamo's KvRouter fed by 100-1,000 simulated workers' tier-tagged KV "
        "events (lag, drops, router CPU/RSS, decision latency) vs same-run device-only events",
    ),
}
# Not in `all`: bench vllm needs vLLM installed and starts three vLLM engines one after the other
# (~4 min at full sizes on 2 CPU cores); run it by name. bench events runs 12 router/publisher
# rounds (~10 min at full sizes), also by name.
NOT_IN_ALL = {"vllm", "events"}
# Benchmarks whose ratio is better when higher (bandwidths); the rest report times.
HIGHER_IS_BETTER = {"links", "remote", "disagg"}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="python -m dynamo_flexkv.bench", description=__doc__)
    parser.add_argument(
        "name",
        choices=[*BENCHES, "all"],
        help=f"which benchmark ('all' runs every one but {', '.join(sorted(NOT_IN_ALL))})",
    )
    parser.add_argument("--json", metavar="FILE", help="also write one JSON object per case to FILE")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (smoke runs)")
    parser.add_argument("--dir", help="directory for disk benchmarks (default: a temporary one under /tmp)")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where the engine's KV tensors live (default: cuda when available; bench vllm: "
        "the platform of the installed vLLM)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help="bench vllm: timed requests per case (default 3, --quick 2); bench disagg --vllm: timed handovers "
        "per size (default 12, --quick 4); bench node: repeats per case (default 15, --quick 5)",
    )
    parser.add_argument(
        "--sizes",
        metavar="LIST",
        help="bench vllm: prompt sizes in tokens, e.g. 2k,8k (default 2k,8k,32k; --quick 2k,8k); "
        "bench disagg --vllm: handed-over prompt sizes (default 256,1k,2k with --model "
        "kv-llama-1b, 1k,4k,8000 with small)",
    )
    parser.add_argument(
        "--model",
        metavar="PRESET",
        help="bench disagg --vllm: the model preset (configs/models) of both engines (default "
        "kv-llama-1b: a 1B model's KV, 32 KiB per token; small: the demo preset, 2 KiB); "
        "bench vllm: small (default) or a Hugging Face preset: hybrid-sw (sliding-window "
        "hybrid), mla-small (MLA; vLLM's CPU MLA has no prefix cache: no device-hit rows)",
    )
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="bench disagg: the vLLM disagg graphs' handover (two vLLM engines, on loopback and, as "
        "root, across network-namespace nodes) instead of the reference engine's cases",
    )
    parser.add_argument(
        "--handover-verify",
        metavar="LIST",
        default="owner,bytes",
        help="bench disagg --vllm: the handover_verify modes to measure, each with its own engines "
        "(default owner,bytes)",
    )
    parser.add_argument(
        "--compare-offloading-connector",
        action="store_true",
        help="bench vllm: also vLLM's OffloadingConnector (CPU spec) on the same prompts "
        "(CUDA/XPU only; skipped with a message on CPU)",
    )
    parser.add_argument(
        "--peer",
        choices=["lmcache"],
        help="bench vllm: also LMCache 0.5.6 (multi-process server + LMCacheMPConnector) on the same "
        "engine and prompts: its CPU and disk tiers, miss path and restart beside ours, and "
        "*-vs-lmcache-* rows (ratio = our TTFT / LMCache's); install it first with make "
        "peer-lmcache (exit 2 if absent)",
    )
    parser.add_argument(
        "--node",
        action="store_true",
        help="bench vllm: also ours through the node cache (dynamo-flexkv cache-server, the same host "
        "and disk sizes) beside ours embedded: miss, host, disk and restart interleaved, and "
        "*-node-vs-embedded-* rows (ratio = through the node cache / embedded)",
    )
    parser.add_argument(
        "--pull",
        action="store_true",
        help="bench vllm: instead of the tier cases, a prefix pulled on a Dynamo router hint (kv.fetch) "
        "from another engine's host tier against recompute, the receiver's own host tier and the Redis "
        "remote tier, four engines interleaved (default sizes 8k,32k; --quick 8k): pull-*, "
        "pull-vs-recompute-*, pull-vs-host-*, pull-vs-remote-*, the loopback ceiling (pull-read-*) and "
        "Redis bytes per block (docs/BENCHMARKS.md)",
    )
    parser.add_argument(
        "--workers", metavar="LIST", help="bench events: simulated worker counts (default 100,300,1000; --quick 20)"
    )
    parser.add_argument(
        "--transports", metavar="LIST", help="bench events: event planes, zmq and/or nats (default zmq,nats)"
    )
    parser.add_argument(
        "--duration", type=float, metavar="S", help="bench events: measured seconds per case (default 15)"
    )
    parser.add_argument("--warmup", type=float, metavar="S", help="bench events: seconds before measuring (default 10)")
    parser.add_argument(
        "--rate", type=float, metavar="R", help="bench events: requests/s per simulated worker (default 0.5)"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="bench events: the curve over worker counts as a PNG")
    parser.add_argument(
        "--rows", metavar="FILE", help="bench events: every raw measurement as JSON lines, written as each case ends"
    )
    return parser


def run(args: argparse.Namespace) -> list[Case]:
    if getattr(args, "peer", None) and args.name != "vllm":
        print(
            f"bench {args.name}: --peer {args.peer} is bench vllm's (run: bench vllm --peer {args.peer})",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)
    if getattr(args, "node", False) and args.name != "vllm":
        print(
            f"bench {args.name}: --node is bench vllm's (bench node measures the node cache at the engine contract)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)
    if getattr(args, "pull", False) and (args.name != "vllm" or args.peer or args.node):
        print(
            f"bench {args.name}: --pull is bench vllm's, alone (run: bench vllm --pull [--sizes ...] [--repeat N])",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)
    names = [n for n in BENCHES if n not in NOT_IN_ALL] if args.name == "all" else [args.name]
    cases: list[Case] = []
    for name in names:
        module_name = BENCHES[name][0]
        if name == "disagg" and getattr(args, "vllm", False):  # the vLLM engines' handover instead
            module_name = "dynamo_flexkv.bench.vllm_disagg"
        if name == "vllm" and getattr(args, "pull", False):  # the hinted pull's cases instead
            module_name = "dynamo_flexkv.bench.vllm_pull"
        got = importlib.import_module(module_name).run(args)
        print_table(got, lower_is_better=name not in HIGHER_IS_BETTER)
        cases.extend(got)
    if args.json:
        write_json(cases, args.json)
        print(f"\nwrote {len(cases)} cases to {args.json}")
    return cases


def run_command(args: argparse.Namespace) -> int:
    """The one entry point of ``python -m dynamo_flexkv.bench`` and ``dynamo-flexkv bench``: runs
    ``args`` (from build_parser) and returns the exit status."""
    from dynamo_flexkv.core.transfer.nixl_agent import exit_past_libnl

    with exit_past_libnl():  # bench disagg creates UCX agents in this process: exit 0, not libnl's exit-time SIGSEGV
        run(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))
