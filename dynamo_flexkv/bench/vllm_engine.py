"""One vLLM engine configuration of ``bench vllm``, in a process of its own (vLLM engines are not
created twice in one process): ``python -m dynamo_flexkv.bench.vllm_engine SPEC.json OUT.json``.

SPEC (written by bench/vllm_ttft.py): ``role`` (which engine and which cases, see ROLES), model
directory, sizes, repeats, seed, engine sizes. OUT: per case, one record per timed request
(``wall_s``: wall time of ``llm.generate`` of one request with max_tokens=1; ``engine_s``: vLLM's
own first-token latency from RequestOutput.metrics; ``cached``: num_cached_tokens; ``token``: the
first token), plus the tier counters the checks read. A check that fails (the load did not come
from the tier it was meant to) exits non-zero with the reason on stderr.

Every timed request of a tier case starts from a settled engine: the previous requests' stores
done (vLLM's prefix cache resets only once every block is free, and our connector frees a stored
request's blocks only after their device copy) and our background writes drained.

``--serve SPEC`` runs the recompute / miss pair instead: two engines (no connector, ours) alive
at once, each timing the fresh prompts the parent sends it one at a time (see ``serve``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from dynamo_flexkv.bench import peer_lmcache as lmc
from dynamo_flexkv.bench.vllm_setup import ROLES, cached_tokens, fresh_prompt, prefix_prompt, suffix

if TYPE_CHECKING:
    from vllm.inputs import TokensPrompt

TINY = [5, 6, 7]  # a step that computes nothing worth storing (less than one block)
PROGRESS = "bench vllm |"  # lines the parent echoes
READY, RESULT = "bench vllm ready", "bench vllm result "  # serve mode's protocol lines


# ---- run inside vLLM's worker process by LLM.collective_rpc (pickled by reference) -------------------
def _conn():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def rpc_drain(worker, timeout: float) -> bool:
    return bool(_conn().drain(timeout))


def rpc_tier_stats(worker) -> dict[str, Any]:
    s = _conn().tier_stats()  # plain dicts cross collective_rpc
    return s.as_dict() if s is not None else {}


def rpc_drop_host(worker, timeout: float) -> int:
    """Evicts every host block (the disk copies stay): the next load reads the disk."""
    return _conn().evict_host(timeout)


def rpc_drop_local(worker, timeout: float) -> None:
    """Drops host and disk: only the remote tier (or a peer) still holds the prefix."""
    _conn().reset_tiers(timeout)


def rpc_hint_totals(worker) -> dict[str, float]:
    """The router hints' running totals (hints.py WorkerHints.totals), {} where hints are off."""
    side = _conn()._worker
    hints = getattr(side, "hints", None)
    return dict(hints.totals()) if hints is not None else {}


# ---- the engine process --------------------------------------------------------------------------------
class Engine:
    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM, SamplingParams

        self.spec = spec
        self.block = int(spec["block_size"])
        self.connector = spec["kv_transfer_config"] is not None
        self.ours = self.connector and spec["kv_transfer_config"]["kv_connector"] == "FlexKVConnector"
        self.lmcache_http: str | None = spec.get("lmcache_http")  # the LMCache server's admin API
        self.sp = SamplingParams(max_tokens=1, temperature=0)
        self.tiny_sp = SamplingParams(max_tokens=1, temperature=0)
        self.llm = LLM(
            model=spec["model_dir"],
            load_format="dummy",
            dtype="bfloat16",
            max_model_len=int(spec["max_model_len"]),
            block_size=self.block,
            enforce_eager=True,
            kv_cache_memory_bytes=int(spec["kv_cache_bytes"]),
            kv_transfer_config=spec["kv_transfer_config"],
            seed=0,
            disable_log_stats=False,
        )  # RequestOutput.metrics carries vLLM's first-token latency
        self.results: dict[str, list[dict[str, Any]]] = {}
        self.stored: set = set()  # sizes whose prefix this engine computed and stored (tier_request)
        self.info: dict[str, Any] = {"platform": _platform()}

    def generate(self, prompt: list[int], kv_hints: dict[str, Any] | None = None):
        """One request through ``LLM.generate``; ``kv_hints`` (the router's envelope as JSON) rides
        it as ``Request.kv_hints``, as dynamo.vllm hands it to vLLM (see hinted_engine)."""
        with hinted_engine(self.llm.llm_engine, kv_hints):
            return self.llm.generate([_tokens_prompt(prompt)], self.sp, use_tqdm=False)[0]

    def timed(self, case: str, prompt: list[int], kv_hints: dict[str, Any] | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        out = self.generate(prompt, kv_hints)
        wall = time.perf_counter() - t0
        m = out.metrics
        engine_s = float(m.first_token_latency) if m is not None and m.first_token_latency > 0 else None
        rec = {
            "wall_s": wall,
            "engine_s": engine_s,
            "cached": int(out.num_cached_tokens or 0),
            "token": int(out.outputs[0].token_ids[0]),
            "prompt_tokens": len(prompt),
        }
        self.results.setdefault(case, []).append(rec)
        print(
            f"{PROGRESS} {self.spec['role']}: {case} #{len(self.results[case])}: {wall * 1e3:.0f} ms, "
            f"{rec['cached']} cached",
            flush=True,
        )
        return rec

    def settle(self, timeout: float = 120.0) -> None:
        """Until every stored request's blocks are free (so vLLM's prefix cache resets) and our
        background writes drained. Tiny steps drive the connector (its stores start and finish
        in steps)."""
        deadline = time.monotonic() + timeout
        while not self.llm.reset_prefix_cache():
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's blocks still held after {timeout} s (stores not finished)")
            self.llm.generate([_tokens_prompt(TINY)], self.tiny_sp, use_tqdm=False)
            time.sleep(0.01)
        if self.ours and not self.rpc(rpc_drain, timeout):
            raise RuntimeError(f"FlexKVConnector writes still running after {timeout} s")
        if self.lmcache_http:  # its server writes L2 behind the store, as ours writes disk behind host
            lmc.wait_l2_written(self.lmcache_http, timeout)

    def rpc(self, fn: Callable, *args):
        return self.llm.collective_rpc(fn, args=args)[0]

    def stats(self) -> dict[str, Any]:
        if not self.ours:
            return {}
        out = self.rpc(rpc_tier_stats)
        hints = self.rpc(rpc_hint_totals)
        if hints:  # router hints on: their totals, and the blocks pulled (tier_request's counter)
            out["hints"] = dict(hints, pulled_blocks=int(hints.get("hint_pulled_tokens", 0)) // self.block)
        return out

    def router_hashes(self, tokens: list[int]) -> list[int]:
        """The vLLM block hashes of ``tokens``' full blocks as this engine's scheduler computes them
        (its prefix-caching hash algorithm, chained from NONE_HASH, no extra keys: plain token
        prompts) and as Dynamo's router names them in a kv.fetch hint: the low 64 bits."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

        from dynamo_flexkv.integrations.vllm_connector.hints import router_hash

        fn = get_hash_fn_by_name(self.llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(fn)  # what EngineCore does at start: the same seed (PYTHONHASHSEED or vLLM's default)
        out, parent = [], None
        for i in range(len(tokens) // self.block):
            parent = hash_block_tokens(fn, parent, tokens[i * self.block : (i + 1) * self.block], None)
            out.append(router_hash(parent))
        return out


@contextlib.contextmanager
def hinted_engine(engine: Any, kv_hints: dict[str, Any] | None) -> Iterator[None]:
    """While open, every request ``LLM.generate`` adds carries ``kv_hints`` as vLLM's
    KvHintsEnvelope: ``LLM._add_request`` calls ``llm_engine.add_request``, which takes
    ``kv_hints`` and hands it through EngineCoreRequest to ``Request.kv_hints`` (vLLM 0.31; what
    dynamo.vllm's handlers pass to ``engine_client.generate``). The request is timed on the same
    path as every other case."""
    if kv_hints is None:
        yield
        return
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    envelope = KvHintsEnvelope(  # as dynamo.vllm's _build_vllm_kv_hints builds it from the router's message
        protocol_version=str(kv_hints["protocol_version"]),
        message_id=str(kv_hints["message_id"]),
        actions=[
            KvHintAction(str(a["action_id"]), str(a["action_type"]), str(a["action_version"]), dict(a["payload"]))
            for a in kv_hints["actions"]
        ],
    )
    engine.add_request = functools.partial(type(engine).add_request, engine, kv_hints=envelope)
    try:
        yield
    finally:
        del engine.add_request  # the class's method again


def _tokens_prompt(ids: list[int]) -> TokensPrompt:
    from vllm.inputs import TokensPrompt  # vLLM is imported only where an engine runs

    return TokensPrompt(prompt_token_ids=ids)


def _platform() -> str:
    from vllm.platforms import current_platform

    return str(getattr(current_platform, "device_name", "") or current_platform.device_type)


def _delta(after: dict[str, Any], before: dict[str, Any], *path: str) -> int:
    a: Any = after
    b: Any = before
    for p in path:
        a, b = a.get(p, {}), b.get(p, {})
    return int(a or 0) - int(b or 0)


# Loaded cases: suffix kind of their prompts, what is dropped before each request, and where the
# blocks that came from the tier are counted (a tier_stats path; None: vLLM's count of cached
# tokens, for connectors without our counters).
TIER_CASES: dict[str, tuple[str, str | None, tuple[str, str] | None]] = {
    "host": ("device", None, ("host", "hit_blocks")),
    "disk": ("disk", "host", ("disk", "hit_blocks")),
    "remote": ("device", "local", ("requests", "remote_hit_blocks")),
    # bench vllm --pull: a router hint names a peer engine that holds the prefix in its host tier;
    # this engine's host and disk are dropped first, so the prefix can only come from the pull
    "pull": ("pull", "local", ("hints", "pulled_blocks")),
    # a fresh engine on the disk tier the previous one left: each request reads the re-adopted disk
    "restart": ("restart", "host", ("disk", "hit_blocks")),
    "offloading-host": ("device", None, None),
    # No per-tier hit counters of LMCache's: its L1 gaining only the suffix's chunks (host: nothing
    # was brought in from L2), or L1 emptied before the request (disk), with vLLM's count of cached
    # tokens, says where the prefix came from.
    "lmcache-host": ("device", "l1-holds", None),
    "lmcache-disk": ("disk", "l1", None),
    # a fresh engine against the server that kept running: its CPU tier outlived the engine
    "lmcache-restart": ("restart", "l1-holds", None),
    # through the node cache (its counters are the node's): as host and disk; the restart reads the
    # host tier the node cache kept while the engine that stored the prefix went
    "node-host": ("device", None, ("host", "hit_blocks")),
    "node-disk": ("disk", "host", ("disk", "hit_blocks")),
    "node-restart": ("restart", None, ("host", "hit_blocks")),
}
STORED_BY_ANOTHER_ENGINE = {"restart", "lmcache-restart", "node-restart", "pull"}
ROLE_CASES = {"flexkv": ("host", "disk"), "flexkv-remote": ("remote",), "offloading": ("offloading-host",)}


def _drop(e: Engine, what: str | None, blocks: int) -> int | None:
    """Returns LMCache's L1 object count for ``l1-holds``."""
    if what == "host":  # every host block; the disk copies stay
        e.rpc(rpc_drop_host, 120.0)
    elif what == "local":  # host and disk: only the remote tier holds the prefix
        e.rpc(rpc_drop_local, 120.0)
    elif what == "l1":
        lmc.clear_l1(str(e.lmcache_http))
    elif what == "l1-holds":
        return lmc.require_l1_holds(str(e.lmcache_http), blocks)
    return None


def tier_request(
    e: Engine, case: str, size: int, i: int, kv_hints: dict[str, Any] | None = None, stored_elsewhere: bool = False
) -> dict[str, Any]:
    """Request ``i`` of a loaded case: the 90% prefix + a suffix of the case's kind, from a settled
    engine after the case's drop; fails unless the prefix's blocks came from the case's tier. The
    first request of a size stores the prefix first (computed once; the connector stores it),
    unless another engine stored it (``stored_elsewhere``: bench vllm --pull's Redis reader).
    ``kv_hints``: a router hint the request carries (the ``pull`` case)."""
    kind, drop, counter = TIER_CASES[case]
    seed, bs = int(e.spec["seed"]), e.block
    hit = cached_tokens(size, bs)
    prefix = prefix_prompt(seed, size, bs)
    if size not in e.stored:
        if case not in STORED_BY_ANOTHER_ENGINE and not stored_elsewhere:
            e.generate(prefix)
        e.stored.add(size)  # from here on the tiers hold it (this engine stored it, or loads it)
    e.settle()
    l1_before = _drop(e, drop, hit // bs)
    before = e.stats()
    rec = e.timed(f"{case}-{size}", prefix + suffix(seed, size, bs, kind, i), kv_hints)
    if l1_before is not None:  # its L1 gained the suffix's chunks only: no prefix chunk came from L2
        e.settle()
        gained, want = lmc.l1_state(str(e.lmcache_http))["objects"] - l1_before, size // bs - hit // bs
        if gained != want:
            raise RuntimeError(
                f"{case} {size}: LMCache's L1 gained {gained} objects in request {i}, expected the "
                f"suffix's {want}: part of the prefix came from its disk tier, or L1 evicted"
            )
    after = e.stats()
    rec["loaded_blocks"] = _delta(after, before, *counter) if counter else rec["cached"] // bs
    if "hints" in after:  # what the request's hint did: seen, used, failed by reason, bytes, seconds
        rec["hints"] = {k: v - before.get("hints", {}).get(k, 0) for k, v in after["hints"].items()}
    if rec["loaded_blocks"] < hit // bs or rec["cached"] < hit:
        raise RuntimeError(
            f"{case} {size}: request {i} found {rec['cached']} cached tokens and "
            f"{rec['loaded_blocks']} blocks from its tier, expected {hit} tokens / {hit // bs} "
            f"blocks; tier counters now {after}"
        )
    return rec


def run_role(e: Engine) -> None:
    spec = e.spec
    role, seed, repeat, bs = spec["role"], int(spec["seed"]), int(spec["repeat"]), e.block
    if role not in ROLES:
        raise SystemExit(f"unknown role {role!r}; known: {sorted(ROLES)}")
    warm_up(e)
    checks: dict[str, Any] = {}
    for size in spec["sizes"]:
        hit = cached_tokens(size, bs)
        prefix = prefix_prompt(seed, size, bs)
        if role == "plain" and not e.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
            continue  # vLLM turned its prefix cache off (its CPU MLA backend does): no device hit to time
        if role == "plain":
            e.generate(prefix)  # vLLM's prefix cache holds the 90% prefix from here on (no reset)
            # A hybrid model's own prefix cache may stop a block short (its window groups' hit rule).
            device_low = hit - bs * int(spec.get("device_hit_slack_blocks", 0))
            for i in range(repeat):
                rec = e.timed(f"device-hit-{size}", prefix + suffix(seed, size, bs, "device", i))
                if not device_low <= rec["cached"] <= hit:
                    raise RuntimeError(f"device hit {size}: vLLM found {rec['cached']} cached tokens, expected {hit}")
            # The first tokens the other engines' prompts must give (their suffix kinds), from the same hit.
            for kind in spec.get("reference_kinds", ()):
                for i in range(repeat):
                    rec = e.timed(f"ref-{kind}-{size}", prefix + suffix(seed, size, bs, kind, i))
                    if not device_low <= rec["cached"] <= hit:
                        raise RuntimeError(
                            f"reference {kind} {size}: vLLM found {rec['cached']} cached tokens, expected {hit}"
                        )
            continue
        if role == "offloading":  # ours is timed against no connector in serve mode (bench/vllm_ttft.py)
            for i in range(repeat):  # the recompute prompts, connector on: lookups and stores, no loads
                rec = e.timed(f"offloading-miss-{size}", fresh_prompt(seed, size, i))
                if rec["cached"]:
                    raise RuntimeError(f"offloading-miss {size}: a fresh prompt found {rec['cached']} cached tokens")
            e.settle()
        for case in ROLE_CASES[role]:
            for i in range(repeat):
                checks.setdefault(f"{case}-{size}", []).append(tier_request(e, case, size, i)["loaded_blocks"])
        e.settle()
    e.info["checks"] = checks
    e.info["tiers"] = e.stats()


def device_request(e: Engine, kind: str, size: int, i: int) -> dict[str, Any]:
    """The prefix + suffix ``i`` of ``kind`` on vLLM's own prefix cache (no connector): the first
    token every loaded case of that suffix kind must give. The prefix is computed (or hit) first,
    untimed: serve mode's settle after every command resets vLLM's prefix cache."""
    seed, bs = int(e.spec["seed"]), e.block
    hit, prefix = cached_tokens(size, bs), prefix_prompt(seed, size, bs)
    e.generate(prefix)
    rec = e.timed(
        f"device-hit-{size}" if kind == "device" else f"ref-{kind}-{size}", prefix + suffix(seed, size, bs, kind, i)
    )
    if rec["cached"] != hit:
        raise RuntimeError(f"device hit {kind} {size}: vLLM found {rec['cached']} cached tokens, expected {hit}")
    return rec


def warm_up(e: Engine) -> None:
    """vLLM's first request in a fresh engine pays one-time costs: every engine sends the same
    fresh prompts first."""
    for size in sorted(set(e.spec["warmup_sizes"])):
        e.generate(fresh_prompt(int(e.spec["seed"]), size, -1 - size))
    e.settle()


def serve(e: Engine) -> None:
    """Serve mode (``--serve SPEC``): warm up, print READY, then one command per stdin line, each
    answered by a RESULT line once the engine settled (its stores done; ``settle_s`` says how long
    that took after the first token): ``{"case", "size", "index"}`` a fresh prompt, ``{"tier",
    "size", "index"}`` request ``index`` of loaded case ``tier`` (tier_request; optional
    ``kv_hints`` and ``stored_elsewhere``); for bench vllm --pull (bench/vllm_pull.py): ``{"store":
    size}`` computes the size's 90% prefix (the connector stores it) and answers its router hashes
    and the tier counters, ``{"device": kind, "size", "index"}`` times the prefix + a suffix of
    ``kind`` on vLLM's own prefix cache (the reference first tokens, ``device-hit-*`` for kind
    ``device``, else ``ref-<kind>-*``), ``{"stats": true}`` answers the tier counters."""
    seed = int(e.spec["seed"])
    warm_up(e)
    print(READY, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if "store" in cmd:
            size = int(cmd["store"])
            prefix = prefix_prompt(seed, size, e.block)
            e.generate(prefix)
            e.stored.add(size)
            e.settle()
            print(RESULT + json.dumps({"hashes": e.router_hashes(prefix), "stats": e.stats()}), flush=True)
            continue
        if "stats" in cmd:
            print(RESULT + json.dumps({"stats": e.stats()}), flush=True)
            continue
        if "device" in cmd:
            rec = device_request(e, str(cmd["device"]), int(cmd["size"]), int(cmd["index"]))
        elif "tier" in cmd:
            rec = tier_request(
                e,
                cmd["tier"],
                int(cmd["size"]),
                int(cmd["index"]),
                cmd.get("kv_hints"),
                bool(cmd.get("stored_elsewhere")),
            )
        else:
            rec = e.timed(cmd["case"], fresh_prompt(seed, int(cmd["size"]), int(cmd["index"])))
        t0 = time.perf_counter()
        e.settle()
        rec["settle_s"] = time.perf_counter() - t0
        print(RESULT + json.dumps(rec), flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        with open(argv[1], encoding="utf-8") as f:
            spec = json.load(f)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        serve(Engine(spec))
        return 0
    spec_path, out_path = argv
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    # collective_rpc ships this module's rpc_* functions to vLLM's worker by pickle (a local bench).
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    t0 = time.perf_counter()
    e = Engine(spec)
    e.info["start_s"] = time.perf_counter() - t0
    run_role(e)
    e.info["total_s"] = time.perf_counter() - t0
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"role": spec["role"], "results": e.results, "info": e.info}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
