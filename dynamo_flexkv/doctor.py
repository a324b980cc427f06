"""``dynamo-flexkv doctor``: what this machine offers the data plane, and what falls back."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynamo_flexkv.core.config import CacheConfig


class Status(str, Enum):
    OK = "ok"
    FALLBACK = "fallback"  # works, through a slower path
    MISSING = "missing"  # required and absent: the package cannot run
    INVALID = "invalid"  # configured wrong: the detail names the value, where it came from and the fix


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str


def check_native() -> Check:
    try:
        from dynamo_flexkv.core import native
    except ImportError as e:
        return Check(
            "native extension",
            Status.MISSING,
            f"{e}; build it with `make install` in a checkout, or reinstall the wheel",
        )
    return Check("native extension", Status.OK, native.PATH)


def check_package_data() -> Check:
    """The model presets, serve graphs and configs: inside the package when installed from a
    wheel, the repository's own folders in a checkout."""
    from dynamo_flexkv.resources import CONFIGS, GRAPHS, presets_dir, shipped_dir, shipped_names

    presets = sorted(p.stem for p in presets_dir().glob("*.yaml"))
    graphs, configs = shipped_names(GRAPHS), shipped_names(CONFIGS)
    if not (presets and graphs and configs):
        return Check(
            "package data",
            Status.MISSING,
            f"presets {presets}, graphs {graphs}, configs {configs} under {shipped_dir(CONFIGS).parent}: "
            "the install is incomplete; reinstall with `pip install .` from the repository",
        )
    return Check(
        "package data",
        Status.OK,
        f"{shipped_dir(GRAPHS).parent}: graphs {graphs}, configs {configs}, model presets {presets}",
    )


_SYS_IO_URING_SETUP = 425  # same number on x86_64 and aarch64


def check_io_uring() -> Check:
    """Creates (and closes) a one-entry ring: seccomp or an old kernel make this fail."""
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    fd = libc.syscall(_SYS_IO_URING_SETUP, 1, params)
    if fd < 0:
        err = ctypes.get_errno()
        return Check(
            "io_uring",
            Status.FALLBACK,
            f"io_uring_setup failed ({os.strerror(err)}): disk I/O uses a pread/pwrite thread pool",
        )
    os.close(fd)
    return Check("io_uring", Status.OK, "io_uring_setup works: disk I/O uses batched io_uring")


REPLICA = "{replica}"  # serve's per-replica template in an ssd_cache_dir


def probe_dir(directory: str) -> tuple[str, str]:
    """(the existing directory to probe, what the check says about it). doctor creates nothing: a
    directory that does not exist yet is probed where it would be made (its nearest existing
    parent: the same filesystem), and a serve template (``{replica}``, each replica's number) is a
    path no process ever opens as written."""
    note = ""
    path = os.path.abspath(directory)
    if REPLICA in directory:
        path = os.path.dirname(os.path.abspath(directory.split(REPLICA, 1)[0] + "x"))
        note = f"{directory} is a serve template ({REPLICA} is each replica's number): "
    probe = path
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if probe != os.path.abspath(directory):
        what = "the replicas' directories would be made" if note else f"{directory} would be made"
        note += f"probed {probe}, where {what}; "
    return probe, note


def check_o_direct(directory: str) -> Check:
    name = f"O_DIRECT on {directory}"
    if os.path.exists(directory) and not os.path.isdir(directory):  # probe_dir would probe its parent
        return Check(
            name,
            Status.INVALID,
            f"{directory} is a file, not a directory: a disk tier needs a directory there (name one with "
            "--cache-dir or ssd_cache_dir, or remove the file)",
        )
    probe, note = probe_dir(directory)
    try:
        fd, path = tempfile.mkstemp(dir=probe, prefix=".flexkv-odirect-")
        os.close(fd)
    except OSError as e:
        return Check(name, Status.FALLBACK, f"{note}cannot create a file there ({e.strerror})")
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
        try:
            buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT requires
            buf.write(b"\x5a" * 4096)
            os.pwrite(fd, buf, 0)
            buf.close()
        finally:
            os.close(fd)
        return Check(name, Status.OK, f"{note}aligned direct writes work (no page-cache double buffering)")
    except OSError as e:
        return Check(name, Status.FALLBACK, f"{note}O_DIRECT refused ({e.strerror}): buffered I/O is used")
    finally:
        os.unlink(path)


def check_cuda() -> Check:
    try:
        import torch
    except ImportError:
        return Check("CUDA", Status.FALLBACK, "torch is not installed: install it before using device tiers")
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return Check("CUDA", Status.OK, f"torch {torch.__version__}: {names}")
    return Check(
        "CUDA", Status.FALLBACK, f"torch {torch.__version__} without CUDA: CPU tensors stand in for device memory"
    )


def check_nixl() -> list[Check]:
    """Probes NIXL in a child process: the UCX plugin's bundled libnl crashes in its exit-time
    destructor (SIGSEGV in rtnl_tc_unregister, NIXL 1.5.1), which must not take doctor down."""
    proc = subprocess.run(
        [sys.executable, "-c", "from dynamo_flexkv.doctor import _nixl_probe; _nixl_probe()"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return [Check("NIXL", Status.FALLBACK, f"probe failed (exit {proc.returncode}): {proc.stderr.strip()[-200:]}")]
    return [Check(d["name"], Status(d["status"]), d["detail"]) for d in map(json.loads, lines)]


def _nixl_probe() -> None:
    """Child side of check_nixl: one JSON line per check, then a hard exit (see check_nixl)."""
    for c in _nixl_checks():
        print(json.dumps({**asdict(c), "status": c.status.value}), flush=True)
    os._exit(0)


def _nixl_checks() -> list[Check]:
    try:
        import nixl._api  # noqa: F401

        from dynamo_flexkv.core.transfer.nixl_agents import new_agent
    except ImportError as e:
        return [Check("NIXL", Status.FALLBACK, f"not importable ({e}): our own movers are used")]
    try:
        agent = new_agent(f"flexkv-doctor-{os.getpid()}", [])
        plugins = set(agent.get_plugin_list())
    except Exception as e:  # noqa: BLE001 - NIXL raises its own error types; report them as they are
        return [Check("NIXL", Status.FALLBACK, f"agent creation failed: {e}")]
    out = []
    for backend, use in (
        ("POSIX", "host<->disk"),
        ("UCX", "host<->remote host"),
        ("GDS", "GPUDirect Storage"),
        ("GDS_MT", "host<->disk when enable_gds"),
    ):
        if backend not in plugins:
            out.append(Check(f"NIXL {backend}", Status.FALLBACK, f"plugin absent: {use} without NIXL"))
            continue
        try:
            agent.create_backend(backend)
            out.append(Check(f"NIXL {backend}", Status.OK, f"backend created: {use}"))
        except Exception as e:  # noqa: BLE001 - NIXL's own types, e.g. GDS without cuFile / a GPU
            out.append(
                Check(
                    f"NIXL {backend}",
                    Status.FALLBACK,
                    f"plugin present, backend failed ({type(e).__name__}): {use} without it",
                )
            )
    return out


def check_dynamo() -> Check:
    try:
        from importlib.metadata import version

        import dynamo._core
    except ImportError as e:
        return Check(
            "Dynamo runtime", Status.FALLBACK, f"not importable ({e}): the library works, the Dynamo component does not"
        )
    try:
        import dynamo.common.backend  # noqa: F401

        backend = "dynamo.common.backend importable"
    except ImportError as e:
        backend = f"dynamo.common.backend missing ({e})"
    return Check("Dynamo runtime", Status.OK, f"ai-dynamo-runtime {version('ai-dynamo-runtime')}; {backend}")


def check_config(config: CacheConfig | None = None) -> tuple[Check, CacheConfig | None]:
    """The configuration (file and FLEXKV_* environment) and the CacheConfig it makes (None when it
    cannot be loaded: the check, "invalid", says why, naming the key, where its value came from and
    the fix)."""
    from dynamo_flexkv.core.config import (
        CONFIG_PATH_ENV,
        CacheConfig,
        ConfigError,
        env_settings,
        unknown_env,
        unknown_env_message,
    )

    if config is not None:
        return Check("config", Status.OK, "given"), config
    try:
        cfg = CacheConfig.load(warn_unknown_env=False)
    except ConfigError as e:
        return Check("config", Status.INVALID, str(e)), None
    unknown = unknown_env(os.environ, cfg.remote_password_env)
    if unknown:  # a misspelled variable: what the user meant to set is not what runs
        return Check("config", Status.INVALID, "; ".join(unknown_env_message(v, n) for v, n in unknown.items())), cfg
    path = os.environ.get(CONFIG_PATH_ENV)
    sources = ["defaults", *([f"{path} ({CONFIG_PATH_ENV})"] if path else []), *env_settings(os.environ)]
    return Check("config", Status.OK, f"loaded: {' < '.join(sources)}"), cfg


def check_remote(config=None) -> Check:
    """The remote tier as configured: reachable, logged in, cluster or not, eviction policy."""
    from dynamo_flexkv.core.sysutil import find_binary

    name = "remote tier (Redis)"
    server = find_binary("redis-server")
    local = f"redis-server {server}" if server else "redis-server not installed (`apt-get install redis-server`)"
    if config is None:
        found, config = check_config()
        if config is None:
            return Check(name, Status.INVALID, f"not checked: the config is invalid ({found.detail})")
    cfg = config
    if not cfg.enable_remote:
        return Check(name, Status.OK, f"disabled (enable_remote=false); {local} for `serve`'s own Redis")
    if not cfg.remote_cache_url:  # only reachable through serve, which fills the URL in
        return Check(name, Status.OK if server else Status.MISSING, f"no remote_cache_url: `serve` starts {local}")
    from dynamo_flexkv.core.config import ConfigError
    from dynamo_flexkv.core.remote import RemoteError, RemoteStore

    try:
        rc = cfg.remote_config()
    except ConfigError as e:
        return Check(name, Status.INVALID, f"config: {e}")
    try:
        store = RemoteStore(rc, 0, strict=True)
    except RemoteError as e:
        status = Status.MISSING if cfg.remote_required else Status.FALLBACK
        return Check(
            name,
            status,
            f"{e}" + ("" if cfg.remote_required else " (remote_required=false: workers start on their local tiers)"),
        )
    except Exception as e:  # noqa: BLE001 -- doctor reports, never dies with a traceback
        return Check(name, Status.MISSING, f"cannot open the remote tier at {rc.redacted_url}: {type(e).__name__}: {e}")
    kind = "Redis Cluster" if rc.parsed.cluster else "Redis"
    warn = getattr(store, "policy_warning", None)
    store.close()
    if warn:
        return Check(
            name,
            Status.FALLBACK,
            f"{kind} at {rc.redacted_url}: maxmemory-policy {warn} refuses every "
            "write once full; set maxmemory-policy allkeys-lru and a maxmemory",
        )
    return Check(
        name,
        Status.OK,
        f"{kind} at {rc.redacted_url} reachable; timeout {rc.timeout_s} s, "
        f"ttl {rc.ttl_s or 'none'}, key prefix {rc.key_prefix!r}",
    )


def _run_checks(cache_dirs: Sequence[str], loaded: Check, cfg) -> list[Check]:
    checks = [loaded, check_native(), check_package_data(), check_io_uring()]
    checks += [check_o_direct(d) for d in cache_dirs]
    checks += [check_cuda(), *check_nixl(), check_dynamo()]
    checks.append(
        check_remote(cfg)
        if cfg is not None
        else Check("remote tier (Redis)", Status.INVALID, "not checked: the config is invalid (see config)")
    )
    return [Check(c.name, c.status, _scrub(c.detail)) for c in checks]


# user:password@ after a scheme:// (to the last '@' before a space or quote) not already shown as
# ***@: a last guard so that no check's text (a library's exception, a value echoed) shows a password.
_USERINFO_IN_TEXT = re.compile(r"(://)(?!\*\*\*@)[^\s'\"]*@")


def _scrub(text: str) -> str:
    return _USERINFO_IN_TEXT.sub(r"\1***@", text)


def main(cache_dirs: Sequence[str] | None = None, as_json: bool = False) -> int:
    """Prints every check; 1 when one is missing or invalid (an invalid config is reported as the
    "config" check, not raised)."""
    loaded, cfg = check_config()
    if not cache_dirs:
        cache_dirs = (list(cfg.ssd_cache_dir) if cfg is not None else []) or [tempfile.gettempdir()]
    checks = _run_checks(cache_dirs, loaded, cfg)
    if as_json:
        print(json.dumps([{**asdict(c), "status": c.status.value} for c in checks], indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.name:<{width}}  {c.status.value:<8}  {c.detail}")
    return 1 if any(c.status in (Status.MISSING, Status.INVALID) for c in checks) else 0
