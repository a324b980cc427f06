"""Every example in README.md and docs/*.md runs as written (docs/TESTING.md#examples-in-the-docs).

Each fenced block names its language, and the language says what this test does with it:

* ``python``: runs as written, each block on its own (a fresh namespace, in a temporary directory,
  with no FLEXKV_* or DYN_KVBM_* variable set; a block that reads FLEXKV_REMOTE_CACHE_URL gets a
  real redis-server there);
* ``bash``: every command is checked without running it: ``dynamo-flexkv serve`` and ``render``
  are parsed by the CLI's own parser and their graph is planned as ``render`` plans it (every
  section, option, ``--set`` and model checked; no port, directory or process touched); the other
  ``dynamo-flexkv`` commands and ``python -m dynamo_flexkv.bench`` are parsed by their parsers;
  ``make`` targets must be in the Makefile; ``python -m pytest`` must name test files that exist
  and markers the suite has. Any other command fails the test: mark its block;
* ``yaml``: parsed;
* ``text``: not code (diagrams, trees, formulas, output).

An HTML comment on the line before a fence marks what is not checked, with the reason:
``<!-- not-run: why -->`` (nothing: a command that needs root, a server, a model of your own) or
``<!-- parse-only: why -->`` (bash: parsed, its graph not planned). Indented code blocks are
refused: fence them with a language.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from doc_lists import documented_metrics, section
from redis_fixtures import needs_redis, redis_server  # noqa: F401  (the fixture, for blocks that need Redis)
from repo_paths import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "bash", "yaml", "text")
MARK = re.compile(r"^<!--\s*(not-run|parse-only):\s*(.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # the fence's line, 1-based
    language: str
    code: str
    mark: str | None  # not-run, parse-only or None
    reason: str

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def fenced_blocks(doc: Path) -> Iterator[Block]:
    lines = doc.read_text().split("\n")
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```(.*)$", lines[i])
        if not opening:
            i += 1
            continue
        indent, language = len(opening.group(1)), opening.group(2).strip()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(before)
        code = "\n".join(line[indent:] for line in lines[i + 1 : end])
        yield Block(doc, i + 1, language, code, mark and mark.group(1), mark.group(2) if mark else "")
        i = end + 1


def indented_code_blocks(doc: Path) -> list[int]:
    """Lines that open a Markdown indented code block (four spaces after a blank line, outside a
    fence and not inside a list item)."""
    found, in_fence, in_list = [], False, False
    lines = doc.read_text().split("\n")
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if re.match(r"^\s*([*-]|\d+\.) ", line):
            in_list = True
        elif line.strip() and not line.startswith(" "):
            in_list = False
        if not in_list and line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip()):
            found.append(i + 1)
    return found


BLOCKS = [b for doc in DOCS for b in fenced_blocks(doc)]


def blocks(language: str) -> list[pytest.param]:
    out = []
    for b in BLOCKS:
        if b.language != language or b.mark == "not-run":
            continue
        marks = [pytest.mark.integration] if "FLEXKV_REMOTE_CACHE_URL" in b.code else []
        out.append(pytest.param(b, id=b.id, marks=marks))
    return out


def test_every_block_says_what_it_is_and_why_it_is_not_run():
    problems = [f"{b.id}: fence language {b.language!r}: use one of {LANGUAGES}" for b in BLOCKS]
    problems = [p for p, b in zip(problems, BLOCKS) if b.language not in LANGUAGES]
    problems += [f"{b.id}: {b.mark} needs a reason: <!-- {b.mark}: why -->" for b in BLOCKS if b.mark and not b.reason]
    problems += [
        f"{b.id}: parse-only is for bash blocks" for b in BLOCKS if b.mark == "parse-only" and b.language != "bash"
    ]
    for doc in DOCS:
        problems += [
            f"{doc.relative_to(ROOT)}:{n}: an indented code block: fence it with a language ({LANGUAGES})"
            for n in indented_code_blocks(doc)
        ]
    assert not problems, "\n".join(problems)


# ---- python: run as written -------------------------------------------------------------------------


@pytest.fixture
def example_env(tmp_path, monkeypatch):
    """What a reader's fresh shell has: no cache variables, an empty working directory."""
    for var in [v for v in os.environ if v.startswith(("FLEXKV_", "DYN_KVBM_"))]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return monkeypatch


@pytest.mark.parametrize("block", blocks("python"))
def test_python_example_runs_as_written(block: Block, example_env, request):
    if "FLEXKV_REMOTE_CACHE_URL" in block.code:
        if needs_redis.args[0]:
            pytest.skip(needs_redis.kwargs["reason"])
        server = request.getfixturevalue("redis_server")
        example_env.setenv("FLEXKV_REMOTE_CACHE_URL", server.url)
    # Blank lines before the code: a traceback names the doc's own line numbers.
    code = compile("\n" * block.line + block.code, str(block.doc), "exec")
    exec(code, {"__name__": "__main__"})


# ---- bash: every command checked ----------------------------------------------------------------------


def commands(code: str) -> Iterator[list[str]]:
    """The block's commands as argument lists, as a shell reads them: continuation lines joined
    (and a quote left open goes on over the next line), comments dropped, split at ``&&``, ``||``,
    ``;`` and ``|``."""
    pending = ""
    for line in code.replace("\\\n", " ").split("\n"):
        pending = f"{pending}\n{line}" if pending else line
        lexer = shlex.shlex(pending, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            words = list(lexer)
        except ValueError:  # no closing quotation: the string goes on
            continue
        pending = ""
        argv: list[str] = []
        for word in words:
            if word in ("&&", "||", ";", "|"):
                if argv:
                    yield argv
                argv = []
            else:
                argv.append(word)
        if argv:
            yield argv
    assert not pending, f"an unclosed quote: {pending!r}"


def unwrap(argv: list[str]) -> list[str]:
    """The command a line runs: without ``VAR=value`` prefixes and ``ip netns exec NAME``."""
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        argv = argv[1:]
    if argv[:3] == ["ip", "netns", "exec"]:
        return unwrap(argv[4:])
    return argv


def parse(parser: argparse.ArgumentParser, args: Sequence[str]) -> argparse.Namespace | None:
    """``args`` as the command's own parser reads them (argparse's errors: exit 2); None for --help."""
    try:
        return parser.parse_args(list(args))
    except SystemExit as e:
        if e.code == 0:
            return None
        raise AssertionError(f"the parser refuses {shlex.join(args)} (exit {e.code}): see stderr above") from None


def check_cli(args: list[str], plan: bool, tmp_path: Path) -> None:
    from dynamo_flexkv import cli
    from dynamo_flexkv.serve.graph import GraphError

    ns = parse(cli.build_parser(), args)
    if ns is None or not plan or ns.command not in ("serve", "render"):
        return
    kw = {} if ns.command == "render" else dict(discovery_backend=ns.discovery_backend, event_plane=ns.event_plane)
    try:
        cli._plan(ns, str(tmp_path / "run"), local=False, **kw)
    except GraphError as e:
        raise AssertionError(f"dynamo-flexkv {shlex.join(args)}: {e}") from None


def pytest_markers() -> set:
    """The markers pyproject.toml registers: the name before the ':' of each string in `markers = [...]`
    (no tomllib: Python 3.10 is supported)."""
    block = re.search(r"^markers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert block, "pyproject.toml has no markers = [...] list"
    return set(re.findall(r'^\s*"([a-z_]+):', block.group(1), re.M))


def check_pytest(args: list[str]) -> None:
    kinds = pytest_markers()
    it = iter(args)
    for arg in it:
        if arg == "-m":
            words = set(re.findall(r"[a-z_]+", next(it))) - {"and", "or", "not"}
            assert words <= kinds, f"pytest -m names markers the suite lacks: {sorted(words - kinds)}"
        elif not arg.startswith("-"):
            assert (ROOT / arg.split("::")[0]).exists(), f"pytest {arg}: no such file"


def makefile_targets() -> set:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def check_command(argv: list[str], plan: bool, tmp_path: Path) -> None:
    argv = unwrap(argv)
    program, args = argv[0], argv[1:]
    if program == "dynamo-flexkv":
        return check_cli(args, plan, tmp_path)
    if program == "make":
        missing = [t for t in args if not t.startswith("-") and t not in makefile_targets()]
        assert not missing, f"make {' '.join(args)}: no such target {missing} in the Makefile"
        return
    if re.match(r"^(\S*/)?python3?$", program) and args[:1] == ["-m"] and len(args) > 1:
        module, rest = args[1], args[2:]
        if module == "dynamo_flexkv.cli":
            return check_cli(rest, plan, tmp_path)
        if module == "dynamo_flexkv.bench":
            from dynamo_flexkv.bench import build_parser

            parse(build_parser(), rest)
            return
        if module == "pytest":
            return check_pytest(rest)
    raise AssertionError(
        f"{shlex.join(argv)}: this test does not know how to check {program!r}; check it here, or mark "
        "its block <!-- not-run: why --> (and keep the checkable commands in a block of their own)"
    )


@pytest.mark.parametrize("block", blocks("bash"))
def test_shell_example_parses_and_plans(block: Block, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands name the checkout's graphs/ and configs/
    ran = 0
    for argv in commands(block.code):
        try:
            check_command(argv, block.mark != "parse-only", tmp_path)
        except AssertionError as e:
            raise AssertionError(f"{block.id}: {e}") from None
        ran += 1
    assert ran, f"{block.id}: a bash block without a command"


@pytest.mark.parametrize("block", blocks("yaml"))
def test_yaml_example_parses(block: Block):
    assert yaml.safe_load(block.code) is not None, f"{block.id}: empty"


def test_the_checks_refuse_what_they_cannot_vouch_for(tmp_path, monkeypatch):
    """The checker itself: a typo in an option, a --set or a make target fails, and so does a
    command it does not know."""
    monkeypatch.chdir(ROOT)
    bad = [
        ["dynamo-flexkv", "serve", "graphs/agg.py", "-f", "configs/agg.yaml", "--set", "FlexKVWorker.replica=2"],
        ["dynamo-flexkv", "serve", "graphs/agg.py", "--config-file", "configs/agg.yaml"],
        ["python", "-m", "dynamo_flexkv.bench", "vllm", "--peers", "lmcache"],
        ["make", "tests"],
        [".venv/bin/python", "-m", "pytest", "-m", "unit and not quick"],
        ["curl", "127.0.0.1:8000/v1/models"],
    ]
    for argv in bad:
        with pytest.raises(AssertionError):
            check_command(argv, True, tmp_path)
    check_command(["dynamo-flexkv", "render", "graphs/agg.py", "-f", "configs/agg.yaml", "--k8s"], True, tmp_path)
    assert list(commands("a b \\\n  c # d\nx && y; z")) == [["a", "b", "c"], ["x"], ["y"], ["z"]]
    assert list(commands("p --j '{\"a\":\n 1}' x")) == [["p", "--j", '{"a":\n 1}', "x"]]


# ---- lists the docs keep by hand: true to the code ----------------------------------------------------


def test_the_worker_metrics_serving_md_lists_are_the_ones_it_exports(tmp_path):
    """SERVING.md's Metrics (and REMOTE.md's remote families) name every family the reference
    worker exports on /metrics, and nothing else."""
    import dataclasses

    from dynamo_flexkv import CacheConfig, KVManager, ModelSpec
    from dynamo_flexkv.core.stats import RemoteTierStats
    from dynamo_flexkv.integrations.dynamo_worker.metrics import OffloadCollector, RequestTally

    with KVManager(
        ModelSpec(num_layers=2, num_kv_heads=2, head_size=8), CacheConfig.from_dict({"cpu_cache_gb": 0.01})
    ) as kv:
        stats = dataclasses.replace(kv.stats(), remote=RemoteTierStats())  # every family: remote ones too
    engine = {"steps": 0, "step_requests": 0, "step_seconds": 0, "load_stall_seconds": 0}
    collector = OffloadCollector(RequestTally(), lambda: (0, 8), lambda: stats, engine_stats=lambda: engine)
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in collector.collect()}
    serving = documented_metrics(section(ROOT / "docs" / "SERVING.md", "## Metrics"))
    remote = documented_metrics((ROOT / "docs" / "REMOTE.md").read_text())
    # (the node service's own flexkv_node_* there: tests/integration/test_metric_schema.py)
    documented = {n for n in serving if not n.startswith(("flexkv_remote_", "flexkv_node_"))} | {
        n for n in remote if n.startswith("flexkv_remote_")
    }
    assert sorted(exported - documented) == [], "exported, not in docs/SERVING.md (## Metrics) or docs/REMOTE.md"
    assert sorted(documented - exported) == [], "in the docs, not exported"


def test_the_model_presets_configuration_md_lists_are_the_shipped_ones():
    from dynamo_flexkv.resources import presets_dir

    shipped = {p.stem for p in presets_dir().glob("*.yaml")} | {
        p.parent.name for p in presets_dir().glob("*/config.json")
    }
    text = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    engine_row = next(line for line in text.split("\n") if line.startswith("| model | small | a preset in"))
    missing = sorted(n for n in shipped if n not in text)
    assert not missing, f"presets docs/CONFIGURATION.md does not name: {missing}"
    yaml_presets = {p.stem for p in presets_dir().glob("*.yaml")}
    assert sorted(n for n in yaml_presets if n not in engine_row) == [], engine_row


def test_every_command_says_what_it_does_in_its_help():
    from dynamo_flexkv.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert [name for name, p in commands.items() if not p.description] == []
