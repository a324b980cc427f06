"""The engine contract is the only door into the core: integrations/ (the reference engine, the
vLLM connector, the Dynamo worker, the events, disagg) imports from dynamo_flexkv.core only the
modules listed here (docs/ENGINE_CONTRACT.md), and from a few of them only the names listed. A new
import of the control plane (core.index), the manager, the storage or the movers fails here, naming
the file and line: reach it through EngineOffload (core/contract.py) instead, or add a door here
with the reason it needs one.

bench/ and replay/ are held to the same doors (BENCH_DOORS: the contract's, plus stateless
utilities and the values open_offload's mover_hook takes), except the micro-benchmarks of the data
plane itself, which import what they measure (MICRO_BENCHES, by file, with the reason)."""

from __future__ import annotations

import ast
from pathlib import Path

from repo_paths import ROOT

INTEGRATIONS = ROOT / "dynamo_flexkv" / "integrations"

ANY: frozenset[str] | None = None  # every name of the module
# module -> the names integrations/ may import from it (ANY: all); a reason for each.
DOORS: dict[str, frozenset[str] | None] = {
    # the contract: EngineOffload, Hold, the listener's Tier / TierRun / IndexListener; open_offload
    "dynamo_flexkv.core.contract": ANY,
    "dynamo_flexkv.core.offload": ANY,
    # the values the contract's calls take and return
    "dynamo_flexkv.core.config": ANY,  # CacheConfig: what open_offload is given
    "dynamo_flexkv.core.layout": ANY,  # ModelSpec, KVLayoutType: register()'s tensors
    "dynamo_flexkv.core.tasks": ANY,  # TaskResult, TaskStatus, TaskFailed: load / finish / wait_layer
    "dynamo_flexkv.core.stats": ANY,  # ManagerStats: stats()
    "dynamo_flexkv.core.inventory": ANY,  # CacheRequest / CacheReport: cache_admin()
    "dynamo_flexkv.core.enums": ANY,  # LoadPolicy: a config value the connector checks
    "dynamo_flexkv.core.errors": ANY,  # FlexKVError, the base of what the core raises
    "dynamo_flexkv.core.hashing": ANY,  # Dynamo's block hashes: what the router and the events name
    # stateless helpers
    "dynamo_flexkv.core.durations": ANY,
    "dynamo_flexkv.core.logutil": ANY,
    "dynamo_flexkv.core.metric_schema": ANY,  # one metric schema: the names and the source label every exporter uses
    # the lookup socket sends token ids packed as the node protocol does (one format on the wire)
    "dynamo_flexkv.core.node.protocol": frozenset({"pack_tokens"}),
    # an engine-to-engine transport beside the offload (not through its tiers): the disaggregated
    # prefill -> decode handover of the engine's own KV (NIXL); peer pulls on router hints go
    # through the contract (EngineOffload.open_peer_link)
    "dynamo_flexkv.core.transfer.nixl_agent": frozenset(
        {"KVAgent", "HandoverFailed", "HandoverCorrupt", "Notifier", "kv_block_checksums", "block_checksums"}
        | {"exit_past_libnl"}
    ),
    "dynamo_flexkv.core.transfer.nixl_agents": frozenset({"quiet_progress_threads"}),
    "dynamo_flexkv.core.transfer.nixl_errors": frozenset({"HandoverRefused"}),
    # what a PeerLink's pull returns (EngineOffload.open_peer_link): a value type of the contract
    "dynamo_flexkv.core.peer": frozenset({"PullResult"}),
}
OURS = "dynamo_flexkv"
SELF = ("dynamo_flexkv.integrations", "dynamo_flexkv.resources")  # its own modules; the shipped presets

BENCH = [ROOT / "dynamo_flexkv" / "bench", ROOT / "dynamo_flexkv" / "replay"]
# bench/ and replay/ drive engines, served graphs and the CLI: only dynamo_flexkv.core is checked
# (the engines, serve and the workload are theirs to use through their public modules).
BENCH_CHECKED = ("dynamo_flexkv.core",)
BENCH_DOORS: dict[str, frozenset[str] | None] = {
    **DOORS,
    # stateless utilities: process groups, ports and binaries, one HTTP client and metric scraper
    "dynamo_flexkv.core.procgroup": ANY,
    "dynamo_flexkv.core.sysutil": ANY,
    "dynamo_flexkv.core.http_client": ANY,
    # what open_offload's mover_hook takes and returns (bench throttled slows the disk link with one)
    "dynamo_flexkv.core.transfer.runner": frozenset({"Mover", "MoverHook"}),
    "dynamo_flexkv.core.transfer.graph": frozenset({"OpKind", "TransferOp"}),
}
# file (relative to the repository) -> the core modules it may import beyond BENCH_DOORS (every name
# of each, and their submodules), and why: each measures that part of the data plane itself.
MICRO_BENCHES: dict[str, tuple[frozenset[str], str]] = {
    "dynamo_flexkv/bench/links.py": (
        frozenset(
            {
                "dynamo_flexkv.core.native",
                "dynamo_flexkv.core.storage",
                "dynamo_flexkv.core.transfer.graph",
                "dynamo_flexkv.core.transfer.movers",
                "dynamo_flexkv.core.transfer.nixl_mover",
            }
        ),
        "the copy links: each mover over its storage tier against memcpy / fio / raw NIXL",
    ),
    "dynamo_flexkv/bench/node_datapath.py": (
        frozenset(
            {"dynamo_flexkv.core.storage", "dynamo_flexkv.core.transfer.graph", "dynamo_flexkv.core.transfer.movers"}
        ),
        "the node cache's two data paths, built from the movers and pools they differ in",
    ),
    "dynamo_flexkv/bench/vllm_pull.py": (
        frozenset({"dynamo_flexkv.core.peer.receiver", "dynamo_flexkv.core.transfer.nixl_agent"}),
        "the pull's ceiling: a raw NIXL read of the same bytes between two agents, no control plane "
        "(its timed cases are vLLM engines through the connector)",
    ),
    "dynamo_flexkv/bench/index.py": (
        frozenset({"dynamo_flexkv.core.index"}),
        "the control plane's index (CacheEngine.match) against Dynamo's radix tree",
    ),
    "dynamo_flexkv/bench/remote.py": (
        frozenset({"dynamo_flexkv.core.remote", "dynamo_flexkv.core.native"}),
        "the remote link: RemoteStore's pipelined puts and gets against redis-benchmark "
        "(its TTFT cases use the contract)",
    ),
    "dynamo_flexkv/bench/disagg.py": (
        frozenset({"dynamo_flexkv.core.transfer.nixl_agent"}),
        "the handover's NIXL read against a raw NIXL read on the same agent's prepared descriptor lists",
    ),
}


def imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None for ``import module``) of every import of dynamo_flexkv in a
    file, inside functions and under TYPE_CHECKING too."""
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == OURS]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == OURS:
            if node.level:
                continue  # relative imports stay inside integrations/
            out += [(node.lineno, node.module, a.name) for a in node.names]
    return out


def _within(module: str, prefixes: tuple[str, ...] | frozenset[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def side_doors(
    files: list[Path],
    doors: dict[str, frozenset[str] | None] = DOORS,
    unchecked: tuple[str, ...] = SELF,
    checked: tuple[str, ...] = (OURS,),
    extra: dict[str, tuple[frozenset[str], str]] | None = None,
) -> list[str]:
    """``file:line imports module.name`` of each import of a ``checked`` module that neither
    ``doors`` nor the file's own ``extra`` entry allows (``unchecked``: a caller's own packages)."""
    bad = []
    for f in files:
        where = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
        own = (extra or {}).get(str(where), (frozenset(), ""))[0]
        for line, module, name in sorted(imports(f), key=lambda t: t[0]):
            if module == OURS and name is not None:  # from dynamo_flexkv import X: the package's lazy names
                module, name = f"{OURS}.core", name
            if _within(module, unchecked) or not _within(module, checked):
                continue
            if name is not None and f"{module}.{name}" in doors:  # from dynamo_flexkv.core import offload
                continue
            names = doors.get(module, frozenset())
            if module in doors and (names is ANY or (name is not None and name in names)):
                continue
            if _within(module, own) or (name is not None and _within(f"{module}.{name}", own)):
                continue
            what = f"{module}.{name}" if name else module
            bad.append(f"{where}:{line} imports {what}")
    return bad


def test_integrations_reach_the_core_only_through_its_doors():
    files = sorted(INTEGRATIONS.rglob("*.py"))
    assert files
    bad = side_doors(files)
    assert not bad, (
        "integrations/ reaches past the engine contract (tests/unit/test_architecture_doors.py lists what it may "
        "import): use EngineOffload (core/contract.py) instead:\n  " + "\n  ".join(bad)
    )


def test_a_side_door_into_the_control_plane_is_named(tmp_path):
    """The check itself: an engine module importing the index, the manager or a mover is named."""
    src = tmp_path / "engine.py"
    src.write_text(
        "from dynamo_flexkv.core.contract import Tier\n"
        "from dynamo_flexkv.core.index import CacheEngine\n"
        "def f():\n    from dynamo_flexkv.core.manager import KVManager\n"
        "import dynamo_flexkv.core.transfer.movers\n"
        "from dynamo_flexkv.core.node.protocol import pack_tokens, Load\n"
    )
    got = [b.split(" imports ")[1] for b in side_doors([src])]
    assert got == [
        "dynamo_flexkv.core.index.CacheEngine",
        "dynamo_flexkv.core.manager.KVManager",
        "dynamo_flexkv.core.transfer.movers",
        "dynamo_flexkv.core.node.protocol.Load",
    ], got


def bench_side_doors(files: list[Path]) -> list[str]:
    return side_doors(files, BENCH_DOORS, (), BENCH_CHECKED, MICRO_BENCHES)


def test_bench_and_replay_reach_the_core_only_through_its_doors():
    files = sorted(f for d in BENCH for f in d.rglob("*.py"))
    assert files
    bad = bench_side_doors(files)
    assert not bad, (
        "bench/ or replay/ reaches past the engine contract (tests/unit/test_architecture_doors.py: BENCH_DOORS, and "
        "MICRO_BENCHES for the data plane's own micro-benchmarks): open the tiers with open_offload and use "
        "EngineOffload's calls (stats, drain, evict_host, reset_tiers, cache_admin) instead:\n  " + "\n  ".join(bad)
    )


def test_every_micro_bench_exception_names_a_file_that_uses_it():
    """An exception outlives its reason unnoticed: each listed file exists and imports each module
    it is allowed."""
    for rel, (modules, why) in MICRO_BENCHES.items():
        assert why and (ROOT / rel).is_file(), rel
        used = {m if n is None else f"{m}.{n}" for _, m, n in imports(ROOT / rel)}
        unused = {m for m in modules if not any(_within(u, frozenset({m})) for u in used)}
        assert not unused, f"{rel} no longer imports {sorted(unused)}: drop them from MICRO_BENCHES"


def test_a_side_door_in_a_bench_module_is_named(tmp_path):
    """The check itself on a bench module: a reach into the manager's tiers is named by file and
    line; the contract, utilities and the rest of the package pass; a micro-benchmark's exception
    holds for its own file only."""
    bench = tmp_path / "dynamo_flexkv" / "bench"
    bench.mkdir(parents=True)
    src = bench / "ttft_like.py"
    src.write_text(
        "from dynamo_flexkv.core.offload import open_offload\n"
        "from dynamo_flexkv.core.procgroup import stop_group\n"
        "from dynamo_flexkv.integrations.reference_engine import LLMEngine\n"
        "from dynamo_flexkv.core.manager import KVManager\n"
        "def f():\n    from dynamo_flexkv.core.storage.host import HostPool\n"
        "from dynamo_flexkv.core.transfer.graph import OpKind, TransferGraph\n"
    )
    got = bench_side_doors([src])
    assert got == [
        f"{src}:4 imports dynamo_flexkv.core.manager.KVManager",
        f"{src}:6 imports dynamo_flexkv.core.storage.host.HostPool",
        f"{src}:7 imports dynamo_flexkv.core.transfer.graph.TransferGraph",
    ], got
    # as links.py, it may import the storage and the transfer graph it measures; the manager still not
    assert side_doors(
        [src], BENCH_DOORS, (), BENCH_CHECKED, {str(src): MICRO_BENCHES["dynamo_flexkv/bench/links.py"]}
    ) == [f"{src}:4 imports dynamo_flexkv.core.manager.KVManager"]


def test_the_contract_doc_lists_every_call_and_nothing_else():
    """docs/ENGINE_CONTRACT.md's tables name each public call of EngineOffload, and only those."""
    import re

    from dynamo_flexkv.core.contract import EngineOffload

    doc = (ROOT / "docs" / "ENGINE_CONTRACT.md").read_text()
    cells, in_calls = [], False
    for ln in doc.splitlines():
        in_calls = ln.startswith("| call |") or (in_calls and ln.startswith("|"))
        if in_calls and ln.startswith("| `"):
            cells.append(ln.split("|")[1])
    tabled = {m for cell in cells for m in re.findall(r"`(\w+)", cell)}
    attributes = doc.split("Attributes both read:")[1].split("\n\n")[0]
    tabled |= set(re.findall(r"`(\w+)` \(", attributes))
    named = set(re.findall(r"`(\w+)[`(]", doc))
    calls = {n for n in [*dir(EngineOffload), *EngineOffload.__annotations__] if not n.startswith("_")}
    assert calls - named == set(), f"EngineOffload calls the doc does not name: {sorted(calls - named)}"
    assert tabled - calls == set(), f"the doc's tables list calls EngineOffload lacks: {sorted(tabled - calls)}"
    assert calls - tabled <= {"register"}, f"calls no table lists: {sorted(calls - tabled)}"  # register: Setup
