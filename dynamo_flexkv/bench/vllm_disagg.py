"""``bench disagg --vllm``: the vLLM disagg graphs' P->D handover against a raw NIXL READ of the
same bytes between the same two processes, in the same run.

Two vLLM engines (CPU or CUDA, the installed build) in the roles of graphs/disagg_vllm.py, each
with the graph's MultiConnector [FlexKVConnector (carrying the handover), NixlConnector], each in a
process of its own (``--serve SPEC``, driven over stdin by this process). Per prompt size and
repeat, a fresh prompt:

* the prefill engine computes it (``do_remote_decode``) and holds its blocks for decode;
* handover: the decode engine generates it with those kv_transfer_params; timed inside its worker
  by FlexKVConnector, from the start of its read to the bytes verified against the prefill's
  digests (what vLLM waits for before it computes the last token), its block and byte counts
  checked;
* raw NIXL, the baseline: inside the same engine step, just before or just after the handover
  (alternating between repeats), one prepared NIXL READ of the same prefill blocks into the same
  decode blocks on the same two agents (bench/disagg.py's ``RawRead``: no digests, no verify, no
  bookkeeping). Same step, so both reads share the step's load; same agents and blocks, because
  that is the same transfer (vLLM's blocks for a request are cold in cache, where a bench buffer
  read over and over is warm).
* beside it, between steps (``collective_rpc``, the engine idle): a NIXL agent of our own in each
  of the two worker processes (the prefill one over vLLM's KV tensors, the decode one over zeroed
  blocks of the same shape) READs the same blocks, after one untimed read warmed the source.

The model is a preset of configs/models (``--model``, default ``kv-llama-1b``: Llama-3.2-1B's KV
geometry, 32 KiB per token, on a narrow body so a CPU prefill stays short); sizes per model
(``--sizes``). Each engine's worker runs on its own half of the cores; both engines' engine-core
processes (which spin-wait for each step's result) and this process's threads during a handover
case run on the prefill's half, as on a GPU node where each has a core of its own.

Placements: ``loopback`` (both on 127.0.0.1; UCX picks its transports for both alike) and
``nodes`` (prefill on node B, decode on node C, network namespaces joined by veth pairs, UCX over
TCP on the link: serve/nodes.py; needs root, skipped with a note otherwise). Ratio = handover
GB/s / raw GB/s (1.0: the handover adds nothing).

Then the served vLLM graphs on bench disagg's mixed workload (``vllm-serving`` cases): TTFT and
inter-token latency p50/p99 of graphs/disagg_vllm.py against graphs/agg_vllm.py."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from dynamo_flexkv.bench.report import Case
from dynamo_flexkv.bench.vllm_engine import READY, RESULT
from dynamo_flexkv.integrations.disagg.params import KEY
from dynamo_flexkv.integrations.vllm_connector.handover import KEY as HANDOVER_KEY

MAX_MODEL_LEN = 8192
BLOCK_SIZE = 64
# Default model: a 1B model's KV per token (32 KiB) on a narrow body. A handover's fixed costs (its
# checks, the digests, ~0.05-0.1 ms of CPU here) weigh on bytes per prompt, and the demo preset's
# 2 KiB per token made a 1K-token handover 1.9 MiB: a 0.3 ms read, smaller than any real model's.
MODEL = "kv-llama-1b"
SIZES = {"kv-llama-1b": (256, 1024, 2048), "small": (1024, 4096, 8000)}
SIDE_PORTS = {"prefill": 5631, "decode": 5632}  # NixlConnector's handshake listeners
_held: dict[str, Any] = {}  # in a worker process: its raw agent, the handover log


def disagg_transfer_config(run_dir: str, lease_s: float = 30.0, verify: str = "owner") -> dict[str, Any]:
    """The disagg_vllm graph's kv_transfer_config, built as serve/vllm_worker.py builds it:
    FlexKVConnector first, carrying the handover; NixlConnector after it, as Dynamo requires."""
    from dynamo_flexkv.serve.vllm_worker import CONNECTOR, kv_transfer_config, nixl_connector

    extra = {"run_dir": run_dir, "handover": True, "handover_lease_s": lease_s}
    if verify != "owner":  # the graphs' default, left out as they leave it out
        extra["handover_verify"] = verify
    return kv_transfer_config([{**CONNECTOR, "kv_connector_extra_config": extra}, nixl_connector(lease_s)])


# ---- run inside vLLM's worker process by LLM.collective_rpc (pickled by reference) -------------------
def _flexkv_worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    group = get_kv_transfer_group()
    for c in getattr(group, "_connectors", [group]):
        if type(c).__name__ == "FlexKVConnector":
            return c
    raise RuntimeError("bench disagg --vllm: no FlexKVConnector in this worker's kv_transfer_config")


def rpc_handovers(worker) -> list[tuple]:
    """Decode's handovers so far: (seconds to read and verify, blocks, bytes, verify seconds, ok)."""
    return [
        (r.seconds, len(r.block_ids), r.nbytes, r.verify_seconds, r.ok)
        for r in _flexkv_worker().transfer_log
        if r.kind == "handover"
    ]


def _raw_agent(layers, name: str):
    from dynamo_flexkv.core.transfer.nixl_agent import KVAgent

    if "agent" not in _held:
        _held["agent"] = KVAgent(layers, name=f"bench-raw-{name}-{os.getpid()}")
    return _held["agent"]


def rpc_raw_source(worker, blocks: list[int]) -> dict[str, Any]:
    """The prefill worker's raw agent over vLLM's own KV tensors; what a reader needs of ``blocks``."""
    agent = _raw_agent(worker.model_runner.kv_caches, "prefill")
    from dynamo_flexkv.integrations.disagg.params import HandoverParams

    return HandoverParams.of_agent(agent, "bench", list(blocks), None, time.time() + 3600).to_dict()


def _raw_reads(worker, source: dict[str, Any], max_blocks: int, count: int):
    """(warm, timed): reads of the source's first ``count`` blocks into two zeroed regions of the
    decode worker's raw agent (never into vLLM's own blocks)."""
    import torch

    from dynamo_flexkv.bench.disagg import RawRead
    from dynamo_flexkv.integrations.disagg.params import HandoverParams

    t = worker.model_runner.kv_caches[0]
    agent = _raw_agent(
        [
            torch.zeros((2 * max_blocks, *t.shape[1:]), dtype=t.dtype, device=t.device)
            for _ in worker.model_runner.kv_caches
        ],
        "decode",
    )
    p = HandoverParams.from_dict(source)
    if p is None:
        raise ValueError("bench disagg --vllm: the prefill's kv_transfer_params carry no handover")
    n = min(count, len(p.blocks))
    if n > max_blocks:
        raise ValueError(f"bench disagg --vllm: {n} blocks exceed the raw agent's {max_blocks}")
    return RawRead(agent, p, range(n)), RawRead(agent, p, range(max_blocks, max_blocks + n))


def rpc_raw_read(worker, source: dict[str, Any], max_blocks: int, count: int) -> float:
    """The raw read between steps: one untimed read, then the timed one; returns its seconds."""
    warm, read = _raw_reads(worker, source, max_blocks, count)
    warm()
    t0 = time.perf_counter()
    read()
    return time.perf_counter() - t0


def rpc_raw_in_next_handover(worker, first: bool) -> None:
    """Arms the raw read for the next handover's engine step: the worker's next ``Handover.pull``
    (one-shot wrap) times, just before it (``first``) or just after it, one prepared READ of the
    same prefill blocks into the same local blocks on the handover's own agent."""
    from dynamo_flexkv.bench.disagg import RawRead

    handover = _flexkv_worker()._worker.handover
    pull = handover.pull

    def pull_beside_raw(h, first_block, local_blocks, *args, **kwargs):
        handover.pull = pull
        read = RawRead(handover.agent, h, local_blocks, h.blocks[first_block : first_block + len(local_blocks)])
        if first:
            t0 = time.perf_counter()
            read()
            _held["raw_in_step"] = time.perf_counter() - t0
        out = pull(h, first_block, local_blocks, *args, **kwargs)
        if not first:
            t0 = time.perf_counter()
            read()
            _held["raw_in_step"] = time.perf_counter() - t0
        return out

    _held.pop("raw_in_step", None)
    handover.pull = pull_beside_raw


def rpc_raw_in_step(worker) -> float:
    return _held.pop("raw_in_step")


# ---- the engine process --------------------------------------------------------------------------------
def serve(spec: dict[str, Any]) -> None:
    """One engine; per stdin line ``{"op": ...}`` one RESULT line:
    prefill ``{"prompt"}`` -> ``{"params", "raw"}``; decode ``{"op": "handover", "prompt", "params"}``
    -> ``{"seconds", "blocks", "bytes"}`` and ``{"op": "raw", "raw"}`` -> ``{"seconds"}``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc pickles this module's rpc_*
    if spec.get("engine_core_cpus"):  # this process and its engine core; the worker binds its own (below)
        os.sched_setaffinity(0, spec["engine_core_cpus"])
    llm = LLM(
        model=spec["model_dir"],
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        kv_cache_memory_bytes=int(spec["kv_cache_bytes"]),
        kv_transfer_config=disagg_transfer_config(spec["run_dir"], verify=spec.get("verify", "owner")),
        seed=0,
        disable_log_stats=False,
    )
    print(READY, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        prompt = [TokensPrompt(prompt_token_ids=cmd.get("prompt", []))]
        if cmd["op"] == "handover" and cmd.get("raw"):  # the baseline read, inside the same step
            llm.collective_rpc(rpc_raw_in_next_handover, args=(bool(cmd["raw_first"]),))
        if cmd["op"] == "prefill":
            out = llm.generate(
                prompt,
                SamplingParams(
                    max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
                ),
                use_tqdm=False,
            )[0]
            if out.kv_transfer_params is None:
                raise RuntimeError("bench disagg --vllm: the prefill returned no kv_transfer_params")
            params = dict(out.kv_transfer_params)
            blocks = params[HANDOVER_KEY]["blocks"]
            rec: dict[str, Any] = {"params": params, "raw": llm.collective_rpc(rpc_raw_source, args=(list(blocks),))[0]}
        elif cmd["op"] == "handover":
            seen = len(llm.collective_rpc(rpc_handovers)[0])
            llm.generate(
                prompt,
                SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": cmd["params"]}),
                use_tqdm=False,
            )
            new = llm.collective_rpc(rpc_handovers)[0][seen:]
            if len(new) != 1 or not new[0][4]:
                raise RuntimeError(
                    f"bench disagg --vllm: {len(new)} handovers for one request, ok: "
                    f"{[x[4] for x in new]} (expected one that verified)"
                )
            seconds, blocks, nbytes, verify_s, _ = new[0]
            rec = {"seconds": seconds, "blocks": blocks, "bytes": nbytes, "verify_s": verify_s}
            if cmd.get("raw"):
                rec["raw_in_step"] = llm.collective_rpc(rpc_raw_in_step)[0]
        elif cmd["op"] == "raw":
            rec = {
                "seconds": llm.collective_rpc(
                    rpc_raw_read, args=(cmd["raw"], int(cmd["max_blocks"]), int(cmd["blocks"]))
                )[0]
            }
        else:
            raise ValueError(f"bench disagg --vllm: unknown op {cmd['op']!r}")
        print(RESULT + json.dumps(rec), flush=True)


# ---- this process ----------------------------------------------------------------------------------------
def _placements(notes: list[str]):
    """(name, the nodes or None, (prefill's node, decode's node) or None), loopback first; the
    nodes are removed when the caller moves on."""
    yield "loopback", None, None
    if os.geteuid() != 0:
        notes.append("nodes: skipped (network namespaces need root)")
        return
    from dynamo_flexkv.serve.nodes import Nodes

    nodes = Nodes.up(prefix=f"fkvb{os.getpid() % 100000}", names=("B", "C"))
    try:
        yield "nodes", nodes, (nodes["B"], nodes["C"])
    finally:
        nodes.down()


@contextlib.contextmanager
def _off_decode_cores() -> Iterator[None]:
    """This process's threads on the prefill's cores while it drives the engines (it parses each
    prefill's answer while decode's step may already run), as its engines' schedulers are."""
    cores = sorted(os.sched_getaffinity(0))
    keep = cores[: max(1, len(cores) // 2)] if len(cores) > 1 else cores
    tids = [int(t) for t in os.listdir("/proc/self/task")]

    def pin(to) -> None:
        for tid in tids:
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, to)

    pin(keep)
    try:
        yield
    finally:
        pin(cores)


def _engines(workdir: str, model_dir: str | os.PathLike[str], where: str, nodes, verify: str = "owner") -> list[Any]:
    from dynamo_flexkv.bench.vllm_pair import ServedEngine
    from dynamo_flexkv.bench.vllm_setup import engine_env

    out = []
    cores = sorted(os.sched_getaffinity(0))
    for i, (role, node) in enumerate(zip(("prefill", "decode"), nodes or (None, None))):
        name = f"{where}-{verify}-{role}"
        env = engine_env(workdir, f"flexkv-{name}", 64 << 20, 0)
        # Each engine's OpenMP threads on cores of their own, as in a deployment (one GPU per
        # worker): with both on every core (and another test running) 2 MiB handovers took
        # 0.03-74 s and raw reads up to 2 s.
        half = max(1, len(cores) // 2)
        own = cores[:half] if i == 0 else (cores[half:] or cores)
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, own))
        # Both engine cores (schedulers) on the prefill's cores, as on a GPU node where each has a
        # core of its own: decode's spin-waits (sched_yield) for each step's result, and on its
        # worker's core that spin took 20-80% of the core from the step's reads; the prefill's steps
        # in a loop while it holds blocks for decode, so on decode's core it starved the handover.
        sched_cores = cores[:half] if len(cores) > 1 else []
        host = "127.0.0.1" if node is None else node.address
        env.update(
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(SIDE_PORTS[role]),
            VLLM_NIXL_SIDE_CHANNEL_HOST=host,
            VLLM_HOST_IP=host,
            **({} if node is None else node.ucx_env()),
        )
        spec = {
            "side": role,
            "model_dir": str(model_dir),
            "run_dir": env["FLEXKV_RUN_DIR"],
            "kv_cache_bytes": 512 << 20,
            "verify": verify,
            "engine_core_cpus": sched_cores,
        }
        out.append(ServedEngine(name, spec, env, workdir, module=__name__, wrap=() if node is None else node.argv([])))
    return out


def _handover_cases(
    where: str,
    prefill,
    decode,
    sizes: Sequence[int],
    repeat: int,
    seed: int,
    link: tuple | None,
    verify: str = "owner",
    model: str = MODEL,
) -> list[Case]:
    import random

    rng = random.Random(seed)
    cases = []
    max_blocks = max(sizes) // BLOCK_SIZE + 1
    for size in sizes:
        ours, raw, between, verify_s, nbytes = [], [], [], [], 0
        link_before = link[0].link_bytes(link[1].name) if link else None
        for i in range(repeat + 1):  # the first round connects the agents (handshakes) and warms up
            prompt = [rng.randrange(300, 30000) for _ in range(size)]
            p = prefill.call({"op": "prefill", "prompt": prompt}, 300, f"prefilling {size} tokens")
            raw_p = p["raw"][KEY]
            # decode reads the full blocks but the last token's (it computes that one itself)
            blocks = (size - 1) // BLOCK_SIZE
            nbytes = blocks * raw_p["block_bytes"] * len(raw_p["layer_addrs"])
            raw_cmd = {"raw": p["raw"], "max_blocks": max_blocks, "blocks": blocks}
            steps = [
                (
                    "handover",
                    {"op": "handover", "prompt": prompt, "params": p["params"], **raw_cmd, "raw_first": i % 2 == 1},
                ),
                ("raw", {"op": "raw", **raw_cmd}),
            ]
            # The step first, right after the prefill, whichever read leads in it: a read between
            # steps just before the step sped up its first read over the nodes' link (the handover
            # when it led: 120 vs 95 ms for 62 MiB; the raw read did not lead after one).
            got = {}
            for what, cmd in steps:
                got[what] = decode.call(cmd, 300, f"{what} of {size} tokens")
            h = got["handover"]
            if h["blocks"] != blocks or h["bytes"] != nbytes:
                raise RuntimeError(
                    f"bench disagg --vllm: the handover of {size} tokens read {h['blocks']} blocks, "
                    f"{h['bytes']} B; expected {blocks} blocks, {nbytes} B"
                )
            if i:
                ours.append(h["seconds"])
                verify_s.append(h["verify_s"])
                raw.append(h["raw_in_step"])
                between.append(got["raw"]["seconds"])
        t_ours, t_raw, t_between = statistics.median(ours), statistics.median(raw), statistics.median(between)
        label = f"{round(size / 1024)}K" if size >= 1024 else str(size)  # 8000 tokens: 8K
        note = (
            f"{model}, handover_verify={verify}, {nbytes / 2**20:.1f} MiB, "
            f"{t_ours * 1e3:.2f} ms per handover (read + verify; the verify "
            f"{statistics.median(verify_s) * 1e3:.2f} ms) vs {t_raw * 1e3:.2f} ms raw in the same step "
            f"({t_between * 1e3:.2f} ms raw between steps, own agents and buffers: ratio {t_between / t_ours:.2f}), "
            f"{blocks * len(raw_p['layer_addrs'])} descriptors each, medians of {repeat}; median of the per-step "
            f"ratios {statistics.median(r / o for r, o in zip(raw, ours)):.2f}, their range "
            f"{min(r / o for r, o in zip(raw, ours)):.2f}-{max(r / o for r, o in zip(raw, ours)):.2f}"
        )
        if link and link_before is not None:
            after = link[0].link_bytes(link[1].name)
            note += f"; node C's link received {after['rx'] - link_before['rx']:,} B"
        mode = f"{verify}-"
        model_tag = "" if model == MODEL else f"-{model}"
        cases.append(
            Case(
                "disagg",
                f"vllm-{where}-handover-{mode}{label}{model_tag}",
                nbytes / t_ours / 1e9,
                nbytes / t_raw / 1e9,
                "GB/s",
                "raw NIXL READ, same blocks, same agents, same engine step",
                note,
            )
        )
    return cases


def run(args: argparse.Namespace) -> list[Case]:
    from dynamo_flexkv.bench.vllm_setup import parse_sizes
    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

    # Every argument checked before anything starts (or a temp dir is made).
    model = getattr(args, "model", None)
    model = MODEL if model is None else model
    try:
        preset = EngineModelConfig.preset(model)
        sizes = list(SIZES.get(model, SIZES[MODEL]))
        sizes = (
            parse_sizes(args.sizes)
            if getattr(args, "sizes", None) is not None
            else (sizes[:2] if args.quick else sizes)
        )
    except ValueError as e:
        raise SystemExit(f"bench disagg --vllm: {e}") from None
    if max(sizes) >= MAX_MODEL_LEN:
        raise SystemExit(
            f"bench disagg --vllm: --sizes {max(sizes)} tokens: the engines hold at most "
            f"{MAX_MODEL_LEN - 1} (max_model_len {MAX_MODEL_LEN})"
        )
    if args.repeat is not None and args.repeat < 1:
        raise SystemExit(f"bench disagg --vllm: --repeat {args.repeat}: needs at least 1 timed handover per size")
    repeat = args.repeat or (4 if args.quick else 12)
    verify_arg = getattr(args, "handover_verify", None)
    modes = list(
        dict.fromkeys(m.strip() for m in ("owner" if verify_arg is None else verify_arg).split(",") if m.strip())
    )
    bad = [m for m in modes if m not in ("bytes", "owner")]
    if bad or not modes:
        raise SystemExit(
            f"bench disagg --vllm: --handover-verify {verify_arg!r}: expected bytes and/or owner, "
            f"comma-separated (e.g. owner,bytes)"
        )
    workdir = tempfile.mkdtemp(prefix="flexkv-bench-disagg-vllm-", dir=getattr(args, "dir", None))
    model_dir = write_model_dir(preset, os.path.join(workdir, "model"), context_length=MAX_MODEL_LEN)
    notes: list[str] = []
    cases: list[Case] = []
    for where, nodes, pair in _placements(notes):
        for verify in modes:
            engines = _engines(workdir, model_dir, where, pair, verify)
            try:
                for eng in engines:
                    eng.wait_ready(600)
                link = (nodes, pair[1]) if nodes else None
                prefill, decode = engines
                with _off_decode_cores():
                    cases += _handover_cases(
                        where, prefill, decode, sizes, repeat, seed=11, link=link, verify=verify, model=model
                    )
            finally:
                for eng in engines:
                    eng.stop()
    for n in notes:
        print(f"bench disagg --vllm: {n}")
    from dynamo_flexkv.bench.disagg import serving_cases

    return cases + serving_cases(args, engine="vllm")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        # Through the module's own name: collective_rpc then pickles the rpc_* functions by
        # reference (from __main__ they would travel by value, each call with a fresh _held).
        from dynamo_flexkv.bench.vllm_disagg import serve as serve_here

        with open(sys.argv[2], encoding="utf-8") as f:
            serve_here(json.load(f))
