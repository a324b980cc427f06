"""The engine contract is the only door into the core: integrations/ (the reference engine, the
vLLM connector, the Dynamo worker, the events, disagg) imports from dynamo_flexkv.core only the
modules listed here (docs/ENGINE_CONTRACT.md), and from a few of them only the names listed. A new
import of the control plane (core.index), the manager, the storage or the movers fails here, naming
the file and line: reach it through EngineOffload (core/contract.py) instead, or add a door here
with the reason it needs one."""

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
    # engine-to-engine transports beside the offload (not through its tiers): the disaggregated
    # prefill -> decode handover of the engine's own KV (NIXL), and peer pulls on router hints
    "dynamo_flexkv.core.transfer.nixl_agent": frozenset(
        {"KVAgent", "HandoverFailed", "HandoverCorrupt", "Notifier", "kv_block_checksums", "block_checksums"}
        | {"exit_past_libnl"}
    ),
    "dynamo_flexkv.core.transfer.nixl_agents": frozenset({"quiet_progress_threads"}),
    "dynamo_flexkv.core.transfer.nixl_errors": frozenset({"HandoverRefused"}),
    "dynamo_flexkv.core.peer": frozenset({"PeerReceiver", "PeerSource", "SourceLimits", "host_agent"}),
}
OURS = "dynamo_flexkv"
SELF = ("dynamo_flexkv.integrations", "dynamo_flexkv.resources")  # its own modules; the shipped presets


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


def side_doors(files: list[Path]) -> list[str]:
    bad = []
    for f in files:
        where = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
        for line, module, name in sorted(imports(f), key=lambda t: t[0]):
            if module == OURS and name is not None:  # from dynamo_flexkv import X: the package's lazy names
                module, name = f"{OURS}.core", name
            if any(module == s or module.startswith(s + ".") for s in SELF):
                continue
            if name is not None and f"{module}.{name}" in DOORS:  # from dynamo_flexkv.core import offload
                continue
            names = DOORS.get(module, frozenset())
            if module in DOORS and (names is ANY or (name is not None and name in names)):
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
