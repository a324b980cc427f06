"""What the remote-tier tests share: a KVManager on a Redis URL, the engine side that puts and
checks exact bytes, and the serve overrides of a remote-only graph."""

from __future__ import annotations

import numpy as np
from kv_helpers import MODEL, TPB, assert_no_leaks, config, device_tensors, fill, holds

from dynamo_flexkv import KVLayoutType, KVManager, TaskStatus

LAYOUT = KVLayoutType.LAYERBLOCK
DEVICE_BLOCKS = 64


def manager(tmp_path, url, host_blocks=32, namespace=None, **kw) -> KVManager:
    cfg = config(
        tmp_path,
        host_blocks=host_blocks,
        disk_blocks=0,
        enable_remote=True,
        remote_cache_url=url,
        remote_timeout_s=kw.pop("remote_timeout_s", 1.0),
        **kw,
    )
    return KVManager(MODEL, cfg, namespace=namespace)


class Engine:
    """The engine side of one manager: its device tensors, put and checked get."""

    def __init__(self, kv: KVManager, seed: int = 0, device_blocks: int = DEVICE_BLOCKS) -> None:
        self.kv, self.device_blocks = kv, device_blocks
        self.dev = device_tensors(LAYOUT, device_blocks)
        kv.register_device_cache(self.dev, LAYOUT)
        self.rng = np.random.default_rng(seed)

    def put(self, prompt) -> None:
        h = self.kv.hashes(prompt).sequence
        ids = self.rng.choice(self.device_blocks, size=len(h), replace=False)
        for b, s in zip(ids, h):
            fill(self.dev, LAYOUT, int(b), int(s))
        t = self.kv.put_async(prompt, ids)
        assert self.kv.wait([t], timeout=30)[t].ok
        assert self.kv.drain(30)  # the write-behind to remote finished

    def get(self, prompt, expect_status=TaskStatus.SUCCESS, layerwise=False):
        """Loads the cached prefix; every block it reports loaded holds the exact bytes."""
        h = self.kv.hashes(prompt).sequence
        ids = self.rng.choice(self.device_blocks, size=len(h), replace=False)
        for b in ids:  # poison: a block that was not loaded cannot pass the check by accident
            for layer in range(MODEL.num_layers):
                self.dev[layer][int(b)].fill_(0)
        t = self.kv.get_async(prompt, ids, layerwise=layerwise)
        planned = self.kv.planned_tokens_by_tier(t)
        r = self.kv.wait([t], timeout=30)[t]
        assert r.status is expect_status, r
        if r.ok:
            assert r.num_tokens == sum(planned.values())
            for i in range(r.num_tokens // TPB):
                assert holds(self.dev, LAYOUT, int(ids[i]), int(h[i])), f"block {i}: wrong bytes"
        assert self.kv.drain(30)
        return r, planned


def prompt_of(rng, blocks: int):
    return rng.integers(0, 50000, blocks * TPB + 5).tolist()


def check_clean(kv: KVManager) -> None:
    assert kv.drain(30)
    assert_no_leaks(kv)
    s = kv.stats()
    assert s.tasks.queued_ops == 0 and s.requests.tasks_in_flight == 0


# A graph whose workers offload to Redis only (no SSD, no device prefix cache).
REMOTE = [
    "FlexKVWorker.cache.enable_remote=true",
    "FlexKVWorker.cache.ssd_cache_gb=0",
    "FlexKVWorker.device-prefix-cache=false",
    "FlexKVWorker.restart-backoff-s=0.2",
]


def make_test_certs(directory: str) -> str:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl CLI), for TLS tests."""

    import os
    import subprocess

    from dynamo_flexkv.core.sysutil import require_binary

    openssl = require_binary("openssl", "install Debian's openssl package")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60, cwd=directory)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *ec, "-days", "2", "-subj", "/CN=flexkv-test-ca", "-keyout", "ca.key", "-out", "ca.crt")
    run("req", *ec, "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr")
    with open(os.path.join(directory, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
    )
    return directory
