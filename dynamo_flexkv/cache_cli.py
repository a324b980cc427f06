"""``dynamo-flexkv cache``: see and clear what is cached, on a running worker or node cache service.

One request (core/inventory.py CacheRequest) to each target named: a worker's system port or a
cache-server's --metrics-port (``--url``: POST /engine/control/flexkv_cache, the same route and JSON
body on both), a cache-server's socket (``--socket``: the node protocol's Admin request) or a vLLM
worker's FlexKVConnector (``--vllm``: its lookup socket, the same JSON; dynamo.vllm's own HTTP
server has no route of ours). The answer is printed for people, or as JSON with ``--json``. Exit 0;
1 when a target failed or refused (its message says why); 2 for bad arguments."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, TextIO

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.inventory import (
    DEFAULT_WAIT_S,
    HTTP_ROUTE,
    MAX_WAIT_S,
    TIERS,
    BadCacheRequest,
    CacheReport,
    CacheRequest,
    KeptReason,
    parse_report,
    to_builtins,
    tokenize,
)

KEPT_WHY = {
    KeptReason.IN_USE.value: "in use: a load or a tier write reads them",
    KeptReason.FILLING.value: "filling: their bytes are still landing",
    KeptReason.PARENT.value: "parents: the prefix of kept blocks",
}


class TargetError(RuntimeError, FlexKVError):
    """A target that cannot be reached or refused the request (the message names the fix)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``cache [show|prefix|clear] ...``; the target, --json, --tier, --tenant and --model go before
    or after the action (all default to SUPPRESS, so that a subparser's default never replaces a
    value given before the action; the repeatable ones after it land in AFTER + dest, so that
    ``_repeated`` joins both sides: argparse would replace the list given before with the one after)."""
    _target_arguments(p)
    _select_arguments(p)
    actions = p.add_subparsers(dest="cache_action", metavar="{show,prefix,clear}")
    show = actions.add_parser(
        "show",
        help="per tier: blocks, bytes, capacity, blocks in use and filling, when the oldest and newest were "
        "last used (the default action)",
        description="Lists each target's namespaces (a worker: its own; a cache server: one per model, tenant "
        "and shard) and per tier the blocks held, in use (read by a load or a write now) and filling (still "
        "landing), bytes, capacity and how long ago the least and most recently used block was used.",
    )
    _target_arguments(show, AFTER)
    _select_arguments(show, AFTER)
    prefix = actions.add_parser(
        "prefix",
        help="which tiers hold which of a prompt's full blocks (by its token ids or its text)",
        description="Which tiers hold which of a prompt's full blocks: each tier holds a leading run of them. "
        "Looking changes nothing (no hit counted, no eviction order touched).",
    )
    _target_arguments(prefix, AFTER)
    _select_arguments(prefix, AFTER)
    prompt = prefix.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="the prompt's token ids: 1,2,3 or '1 2 3' or a JSON list")
    prompt.add_argument(
        "--text",
        help="the prompt's text, tokenized as a completion's prompt: by the worker, or here by --tokenizer "
        "(a cache server has no tokenizer)",
    )
    prefix.add_argument("--tokenizer", metavar="MODEL_DIR", help="tokenize --text here with MODEL_DIR/tokenizer.json")
    prefix.add_argument("--lora", help="the LoRA adapter the prompt ran with (its blocks are other blocks)")
    prefix.add_argument("--salt", help="the request's cache_salt")
    clear = actions.add_parser(
        "clear",
        help="remove what no request uses from every tier (or --tier), per --tenant / --model on a cache server; "
        "blocks a load or a write uses stay and are counted",
        description="Removes every block no request uses from every tier (or each --tier), as eviction would: "
        "blocks a load or a tier write reads, blocks still landing and their prefixes stay, counted by why. "
        "The removals count as cleared in the metrics and the router forgets the blocks. The remote tier "
        "(shared with other workers) is never cleared.",
    )
    _target_arguments(clear, AFTER)
    _select_arguments(clear, AFTER)
    clear.add_argument(
        "--wait",
        type=float,
        default=DEFAULT_WAIT_S,
        metavar="S",
        help=f"first wait up to S seconds for the tier writes in flight, so what they hold goes too "
        f"(default {DEFAULT_WAIT_S:g}; 0: clear what is free now)",
    )


AFTER = "after_action_"  # the dest prefix of a repeatable flag given after the action


def _repeated(args: argparse.Namespace, dest: str) -> list[str]:
    """A repeatable flag's values from before and after the action, in order, each once."""
    values = (getattr(args, dest, None) or []) + (getattr(args, AFTER + dest, None) or [])
    return list(dict.fromkeys(values))


def _target_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    default = argparse.SUPPRESS
    p.add_argument(
        "--url",
        action="append",
        dest=prefix + "url",
        default=default,
        metavar="URL",
        help="a worker's system port (serve prints each worker's /metrics address: use it without /metrics) or a "
        "cache-server's --metrics-port, e.g. http://127.0.0.1:8081 (repeatable)",
    )
    p.add_argument(
        "--socket",
        action="append",
        dest=prefix + "socket",
        default=default,
        metavar="PATH",
        help="a cache-server's Unix socket (its ready line; RUN_DIR/node-cache.sock under serve) (repeatable)",
    )
    p.add_argument(
        "--vllm",
        action="append",
        dest=prefix + "vllm",
        default=default,
        metavar="PATH",
        help="a vLLM worker's FlexKVConnector: its lookup socket (flexkv-lookup-ENGINE.ipc) or the directory that "
        "holds it (under serve RUN_DIR/VllmWorker, RUN_DIR/VllmWorker-0 with replicas; every rank's socket there "
        "is asked) (repeatable)",
    )
    p.add_argument("--json", action="store_true", default=default, help="print the answers as JSON")


def _select_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument(
        "--tier",
        action="append",
        choices=TIERS,
        dest=prefix + "tiers",
        default=argparse.SUPPRESS,
        help="only this tier (repeatable; default all): device is a worker's own KV memory, remote is listed "
        "and probed, never cleared",
    )
    p.add_argument(
        "--tenant",
        default=argparse.SUPPRESS,
        help="a cache server's namespaces of this tenant only (default: every tenant)",
    )
    p.add_argument(
        "--model",
        default=argparse.SUPPRESS,
        help="a cache server's namespaces of this model_id only (default: every model)",
    )


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    urls, sockets, vllm = (_repeated(args, dest) for dest in ("url", "socket", "vllm"))
    if not urls and not sockets and not vllm:
        print(
            "error: name what to ask: --url http://127.0.0.1:PORT (a worker's system port, or a cache-server's "
            "--metrics-port), --socket PATH (a cache-server's socket) or --vllm PATH (a vLLM worker's run "
            "directory or lookup socket)",
            file=sys.stderr,
        )
        return 2
    try:
        for url in urls:
            _check_url(url)
        for path in sockets:
            _check_socket(path)
        req = _request(args)
    except (BadCacheRequest, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    answers: list[tuple[str, CacheReport | None, str | None]] = []
    targets = [(_ask_url, u) for u in urls] + [(_ask_socket, s) for s in sockets]
    for path in vllm:
        try:
            targets += [(_ask_vllm, s) for s in vllm_sockets(path)]
        except TargetError as e:
            answers.append((path, None, str(e)))
    for ask, target in targets:
        try:
            answers.append((target, ask(target, req), None))
        except (TargetError, BadCacheRequest) as e:
            answers.append((target, None, str(e)))
    if getattr(args, "json", False):
        rows = [
            {"address": t, **({"report": to_builtins(r)} if r is not None else {"error": e})} for t, r, e in answers
        ]
        json.dump(rows, out, indent=2)
        out.write("\n")
    else:
        for target, report, error in answers:
            if report is None:
                print(f"{target}: error: {error}", file=sys.stderr)
            else:
                out.write(render(report, target))
    return 1 if any(e is not None for _, _, e in answers) else 0


def _check_url(url: str) -> None:
    """A --url that cannot name a server (a port out of range or not a number, no host, another
    scheme): BadCacheRequest naming it and the form, before anything is asked."""
    import urllib.parse

    form = (
        "http://HOST:PORT, e.g. --url http://127.0.0.1:8081 (a worker's system port or a cache-server's --metrics-port)"
    )
    try:
        parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    except ValueError as e:  # "Invalid IPv6 URL": an unclosed [
        raise BadCacheRequest(f"--url {url}: {e}: write {form}") from None
    try:
        port = parts.port
    except ValueError:  # "Port out of range 0-65535", "Port could not be cast to integer value as 'x'"
        port = 0
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or port == 0
        or (port is None and ":" in parts.netloc)
    ):
        why = (
            f"the scheme {parts.scheme}:// is not http"
            if parts.scheme not in ("http", "https")
            else ("no host" if not parts.hostname else f"the port {parts.netloc.rpartition(':')[2]!r} is not 1-65535")
        )
        raise BadCacheRequest(f"--url {url}: {why}: write {form}")


def _check_socket(path: str) -> None:
    """A --socket that names something other than a socket: BadCacheRequest saying what is there."""
    from dynamo_flexkv.core.sysutil import not_a_socket

    what = not_a_socket(path)
    if what:
        raise BadCacheRequest(
            f"--socket {path} is {what}, not a socket: name the cache-server's socket (its ready line prints it; "
            "RUN_DIR/node-cache.sock under serve)"
        )


def _request(args: argparse.Namespace) -> CacheRequest:
    action = getattr(args, "cache_action", None) or "show"
    wait = getattr(args, "wait", DEFAULT_WAIT_S)
    if not 0 <= wait <= MAX_WAIT_S:  # CacheRequest.check would name its field, wait_s
        raise BadCacheRequest(f"--wait {wait:g}: wait 0 to {MAX_WAIT_S:g} seconds for the tier writes in flight")
    op = {"show": "contents", "prefix": "prefix", "clear": "clear"}[action]
    tokens: list[int] | None = None
    text = getattr(args, "text", None)
    if getattr(args, "tokens", None) is not None:
        tokens = parse_tokens(args.tokens)
    elif text is not None and getattr(args, "tokenizer", None):
        tokens, text = tokenize(args.tokenizer, text), None
    return CacheRequest(
        op=op,
        tiers=_repeated(args, "tiers") or None,
        tenant=getattr(args, "tenant", None),
        model=getattr(args, "model", None),
        tokens=tokens,
        text=text,
        lora=getattr(args, "lora", None),
        salt=getattr(args, "salt", None),
        wait_s=wait,
    ).check(TIERS)


def parse_tokens(text: str) -> list[int]:
    """``1,2,3``, ``1 2 3`` or a JSON list of token ids."""
    stripped = text.strip()
    try:
        values = json.loads(stripped) if stripped.startswith("[") else stripped.replace(",", " ").split()
        tokens = [int(v) for v in values]
    except (ValueError, TypeError):
        raise BadCacheRequest(f"--tokens {text[:60]!r}: write token ids as 1,2,3 or '1 2 3' or [1, 2, 3]") from None
    if not tokens:
        raise BadCacheRequest("--tokens is empty: give the prompt's token ids")
    return tokens


def _ask_url(url: str, req: CacheRequest) -> CacheReport:
    base = url.rstrip("/")
    if base.endswith("/metrics"):
        base = base[: -len("/metrics")]
    if "://" not in base:
        base = "http://" + base
    body = json.dumps({k: v for k, v in to_builtins_request(req).items() if v is not None}).encode()
    http = urllib.request.Request(base + HTTP_ROUTE, body, headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(http, timeout=req.wait_s + 30) as r:
            answer = json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        if e.code in (404, 405, 501):  # no such route, or no POST: not one of ours
            raise TargetError(
                f"{base} answers no {HTTP_ROUTE}: it is neither a dynamo-flexkv worker's system port nor a "
                "cache-server's --metrics-port (a frontend's port? a vLLM worker? see docs/SERVING.md)"
            ) from None
        try:
            answer = json.loads(e.read() or b"{}")
        except ValueError:
            raise TargetError(f"{base}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", e)
        raise TargetError(
            f"cannot reach {base} ({why}): is the worker or cache server running, and is this its system port "
            "(serve prints each worker's /metrics address) or the cache-server's --metrics-port?"
        ) from None
    except ValueError as e:
        raise TargetError(f"{base} answered something that is not JSON: {e}") from None
    if not isinstance(answer, dict) or answer.get("status") != "ok":
        message = answer.get("message") if isinstance(answer, dict) else answer
        raise TargetError(str(message))
    return parse_report(answer["report"])


def to_builtins_request(req: CacheRequest) -> dict[str, Any]:
    import msgspec

    out: dict[str, Any] = msgspec.to_builtins(req)
    return out


def _ask_socket(path: str, req: CacheRequest) -> CacheReport:
    from dynamo_flexkv.core.node.admin import AdminError, NodeAdmin

    try:
        with NodeAdmin(path) as admin:
            return admin.request(req)
    except AdminError as e:
        raise TargetError(str(e)) from None


def vllm_sockets(path: str) -> list[str]:
    """A FlexKVConnector lookup socket, or every one in a directory (one per tensor-parallel rank)."""
    import glob
    import os
    import tempfile

    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "flexkv-lookup-*.ipc")))
        if not found:
            elsewhere = sorted(glob.glob(os.path.join(tempfile.gettempdir(), "flexkv-lookup-*.ipc")))
            if elsewhere:  # a run directory too deep for a socket path (107 bytes): lookup_endpoint's fallback
                raise TargetError(
                    f"no FlexKVConnector lookup socket in {path}; a run directory too deep for a socket path puts "
                    f"them in {tempfile.gettempdir()}: name one of {', '.join(elsewhere)}"
                )
            raise TargetError(
                f"no FlexKVConnector lookup socket (flexkv-lookup-*.ipc) in {path}: name a vLLM replica's "
                "directory (under serve RUN_DIR/VllmWorker, or VllmWorker-0 with replicas), or the socket "
                "itself (there once its worker logs 'FlexKVConnector worker rank 0')"
            )
        return found
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        near = sorted({os.path.dirname(p) for p in glob.glob(os.path.join(parent, "*", "flexkv-lookup-*.ipc"))})
        hint = f": the vLLM replicas' directories there are {', '.join(near)}" if near else ""
        raise TargetError(f"no such lookup socket or directory: {path}{hint}")
    return [path]


def _ask_vllm(path: str, req: CacheRequest) -> CacheReport:
    import struct

    import zmq

    from dynamo_flexkv.integrations.vllm_connector.lookup import ADMIN_SEQ

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect("ipc://" + path)
        body = json.dumps({k: v for k, v in to_builtins_request(req).items() if v is not None}).encode()
        sock.send_multipart([struct.pack("<q", ADMIN_SEQ), b"", body])
        if not sock.poll(int((req.wait_s + 30) * 1000)):
            raise TargetError(f"the vLLM worker at {path} did not answer: is it running?")
        frames = sock.recv_multipart()
    finally:
        sock.close()
    try:
        answer = json.loads(frames[-1])
    except ValueError:
        raise TargetError(
            f"the vLLM worker at {path} answered no cache request: its dynamo-flexkv predates them; upgrade it"
        ) from None
    if not isinstance(answer, dict) or answer.get("status") != "ok":
        raise TargetError(str(answer.get("message") if isinstance(answer, dict) else answer))
    return parse_report(answer["report"])


# ---- for people ------------------------------------------------------------------------------------
def render(report: CacheReport, address: str) -> str:
    lines = [f"{report.target} at {address}"]
    if report.op == "contents":
        if not report.contents:
            lines.append("  nothing attached yet: no namespace")
        for c in report.contents:
            lines.append(f"  {_who(c.model_id, c.tenant, c.shard)}" + (f", {c.engines} engine(s)" if c.engines else ""))
            rows = [("tier", "blocks", "in use", "filling", "bytes", "capacity", "last used: oldest / newest")]
            for t in c.tiers:
                rows.append(
                    (
                        t.tier,
                        str(t.blocks),
                        str(t.in_use),
                        str(t.filling),
                        _bytes(t.bytes),
                        f"{_bytes(t.capacity_bytes)} ({t.capacity_blocks} blocks)",
                        _ages(t.oldest_s, t.newest_s),
                    )
                )
            lines += _table(rows)
            if c.remote:
                lines.append(f"    remote   {c.remote} (shared with other workers: not counted here)")
    elif report.op == "prefix":
        if not report.prefixes:
            lines.append("  nothing attached yet: no namespace, so no block of this prompt is cached")
        for p in report.prefixes:
            lines.append(
                f"  {_who(p.model_id, p.tenant, p.shard)}: a prompt of {p.tokens} tokens, "
                f"{len(p.hashes)} full block(s) of {p.tokens_per_block}"
            )
            for start, end, where in p.runs():
                span = f"block {start}" if end == start + 1 else f"blocks {start}-{end - 1}"
                lines.append(f"    {span:<14} {', '.join(where) if where else 'no tier (computed on a request)'}")
            held = ", ".join(f"{t} {n}" for t, n in p.held.items())
            lines.append(f"    held (leading blocks per tier): {held or 'none'}")
            if p.note:
                lines.append(f"    note: {p.note}")
    else:
        if not report.cleared:
            lines.append("  nothing to clear: no namespace")
        for done in report.cleared:
            lines.append(f"  {_who(done.model_id, done.tenant, done.shard)}: cleared")
            for tier in done.tiers:
                kept = "; ".join(f"{n} {KEPT_WHY.get(why, why)}" for why, n in tier.kept.items())
                lines.append(f"    {tier.tier:<7} {tier.cleared} block(s) cleared" + (f", kept {kept}" if kept else ""))
            if done.note:
                lines.append(f"    note: {done.note}")
    return "\n".join(lines) + "\n"


def _who(model: str, tenant: str, shard: str) -> str:
    return (
        f"model {model or '(unnamed)'}, "
        + (f"tenant {tenant}" if tenant else "no tenant")
        + (f", shard {shard}" if shard else "")
    )


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["    " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _ages(oldest: float | None, newest: float | None) -> str:
    if oldest is None or newest is None:
        return "-"
    return f"{_age(oldest)} / {_age(newest)} ago"


def _age(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"
