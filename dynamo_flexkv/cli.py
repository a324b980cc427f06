"""The ``dynamo-flexkv`` command."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from dynamo_flexkv import __version__
from dynamo_flexkv.serve.logs import Console


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynamo-flexkv", description="Multi-tier KV-cache offload for NVIDIA Dynamo")
    parser.add_argument("--version", action="version", version=f"dynamo-flexkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser(
        "doctor",
        help="report native extension, io_uring, O_DIRECT, CUDA, NIXL, Dynamo",
        description="Checks what this machine offers and what falls back: the cache configuration (FLEXKV_CONFIG_PATH "
        "and FLEXKV_* variables), the native extension, the shipped graphs, configs and model presets, io_uring, "
        "O_DIRECT on each cache directory, CUDA, NIXL's backends, the Dynamo runtime and the remote tier as "
        "configured. Prints one line per check (ok, fallback, missing, invalid); exit 1 when one is missing or "
        "invalid.",
    )
    doctor.add_argument(
        "--cache-dir",
        action="append",
        dest="cache_dirs",
        metavar="DIR",
        help="directory to probe for O_DIRECT (default: ssd_cache_dir from the config, else /tmp)",
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")

    serve = sub.add_parser(
        "serve",
        help="run a serve graph (frontend + workers) on this machine, on 127.0.0.1",
        description="Starts the graph's components, streams their logs, waits until the "
        "OpenAI endpoint answers, restarts a worker that dies (on-death: restart, the default; stop: "
        "the graph stops) and stops everything on Ctrl-C or when the frontend dies.",
    )
    _graph_args(serve)
    serve.add_argument(
        "--discovery-backend",
        default="file",
        choices=["file", "etcd"],
        help="file (default, no server needed) or etcd (started on 127.0.0.1 unless ETCD_ENDPOINTS is set)",
    )
    serve.add_argument(
        "--event-plane",
        default="zmq",
        choices=["zmq", "nats"],
        help="zmq (default) or nats (nats-server started on 127.0.0.1 unless NATS_SERVER is set)",
    )
    serve.add_argument(
        "--run-dir",
        help="discovery store, model directory, logs/ (default: a new temp directory, removed when serve "
        "stops unless the graph failed; a --run-dir is kept)",
    )
    serve.add_argument(
        "--keep-run-dir", action="store_true", help="keep the default temp run directory (and its logs) at exit"
    )
    serve.add_argument(
        "--console",
        choices=[c.value for c in Console],
        default=Console.QUIET.value,
        help="what the terminal shows of the components' logs: quiet (default: serve's own lines, this "
        "package's lines, and every component's warnings and errors) or all; RUN_DIR/logs always has every line",
    )
    serve.add_argument(
        "--nodes",
        metavar="FILE",
        help="a nodes file from `dynamo-flexkv nodes up`: each component "
        "with a node option (e.g. --set PrefillWorker.node=B) runs in that node's network namespace "
        "(needs --discovery-backend etcd --event-plane nats; run serve itself on the frontend's node)",
    )

    nodes = sub.add_parser(
        "nodes",
        help="network namespaces on this machine that stand in for separate nodes (root)",
        description="up: a bridge namespace PREFIX-sw and one namespace PREFIX-<name> per node, "
        "each with a veth pair into the bridge, a link-local address and no other route; writes "
        "the nodes file serve --nodes reads. down: removes them. link: takes a node's link down "
        "or up.",
    )
    nodes.add_argument("action", choices=["up", "down", "link"])
    nodes.add_argument("names", nargs="*", help="up: node names (default A B C); link: NAME up|down")
    nodes.add_argument("--prefix", default="flexkv", help="namespace name prefix (default flexkv)")
    nodes.add_argument("--file", default="nodes.yaml", help="the nodes file to write (up) or read (default nodes.yaml)")

    render = sub.add_parser(
        "render",
        help="write a graph as a deployment manifest",
        description="Checks the graph and its config as serve does (without probing this machine's ports and "
        "directories) and writes it as a Dynamo DynamoGraphDeployment (nvidia.com/v1alpha1) for the Dynamo "
        "operator: one service per component, the cache options as FLEXKV_* variables, a node cache as a "
        "DaemonSet.",
    )
    _graph_args(render)
    render.add_argument(
        "--k8s", action="store_true", required=True, help="a Dynamo DynamoGraphDeployment (nvidia.com/v1alpha1)"
    )
    render.add_argument(
        "--image",
        default="dynamo-flexkv:latest",
        help="container image with dynamo_flexkv installed (`make image` builds dynamo-flexkv:latest)",
    )
    render.add_argument(
        "--ssd-volume",
        choices=["hostpath", "emptydir"],
        default="hostpath",
        help="what backs a worker's SSD cache directory: hostpath (default: a directory of the node, kept across "
        "pod restarts; one replica per node; needs a namespace that allows hostPath) or emptydir (the pod's own, "
        "emptied at each restart)",
    )
    render.add_argument(
        "--node-selector",
        action="append",
        metavar="KEY=VALUE",
        help="node label the worker pods and the node cache need (repeatable; default dynamo-flexkv/node=true; "
        "--node-selector '' for none)",
    )
    render.add_argument("-o", "--output", help="file to write (default: stdout)")

    from dynamo_flexkv.replay.main import add_arguments as replay_arguments

    replay_arguments(
        sub.add_parser(
            "replay",
            help="replay the Mooncake conversation trace with its arrival times and concurrency over HTTP "
            "against each configuration (offload, tiers, routing, device sizes); table, plots, JSON lines",
            description="Serves each configuration on a fresh graph of --engine's workers (vLLM by default; or uses "
            "--url), replays the trace against it, and writes report.md, results.jsonl and PNG plots to the results "
            "folder.",
        )
    )
    replay_arguments(
        sub.add_parser(
            "demo",
            help="the main job: the replay comparison with its defaults on vLLM workers (same options as "
            "replay; --engine reference: the reference engine's workers)",
            description="replay with its defaults (what make demo runs): serves each configuration (no offload, "
            "FlexKVConnector's host+SSD offload with tier-aware routing, the same with Dynamo's router hints, "
            "host+SSD with device-only routing, one node cache both workers share) on a fresh graph of vLLM "
            "workers (--engine reference: the reference engine's, without the hints row), replays the shipped Mooncake "
            "conversation trace against it with its arrival times, and writes report.md, results.jsonl and PNG "
            "plots to the results folder.",
        )
    )

    from dynamo_flexkv.cache_server import add_arguments as cache_server_arguments

    cache_server_arguments(
        sub.add_parser(
            "cache-server",
            help="the node's KV cache service: one per node, shared by every engine and rank that "
            "attaches (cache mode: node); outlives them",
            description="Owns the host tier (shared memory the engines map), the disk and remote tiers, the index "
            "and eviction for every engine on this node, which attach over a Unix socket (owner only). "
            "Runs until Ctrl-C or "
            "SIGTERM (exit 0); the disk tier stays for the next one to re-adopt.",
        )
    )

    from dynamo_flexkv.cache_cli import add_arguments as cache_arguments

    cache_arguments(
        sub.add_parser(
            "cache",
            help="see and clear what is cached: per tier and tenant, a prompt's blocks, a clear (on a running worker "
            "or cache-server)",
            description="Asks running workers (--url: their system port) or node cache services (--url: their "
            "--metrics-port; --socket) what their tiers hold: show (the default) lists each tier's blocks, bytes, "
            "capacity, blocks in use and when the oldest and newest were last used, per model and tenant; prefix "
            "says which tiers hold which of a prompt's blocks; clear removes what no request uses (blocks a load "
            "or write uses stay, counted by why) and the router hears the removals. --json for scripts.",
        )
    )

    from dynamo_flexkv.bench import build_parser as bench_parser

    bench_parser(
        sub.add_parser(
            "bench",
            help="run a benchmark against its same-run baseline",
            description="Runs one benchmark (or all but vllm and events) and prints ours, the baseline measured in "
            "the same run and their ratio (docs/BENCHMARKS.md).",
        )
    )
    return parser


def _graph_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("graph", help="graph file, e.g. graphs/agg_router.py")
    p.add_argument(
        "-f", "--config", help="config file, e.g. configs/agg_router.yaml (Common + a section per component)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set FlexKVWorker.replicas=3 (repeatable)",
    )


def _plan(args: argparse.Namespace, run_dir: str, **kw):
    from dynamo_flexkv.resources import CONFIGS, GRAPHS, resolve
    from dynamo_flexkv.serve import load_graph
    from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config
    from dynamo_flexkv.serve.sources import ConfigSource

    file_config = load_config(resolve(CONFIGS, args.config) if args.config else None)
    config = apply_overrides(file_config, args.set)
    source = ConfigSource(args.config or "defaults", file_config, args.set)  # errors name the file or the --set
    return build_plan(load_graph(resolve(GRAPHS, args.graph)), config, run_dir=Path(run_dir), source=source, **kw)


def _run_dir(path: str) -> str | None:
    """serve --run-dir, checked before serve starts anything: made owner-only (0700) if missing, or an
    existing directory of this user's that others cannot write to. Returns the topmost directory it
    made (removed again if the start is refused), None if it existed. GraphError naming the flag and
    the fix otherwise."""
    import os
    import tempfile

    from dynamo_flexkv.core.sysutil import UnsafeDirectory, private_dir
    from dynamo_flexkv.serve import GraphError

    fix = "name a directory you can write to, or leave --run-dir out (serve makes a temp one)"
    if not path:  # "" would fall back to a temp directory, and then keep it as a named one
        raise GraphError(f"--run-dir is empty: {fix}")
    head = os.path.abspath(path)
    made = None
    while not os.path.lexists(head):
        made, head = head, os.path.dirname(head)
    try:
        private_dir(path, "the run directory (--run-dir)")
    except UnsafeDirectory as e:
        raise GraphError(str(e)) from None
    except OSError as e:
        raise GraphError(f"--run-dir {path}: cannot make it a directory ({e.strerror or e}): {fix}") from None
    try:  # serve makes its logs/ and each component's directory in it: one it may not write to fails late
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=path))
    except OSError as e:
        if made:
            import shutil

            shutil.rmtree(made, ignore_errors=True)
        raise GraphError(f"--run-dir {path}: cannot make a directory in it ({e.strerror or e}): {fix}") from None
    return made


_LABEL_NAME = r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"([a-z0-9]([a-z0-9.-]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}")  # Kubernetes' label syntax
_LABEL_VALUE = re.compile(rf"({_LABEL_NAME})?")


def _node_selector(items: list[str] | None) -> dict[str, str] | None:
    """render --node-selector: None (the default label) when not given; '' alone: none."""
    if items is None:
        return None
    from dynamo_flexkv.serve import GraphError

    out: dict[str, str] = {}
    for item in items:
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(value):
            raise GraphError(
                f"--node-selector {item!r}: expected KEY=VALUE with a Kubernetes label key ([prefix/]name, "
                "name up to 63 of [A-Za-z0-9._-] starting and ending alphanumeric) and value (the same, or "
                "empty), e.g. --node-selector nvidia.com/gpu.present=true"
            )
        if key in out and out[key] != value:
            raise GraphError(f"--node-selector {key}: given twice ({out[key]!r} and {value!r}): keep one")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "render"):
        from dynamo_flexkv.serve import GraphError

        try:
            if args.command == "render":
                from dynamo_flexkv.serve.render import SsdVolume, render_k8s

                plan = _plan(args, "/run/dynamo-flexkv", local=False)
                for note in plan.notes:
                    print(f"note: {note}", file=sys.stderr)
                text = render_k8s(plan, args.image, SsdVolume(args.ssd_volume), _node_selector(args.node_selector))
                if args.output:
                    try:
                        Path(args.output).write_text(text)
                    except OSError as e:
                        print(
                            f"error: render -o {args.output}: {e.strerror}: name a file in a directory that exists",
                            file=sys.stderr,
                        )
                        return 2
                    warned = text.count("\n# WARNING: ")
                    print(f"wrote {args.output}; its header has {warned} warning(s) to read first", file=sys.stderr)
                else:
                    sys.stdout.write(text)
                return 0
            import shutil
            import tempfile

            from dynamo_flexkv.serve.launcher import serve
            from dynamo_flexkv.serve.nodes import Nodes

            own = args.run_dir is None  # serve's own temp directory: it goes when serve stops
            made = None if own else _run_dir(args.run_dir)  # checked before anything starts
            run_dir = tempfile.mkdtemp(prefix="dynamo-flexkv-") if own else args.run_dir
            try:
                plan = _plan(
                    args,
                    run_dir,
                    discovery_backend=args.discovery_backend,
                    event_plane=args.event_plane,
                    nodes=Nodes.load(args.nodes) if args.nodes else None,
                )
            except BaseException:  # a refused start leaves nothing behind
                if own or made:
                    shutil.rmtree(made or run_dir, ignore_errors=True)
                raise
        except GraphError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return serve(plan, sys.stdout, console=Console(args.console), remove_run_dir=own and not args.keep_run_dir)
    if args.command == "nodes":
        return _nodes(args)
    if args.command in ("replay", "demo"):
        from dynamo_flexkv.replay.main import run as replay_run

        return replay_run(args)
    if args.command == "doctor":
        from dynamo_flexkv.doctor import main as doctor_main

        return doctor_main(args.cache_dirs, args.json)
    if args.command == "cache-server":
        from dynamo_flexkv.cache_server import run as cache_server_run

        return cache_server_run(args)
    if args.command == "cache":
        from dynamo_flexkv.cache_cli import run as cache_run

        return cache_run(args)
    if args.command == "bench":
        from dynamo_flexkv.bench import run_command

        return run_command(args)
    raise AssertionError(args.command)


def _nodes(args: argparse.Namespace) -> int:
    from dynamo_flexkv.serve.graph import GraphError
    from dynamo_flexkv.serve.nodes import Nodes, NodesError

    try:
        if args.action == "up":
            made = Nodes.up(args.prefix, args.names or ("A", "B", "C"), path=Path(args.file))
            for node in made.nodes.values():
                print(f"node {node.name}: netns {node.netns}, {node.address} and {node.address6} on {node.device}")
            first = next(iter(made.nodes.values()))
            print(
                f"wrote {args.file}; serve from the frontend's node: ip netns exec {first.netns} "
                f"dynamo-flexkv serve GRAPH -f CONFIG --nodes {args.file} --discovery-backend etcd --event-plane nats "
                f"--set Frontend.node={first.name} --set <Worker>.node=<name> ..."
            )
            return 0
        made = Nodes.load(args.file, "--file")
        if args.action == "down":
            if args.names:
                print(f"error: nodes down takes no names (it removes every namespace of {args.file})", file=sys.stderr)
                return 2
            made.down()
            return 0
        if len(args.names) != 2 or args.names[0] not in made.nodes or args.names[1] not in ("up", "down"):
            print(f"error: nodes link NAME up|down, NAME one of {sorted(made.nodes)}", file=sys.stderr)
            return 2
        made.set_link(args.names[0], args.names[1] == "up")
        return 0
    except (NodesError, GraphError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
