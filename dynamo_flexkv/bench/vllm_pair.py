"""bench vllm's recompute / miss pair: the connector's miss-path cost, measured against no
connector on the same prompts by two engines alive at once, their requests interleaved.

Timing the two in processes minutes apart let the machine's drift in between (other processes,
turbo, page cache) move their ratio by more than the few percent being measured. Here both
engines are up, the requests alternate between them in ABBA order (so a trend over the series
weighs on both alike), and each one starts only once both engines are idle: the previous
request's stores finished and drained (``settle_s``, recorded and reported beside the TTFT), and
vLLM's worker done with its busy-wait after a step (measured from /proc, not slept for).

``bench vllm --peer lmcache`` runs the same way a third engine in the pair (LMCache's miss path)
and, for the loaded cases, ours and LMCache's engines side by side, each request of a case
interleaved with the other's same case (host / its CPU tier, disk / its disk tier, the restart);
``bench vllm --node`` likewise adds ours through the node cache (bench/vllm_node.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dynamo_flexkv.bench import peer_lmcache as lmc
from dynamo_flexkv.bench.vllm_engine import PROGRESS, READY, RESULT
from dynamo_flexkv.bench.vllm_node import NodeCacheServer
from dynamo_flexkv.bench.vllm_setup import engine_env, kv_transfer_config
from dynamo_flexkv.core.procgroup import stop_group, wait_group

_TICK = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds used so far by the live processes of process group ``pgid``."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ...
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICK


def wait_quiet(pgids: Sequence[int], window_s: float = 0.25, busy_frac: float = 0.05, timeout_s: float = 30.0) -> float:
    """Until the process groups together use under ``busy_frac`` of one core over a window;
    returns the seconds waited. Raises if they stay busy ``timeout_s``."""
    t0 = time.monotonic()
    before = sum(group_cpu_s(g) for g in pgids)
    while True:
        time.sleep(window_s)
        now = sum(group_cpu_s(g) for g in pgids)
        if now - before < busy_frac * window_s:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(
                f"bench vllm: engines still busy ({(now - before) / window_s:.0%} of a core) "
                f"after {timeout_s:.0f} s idle"
            )
        before = now


class ServedEngine:
    """One engine in serve mode (``python -m <module> --serve SPEC``, by default
    bench/vllm_engine.py): its log goes to a file, its RESULT lines to ``call``. ``wrap``: argv
    the command runs under (e.g. ``ip netns exec NODE``)."""

    def __init__(
        self,
        role: str,
        spec: dict[str, Any],
        env: dict[str, str],
        workdir: str,
        module: str = "dynamo_flexkv.bench.vllm_engine",
        wrap: Sequence[str] = (),
    ) -> None:
        self.role = role
        spec_path = os.path.join(workdir, f"spec-{role}.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(dict(spec, role=role), f)
        self.log_path = os.path.join(workdir, f"engine-{role}.log")
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 - the engine's, closed in close()
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", module, "--serve", spec_path],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both PIPE
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith(PROGRESS):
                print("  " + line[len(PROGRESS) :].strip(), flush=True)
            if line.startswith((READY, RESULT)):
                self._lines.put(line)
        self._lines.put(None)  # the process ended

    def _next(self, timeout_s: float, waiting_for: str) -> str:
        try:
            line = self._lines.get(timeout=timeout_s)
            why = "" if line is not None else f"exited with {self.proc.wait()}"
        except queue.Empty:
            line, why = None, f"no answer within {timeout_s:.0f} s"
        if line is None:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                tail = f.read()[-6000:]
            raise RuntimeError(f"bench vllm: engine {self.role} {why} while {waiting_for}; its log ends:\n{tail}")
        return line

    def wait_ready(self, timeout_s: float) -> None:
        self._next(timeout_s, "starting")

    def call(self, cmd: dict[str, Any], timeout_s: float, waiting_for: str) -> dict[str, Any]:
        """Sends one command line and returns its RESULT."""
        self.stdin.write(json.dumps(cmd) + "\n")
        self.stdin.flush()
        return json.loads(self._next(timeout_s, waiting_for)[len(RESULT) :])

    def request(self, case: str, size: int, index: int, timeout_s: float) -> dict[str, Any]:
        return self.call({"case": case, "size": size, "index": index}, timeout_s, f"timing {case} #{index}")

    def stop(self) -> None:
        try:
            self.stdin.close()
        except OSError:
            pass
        # stdin closed: the engine and its vLLM processes exit by themselves; signals only if not
        wait_group(self.proc, time.monotonic() + 30)
        done = stop_group(self.proc, grace_s=20)
        if not done.clean:
            print(f"bench vllm: stopping an engine {done.describe()}", file=sys.stderr, flush=True)
        self._log.close()


def run_interleaved(
    groups: Sequence[Sequence[tuple[ServedEngine, str]]],
    sizes: Sequence[int],
    repeat: int,
    timeout_s: float,
    also_quiet: Sequence[int] = (),
    tier: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """``<case>-<size>`` from each (engine, case) of each group, per size and group: the engines of
    a group take turns on request ``i``, their order reversed every round (AB BA AB ..., ABC CBA
    ...), each request from idle engines (and idle ``also_quiet`` process groups: a peer's cache
    server). Fresh prompts (nothing cached), or with ``tier`` the loaded cases of tier_request."""
    results: dict[str, list[dict[str, Any]]] = {}
    pgids = sorted({e.proc.pid for g in groups for e, _ in g} | set(also_quiet))
    k = 0
    for size in sizes:
        for group in groups:
            for i in range(repeat):
                for eng, case in group if k % 2 == 0 else group[::-1]:
                    wait_quiet(pgids)
                    if tier:
                        rec = eng.call({"tier": case, "size": size, "index": i}, timeout_s, f"timing {case} #{i}")
                    else:
                        rec = eng.request(f"{case}-{size}", size, i, timeout_s)
                        if rec["cached"]:
                            raise RuntimeError(
                                f"bench vllm: {case} {size}: a fresh prompt found {rec['cached']} cached tokens"
                            )
                    results.setdefault(f"{case}-{size}", []).append(rec)
                k += 1
    return results


@contextlib.contextmanager
def served(made: Sequence[tuple[str, dict[str, Any], dict[str, str]]], workdir: str) -> Iterator[list[ServedEngine]]:
    """(role, spec, env) engines in serve mode, started one at a time (engines starting together on
    2 cores start slowly), all stopped on the way out."""
    print(f"bench vllm: engines {' + '.join(m[0] for m in made)} (requests interleaved) ...", flush=True)
    engines: list[ServedEngine] = []
    try:
        for role, spec, env in made:
            engines.append(ServedEngine(role, spec, env, workdir))
            engines[-1].wait_ready(900)
        yield engines
    finally:
        for e in engines:
            e.stop()


def run_pair(
    base: ServedEngine, ours: ServedEngine, sizes: Sequence[int], repeat: int, timeout_s: float
) -> dict[str, list[dict[str, Any]]]:
    """``recompute-<size>`` from ``base`` and ``miss-<size>`` from ``ours``, ABBA-interleaved."""
    return run_interleaved([[(base, "recompute"), (ours, "miss")]], sizes, repeat, timeout_s)


def _lmcache_engine(
    spec: dict[str, Any], workdir: str, server: lmc.LMCacheServer, prefix: Path
) -> tuple[dict[str, Any], dict[str, str]]:
    return (
        dict(spec, kv_transfer_config=lmc.kv_transfer_config(server.port), lmcache_http=server.http),
        lmc.peer_env(engine_env(workdir, "plain", 0, 0), prefix),
    )


def _node_engine(
    role: str, spec: dict[str, Any], workdir: str, host_bytes: int, node: NodeCacheServer
) -> tuple[str, dict[str, Any], dict[str, str]]:
    return (
        role,
        dict(spec, kv_transfer_config=kv_transfer_config("flexkv", host_bytes)),
        engine_env(workdir, role, host_bytes, 0, node_socket=node.socket),
    )


def _quiet_pids(lmcache: lmc.LMCacheServer | None, node: NodeCacheServer | None) -> list[int]:
    """The servers' process groups: each request starts once they are idle too."""
    return [s.proc.pid for s in (lmcache, node) if s is not None and s.proc is not None]


def run_miss_engines(
    spec: dict[str, Any],
    workdir: str,
    host_bytes: int,
    disk_bytes: int,
    timeout: float,
    server: lmc.LMCacheServer | None,
    prefix: Path | None,
    node: NodeCacheServer | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """The recompute / miss engines alive at once (no connector, ours and, with ``server``,
    LMCache's, with ``node`` ours through that node cache), the same fresh prompts interleaved."""
    made = [
        ("plain-pair", dict(spec, kv_transfer_config=None), engine_env(workdir, "plain", host_bytes, disk_bytes)),
        (
            "flexkv-pair",
            dict(spec, kv_transfer_config=kv_transfer_config("flexkv", host_bytes)),
            engine_env(workdir, "flexkv-pair", host_bytes, disk_bytes),
        ),
    ]
    cases = ["recompute", "miss"]
    if server is not None and prefix is not None:
        made.append(("lmcache-pair", *_lmcache_engine(spec, workdir, server, prefix)))
        cases.append("lmcache-miss")
    if node is not None:
        made.append(_node_engine("flexkv-node-pair", spec, workdir, host_bytes, node))
        cases.append("node-miss")
    with served(made, workdir) as engines:
        return run_interleaved(
            [list(zip(engines, cases))], spec["sizes"], spec["repeat"], timeout, also_quiet=_quiet_pids(server, node)
        )


def run_tier_engines(
    spec: dict[str, Any],
    workdir: str,
    host_bytes: int,
    disk_bytes: int,
    timeout: float,
    server: lmc.LMCacheServer | None = None,
    prefix: Path | None = None,
    node: NodeCacheServer | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Ours (host + disk) beside LMCache's engine (against ``server``) and/or ours through the
    node cache ``node``, alive at once, each request of a case interleaved with the others' same
    case: host / LMCache's CPU tier / the node's host. Then the engines stop and a fresh one of
    each starts: ours on the disk tier the first one left, LMCache's against its still-running
    server, the node engine against the still-running node cache: restart (ours from the
    re-adopted disk, LMCache from the CPU tier its server kept, the node from its host tier), then
    disk (LMCache: its disk tier; the node: its disk, its host evicted). Every size's restart comes
    before any disk case: the disk cases empty the host tiers the restart cases read."""
    first = [
        (
            "flexkv-tiers",
            dict(spec, kv_transfer_config=kv_transfer_config("flexkv", host_bytes)),
            engine_env(workdir, "flexkv", host_bytes, disk_bytes),
        )
    ]
    again = [("flexkv-restart", first[0][1], engine_env(workdir, "flexkv-restart", host_bytes, disk_bytes))]
    cases = [("host", "restart", "disk")]
    if server is not None and prefix is not None:
        theirs = _lmcache_engine(spec, workdir, server, prefix)
        first.append(("lmcache-tiers", *theirs))
        again.append(("lmcache-restart", *theirs))
        cases.append(("lmcache-host", "lmcache-restart", "lmcache-disk"))
    if node is not None:
        first.append(_node_engine("flexkv-node", spec, workdir, host_bytes, node))
        again.append(_node_engine("flexkv-node-restart", spec, workdir, host_bytes, node))
        cases.append(("node-host", "node-restart", "node-disk"))
    quiet, sizes, repeat = _quiet_pids(server, node), spec["sizes"], spec["repeat"]
    with served(first, workdir) as engines:
        results = run_interleaved(
            [[(e, c[0]) for e, c in zip(engines, cases)]], sizes, repeat, timeout, quiet, tier=True
        )
    with served(again, workdir) as engines:
        for k in (1, 2):
            results.update(
                run_interleaved([[(e, c[k]) for e, c in zip(engines, cases)]], sizes, repeat, timeout, quiet, tier=True)
            )
    return results
