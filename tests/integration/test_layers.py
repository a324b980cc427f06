"""Imports only go down: reading a cache config and rendering a manifest are light operations,
so they load neither torch, Dynamo's runtime (``dynamo``), vLLM nor our native extension.

Each case runs in a fresh interpreter with an import hook that records which module (and line)
first imported each module; a failure names the whole chain, e.g. ``vllm <-
dynamo_flexkv.integrations.reference_engine.llm:11 <- dynamo_flexkv.integrations.reference_engine:5
<- dynamo_flexkv.serve.plan:415``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from repo_paths import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
GRAPH_CONFIGS = [c for c in CONFIGS if (ROOT / "graphs" / f"{c.stem}.py").is_file()]
FORBIDDEN = ("torch", "dynamo", "vllm", "dynamo_flexkv.core._native")

# Runs first in the child: a meta-path finder that only records "who imported me" and finds nothing.
HOOK = r"""
import importlib.abc, json, sys
_first = {}
class _Recorder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _first:
            f = sys._getframe(1)
            while f is not None and (f.f_code.co_filename.startswith("<frozen")
                                     or str(f.f_globals.get("__name__", "")).startswith("importlib")):
                f = f.f_back
            _first[name] = (f.f_globals.get("__name__", "?"), f.f_lineno) if f is not None else ("?", 0)
        return None
sys.meta_path.insert(0, _Recorder())

def _chain(name):
    out, seen = [name], {name}
    while name in _first:
        mod, line = _first[name]
        out.append(f"{mod}:{line}")
        if mod in seen or mod == "__main__":
            break
        seen.add(mod)
        name = mod
    return " <- ".join(out)

def _report(forbidden):
    loaded = [m for m in forbidden if m in sys.modules]
    print("LAYERS " + json.dumps({m: _chain(m) for m in loaded}))
"""


def run_light(code: str, timeout: float = 120) -> dict:
    """Runs ``code`` after the hook in a fresh interpreter; returns {forbidden module: import chain}."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEXKV_", "DYN_KVBM_"))}
    script = HOOK + code + f"\n_report({FORBIDDEN!r})\n"
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("LAYERS ")]
    assert lines, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(lines[-1][len("LAYERS ") :])


def test_the_recorder_names_the_chain():
    """The hook itself: a module known to load the native extension is reported with its importer."""
    loaded = run_light("import dynamo_flexkv.core.hashing")
    chain = loaded["dynamo_flexkv.core._native"]
    assert chain.startswith("dynamo_flexkv.core._native <- dynamo_flexkv.core.native:"), chain
    assert " <- dynamo_flexkv.core.hashing:" in chain, chain


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_reading_a_cache_config_stays_light(config, tmp_path):
    """Every worker section's ``cache:`` of a shipped config, written where FLEXKV_CONFIG_PATH would
    name it (as serve writes it), and read back by CacheConfig.load."""
    doc = yaml.safe_load(config.read_text())
    paths = []
    for section, values in doc.items():
        if isinstance(values, dict) and isinstance(values.get("cache"), dict):
            path = tmp_path / f"{section}.cache.yaml"
            path.write_text(yaml.safe_dump(values["cache"]))
            paths.append(str(path))
    assert paths, f"{config.name} has no worker cache section"
    code = f"from dynamo_flexkv.core.config import CacheConfig\nfor p in {paths!r}:\n    CacheConfig.load(p)\n"
    loaded = run_light(code)
    assert not loaded, "reading a config loaded (module <- importer:line <- ...):\n" + "\n".join(loaded.values())


@pytest.mark.parametrize("config", GRAPH_CONFIGS, ids=[c.stem for c in GRAPH_CONFIGS])
def test_render_k8s_stays_light_and_uses_the_image(config, tmp_path):
    """`dynamo-flexkv render --k8s --image NAME` of each shipped graph with its config: light, and
    NAME is the image of every container it renders (init containers included)."""
    out = tmp_path / f"{config.stem}.k8s.yaml"
    image = "registry.example/team/dynamo-flexkv:0.1.0-test"
    argv = [
        "render",
        str(ROOT / "graphs" / f"{config.stem}.py"),
        "-f",
        str(config),
        "--k8s",
        "--image",
        image,
        "-o",
        str(out),
    ]
    code = f"from dynamo_flexkv.cli import main\nassert main({argv!r}) == 0\n"
    loaded = run_light(code)
    assert not loaded, "render --k8s loaded (module <- importer:line <- ...):\n" + "\n".join(loaded.values())
    doc = yaml.safe_load(out.read_text())
    containers = []
    for service in doc["spec"]["services"].values():
        pod = service["extraPodSpec"]
        containers += [pod["mainContainer"], *pod.get("initContainers", [])]
    assert len(containers) >= len(doc["spec"]["services"])
    assert {c["image"] for c in containers} == {image}


def test_render_k8s_image_defaults_to_the_dockerfiles_tag(tmp_path):
    """Without --image the manifest names dynamo-flexkv:latest, the tag the repository's Dockerfile
    is built under (docker build -t dynamo-flexkv:latest .)."""
    out = tmp_path / "agg.k8s.yaml"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynamo_flexkv.cli",
            "render",
            str(ROOT / "graphs" / "agg.py"),
            "-f",
            str(ROOT / "configs" / "agg.yaml"),
            "--k8s",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    images = {
        s["extraPodSpec"]["mainContainer"]["image"]
        for s in yaml.safe_load(out.read_text())["spec"]["services"].values()
    }
    assert images == {"dynamo-flexkv:latest"}
    assert "dynamo-flexkv:latest" in (ROOT / "Dockerfile").read_text()


# ---- the folders are the layers ------------------------------------------------------------------
PACKAGE = ROOT / "dynamo_flexkv"
APPS = (
    "dynamo_flexkv.serve",
    "dynamo_flexkv.replay",
    "dynamo_flexkv.bench",
    "dynamo_flexkv.cli",
    "dynamo_flexkv.doctor",
    "dynamo_flexkv.workload",
    "dynamo_flexkv.cache_server",
    "dynamo_flexkv.cache_cli",
)
# beside them on top, for every layer: resources.py (where the shipped presets, graphs and configs
# are; imports nothing of ours), data/ (the shipped trace), _native (the C++ extension)
# what each layer may not import (a module or any of its submodules)
BELOW = {
    "core": ("dynamo_flexkv.integrations", *APPS, "dynamo", "vllm"),
    "integrations": APPS,
}


def _imports(path: Path) -> list:
    """(line, module) of every import in a file, function-level (lazy) imports included."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _within(module: str, roots) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


@pytest.mark.parametrize("layer", sorted(BELOW))
def test_imports_only_go_down(layer):
    """core/ imports neither integrations/, an app, Dynamo nor vLLM; integrations/ no app. Lazy
    imports inside functions count too: a layer that reaches up at run time is still tangled."""
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files, f"no {layer}/ folder"
    up = [
        f"{f.relative_to(ROOT)}:{line} imports {mod}"
        for f in files
        for line, mod in _imports(f)
        if _within(mod, BELOW[layer])
    ]
    assert up == [], "\n".join(up)


def test_the_top_level_holds_only_the_apps_and_the_layers():
    """A newcomer sees three things at the top: the apps, core/ and integrations/."""
    top = {p.name for p in PACKAGE.iterdir() if not p.name.startswith(("_", ".")) and p.name != "__pycache__"}
    top -= {"data", "resources.py"}
    apps = {m.split(".")[1] + ("" if (PACKAGE / m.split(".")[1]).is_dir() else ".py") for m in APPS}
    assert top == apps | {"core", "integrations"}, top ^ (apps | {"core", "integrations"})


def test_the_cache_command_stays_light(tmp_path):
    """`dynamo-flexkv cache` is an operator's client: asking a cache server (here one that is not
    there) loads neither torch, Dynamo, vLLM nor the native extension."""
    argv = ["cache", "--socket", str(tmp_path / "missing.sock"), "--json"]
    code = f"from dynamo_flexkv.cli import main\nassert main({argv!r}) == 1\n"
    loaded = run_light(code)
    assert not loaded, "dynamo-flexkv cache loaded (module <- importer:line <- ...):\n" + "\n".join(loaded.values())
