"""The directories serve and the cache server make are owner-only (0700), the node cache's socket
0600; a directory given that another user owns, or that others may write to, is refused with a
message naming it and the fix (docs/SERVING.md, docs/NODE_CACHE.md)."""

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from node_helpers import server_config
from served import sleeper_plan

from dynamo_flexkv.core.node.server import NodeCacheServer, ServerOptions
from dynamo_flexkv.core.sysutil import UnsafeDirectory, private_dir
from dynamo_flexkv.serve import GraphError
from dynamo_flexkv.serve.launcher import Launcher
from dynamo_flexkv.serve.node_cache import SOCKET_MAX, socket_path
from dynamo_flexkv.serve.plan import RestartPolicy


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def someone_elses(tmp_path):
    """A directory this user does not own: chowned to nobody when we are root, else /."""
    if os.geteuid() != 0:
        return Path("/")
    d = tmp_path / "theirs"
    d.mkdir(mode=0o755)
    os.chown(d, 65534, 65534)
    return d


def test_private_dir_makes_every_missing_level_0700_whatever_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        made = private_dir(str(tmp_path / "a" / "b" / "c"), "the test directory")
    finally:
        os.umask(old)
    assert made == str(tmp_path / "a" / "b" / "c")
    assert [mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3


def test_private_dir_refuses_a_directory_others_may_write_or_another_user_owns(tmp_path, someone_elses):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(
        UnsafeDirectory, match=rf"the test directory {open_dir} is writable by others \(mode 0777\): chmod 700"
    ):
        private_dir(str(open_dir), "the test directory")
    shared = tmp_path / "shared"  # as /tmp: sticky and world-writable, which must stay so
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(UnsafeDirectory) as refused:
        private_dir(str(shared), "the test directory")
    assert "chmod" not in str(refused.value) and f"choose a path that does not exist yet (e.g. {shared}/flexkv" in str(
        refused.value
    )
    with pytest.raises(UnsafeDirectory, match=rf"{someone_elses} belongs to uid \d+, not to you"):
        private_dir(str(someone_elses), "the test directory")
    listed = tmp_path / "listed"
    listed.mkdir()
    os.chmod(listed, 0o755)
    private_dir(str(listed), "the test directory")  # others may list it: used as it is
    assert mode(listed) == 0o755
    private_dir(str(listed), "the test directory", tighten=True)  # a directory the caller names
    assert mode(listed) == 0o700
    a_file = tmp_path / "a-file"
    a_file.touch()
    with pytest.raises(UnsafeDirectory, match=rf"the test directory {a_file} is not a directory"):
        private_dir(str(a_file), "the test directory")


def test_serve_makes_its_run_directories_owner_only(tmp_path):
    plan = sleeper_plan(tmp_path, RestartPolicy())
    assert not plan.run_dir.exists()
    launcher = Launcher(plan)
    try:
        launcher.start()
        assert mode(plan.run_dir) == 0o700 and mode(plan.run_dir / "logs") == 0o700
        assert all(mode(f) == 0o600 for p in plan.processes + plan.infra for f in p.files)
    finally:
        launcher.shutdown()


def test_serve_refuses_a_run_directory_others_may_write_to(tmp_path):
    plan = sleeper_plan(tmp_path, RestartPolicy())
    plan.run_dir.mkdir()
    os.chmod(plan.run_dir, 0o777)
    launcher = Launcher(plan)
    with pytest.raises(GraphError, match=rf"the run directory \(--run-dir\) {plan.run_dir} is writable by others"):
        launcher.start()
    assert launcher.spawned == []  # nothing started


def test_the_node_cache_socket_is_0600_in_a_0700_directory(tmp_path):
    sock = tmp_path / "run" / "deeper" / "node.sock"
    with NodeCacheServer(server_config(tmp_path), ServerOptions(str(sock))):
        assert mode(sock) == 0o600
        assert mode(sock.parent) == 0o700 and mode(sock.parent.parent) == 0o700


def test_cache_server_refuses_a_socket_directory_others_may_write_to(tmp_path, someone_elses):
    for directory, why in ((tmp_path / "open", "is writable by others"), (someone_elses, "not to you")):
        directory.mkdir(exist_ok=True)
        if directory.name == "open":
            os.chmod(directory, 0o1777)  # as /tmp is
        r = subprocess.run(
            [sys.executable, "-m", "dynamo_flexkv.cli", "cache-server", "--socket", str(directory / "node.sock")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2, r.stderr
        assert f"node_socket's directory {directory}" in r.stderr and why in r.stderr, r.stderr
        assert not (directory / "node.sock").exists()


def test_a_run_directory_too_deep_for_a_socket_puts_it_in_a_directory_of_its_own(tmp_path):
    deep = tmp_path / ("d" * (SOCKET_MAX + 10))
    path = socket_path(deep, None, local=True)
    assert len(path.encode()) < 108  # sun_path
    parent = Path(path).parent
    assert parent.name.startswith(f"dynamo-flexkv-{os.getuid()}-") and str(parent.parent) == tempfile.gettempdir()
