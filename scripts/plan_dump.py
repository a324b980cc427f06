"""Prints every shipped graph's launch plan as text, so two trees' plans can be diffed
(scripts/plan_diff.sh): per configs/*.yaml (the graph its first line names), the plan `dynamo-flexkv
serve` would start (every process's argv, environment, files, cache config, ports, restart policy)
and the manifest `dynamo-flexkv render --k8s` writes.

    PYTHONPATH=TREE python scripts/plan_dump.py TREE OUT_DIR

TREE is the source tree whose dynamo_flexkv is imported (its graphs/ and configs/ are used too),
so one venv renders any commit's plans. What differs from one run to the next is normalised:
the run directory (<RUN>), ports serve probes for (<PORT1>, <PORT2>, ... in order of first use),
the graph's handover secret (<SECRET>). Nothing else is touched."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any


def _import_tree(tree: Path) -> None:
    """Import dynamo_flexkv from ``tree``: an editable install's import hook (scikit-build-core's)
    would otherwise answer with the venv's own tree whatever PYTHONPATH says."""
    sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable")]
    sys.path.insert(0, str(tree))
    import dynamo_flexkv

    got = Path(dynamo_flexkv.__file__).resolve().parents[1]
    if got != tree.resolve():
        raise SystemExit(f"plan_dump: imported dynamo_flexkv from {got}, not {tree}")


def _plain(value: Any) -> Any:
    """JSON-able, keys sorted by json.dumps: dataclasses and msgspec structs as dicts, enums as values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if hasattr(value, "__struct_fields__"):  # msgspec.Struct
        return {f: _plain(getattr(value, f)) for f in value.__struct_fields__}
    if isinstance(value, Path):
        return str(value)
    return value


def _process(proc: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(proc, f.name)) for f in dataclasses.fields(proc)}


class Normaliser:
    """Replaces the values that differ per run, the same way in every file of one dump."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.ports: dict[str, str] = {}

    def text(self, text: str, ports: list[int]) -> str:
        """Ports are numbered in order of first appearance, so the same plan reads the same."""
        text = text.replace(self.run_dir, "<RUN>")
        text = re.sub(r"\b[0-9a-f]{64}\b", "<SECRET>", text)  # secrets.token_hex(32)
        probed = {str(p) for p in ports}

        def label(m: re.Match[str]) -> str:
            if m.group(0) not in probed:
                return m.group(0)
            return self.ports.setdefault(m.group(0), f"<PORT{len(self.ports) + 1}>")

        return re.sub(r"(?<![\w.])\d{2,5}(?![\w.])", label, text)


def _probed_ports(plan: Any) -> list[int]:
    """The ports serve took on this machine (PortBook probes: a taken default moves on)."""
    out = [plan.http_port]
    for proc in [*plan.infra, *plan.processes]:
        if proc.port:
            out.append(proc.port)
        for arg in proc.argv:  # e.g. the ZMQ broker's tcp://127.0.0.1:PORT
            out += [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", arg)]
        for key, value in proc.env.items():
            if key.endswith("_PORT") and str(value).isdigit():
                out.append(int(value))
    return [p for p in out if p]


def main(tree: Path, out: Path) -> None:
    _import_tree(tree)
    from dynamo_flexkv.cli import _plan, build_parser
    from dynamo_flexkv.serve.render import SsdVolume, render_k8s

    out.mkdir(parents=True, exist_ok=True)
    for config in sorted((tree / "configs").glob("*.yaml")):
        first = config.read_text().splitlines()[0]
        m = re.match(r"# dynamo-flexkv serve (graphs/\S+\.py) -f configs/", first)
        graph = tree / (m.group(1) if m else f"graphs/{config.stem}.py")
        name = config.stem
        with tempfile.TemporaryDirectory(prefix="plan-run-") as run_dir:
            args = build_parser().parse_args(["serve", str(graph), "-f", str(config)])
            plan = _plan(args, run_dir)  # what `serve` would start here
            norm = Normaliser(run_dir)
            doc = {
                "graph": graph.name,
                **{
                    f.name: _plain(getattr(plan, f.name))
                    for f in dataclasses.fields(plan)
                    if f.name not in ("graph", "run_dir", "infra", "processes")
                },
                "infra": [_process(p) for p in plan.infra],
                "processes": [_process(p) for p in plan.processes],
            }
            text = json.dumps(doc, indent=1, sort_keys=True, default=repr) + "\n"
            (out / f"{name}.plan.json").write_text(norm.text(text, _probed_ports(plan)))
        args = build_parser().parse_args(["render", str(graph), "-f", str(config), "--k8s"])
        k8s = _plan(args, "/run/dynamo-flexkv", local=False)  # as `render` does
        (out / f"{name}.k8s.yaml").write_text(
            render_k8s(k8s, args.image, SsdVolume(args.ssd_volume), None) + "\n".join(k8s.notes)
        )
        print(f"{name}: {len(plan.infra)} infra + {len(plan.processes)} processes; k8s rendered")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python scripts/plan_dump.py TREE OUT_DIR")
    main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]))
