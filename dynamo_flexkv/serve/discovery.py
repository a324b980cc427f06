"""What a graph's workers registered in Dynamo's discovery store, read the way serve's launcher
needs it: whether a worker is registered yet (its model card, which names its system port, and
its serving endpoint), and deleting a dead worker's entries.

Both of serve's discovery backends hold the same documents under the same keys
(``v1/mdc/<namespace>/<component>/<endpoint>/<id>``, ``v1/instances/...``, ``v1/event_sources/...``):
file discovery as one file per key under DYN_FILE_KV, etcd as keys read over its JSON gateway
(ETCD_ENDPOINTS)."""

from __future__ import annotations

import base64
import json
import os
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Entry:
    key: str  # the file's path (file discovery) or the etcd key
    text: str
    doc: dict[str, Any]


class Discovery:
    """One graph's discovery store, from a component's environment (None when serve cannot read
    it: another backend, or an etcd it does not reach)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.root = env.get("DYN_FILE_KV")
        etcd = env.get("ETCD_ENDPOINTS") or ("" if self.root else os.environ.get("ETCD_ENDPOINTS", ""))
        self.etcd = etcd.split(",")[0].strip().rstrip("/") if etcd else None

    @property
    def readable(self) -> bool:
        return bool(self.root or self.etcd)

    def entries(self) -> list[Entry] | None:
        """Every registered document, or None when the store cannot be read now."""
        try:
            return self._files() if self.root else self._etcd() if self.etcd else None
        except (OSError, ValueError):
            return None

    def _files(self) -> list[Entry]:
        out = []
        for path in (Path(str(self.root)) / "v1").glob("*/*"):
            if path.name.startswith("."):  # Dynamo's temp files
                continue
            try:
                text = path.read_text()
                doc = json.loads(text)
            except (OSError, ValueError):  # removed or half-written meanwhile
                continue
            if isinstance(doc, dict):
                out.append(Entry(str(path), text, doc))
        return out

    def _etcd(self) -> list[Entry]:
        def b64(s: bytes) -> str:
            return base64.b64encode(s).decode()

        body = json.dumps({"key": b64(b"v1/"), "range_end": b64(b"v10")}).encode()  # every key under v1/
        req = urllib.request.Request(
            f"{self.etcd}/v3/kv/range", body, {"content-type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(req, timeout=2) as r:
            kvs = json.loads(r.read()).get("kvs", [])
        out = []
        for kv in kvs:
            try:
                text = base64.b64decode(kv.get("value", "")).decode()
                doc = json.loads(text)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(Entry(base64.b64decode(kv["key"]).decode(), text, doc))
        return out

    def delete(self, entry: Entry) -> bool:
        if self.root:
            try:
                os.unlink(entry.key)
                return True
            except FileNotFoundError:
                return False
        return False  # etcd: the entries go with the worker's lease (Dynamo's 10 s TTL)


def worker_ids(entries: list[Entry], host: str, port: int) -> set:
    """The instance ids of the worker whose system server is ``host:port``: its model card names
    that address (the card's files are served from it)."""
    marker = f"http://{host}:{port}/"
    return {e.doc.get("instance_id") for e in entries if e.doc.get("type") == "Model" and marker in e.text} - {None}


def registered(entries: list[Entry], host: str, port: int) -> bool:
    """The worker on ``host:port`` published its model card and the endpoint the card serves:
    the frontend can route to it (what Dynamo's /health then reports ready)."""
    marker = f"http://{host}:{port}/"
    for card in entries:
        doc = card.doc
        if doc.get("type") != "Model" or marker not in card.text:
            continue
        for e in entries:
            d = e.doc
            if (
                d.get("type") == "Endpoint"
                and d.get("instance_id") == doc.get("instance_id")
                and (d.get("component"), d.get("endpoint")) == (doc.get("component"), doc.get("endpoint"))
            ):
                return True
    return False


def owned_by(entries: list[Entry], ids: set) -> list[Entry]:
    """The entries of these instances: their cards and endpoints, and the event sources whose
    worker they are."""
    out = []
    for e in entries:
        worker = (e.doc.get("metadata") or {}).get("worker") or {}
        if e.doc.get("instance_id") in ids or worker.get("worker_id") in ids:
            out.append(e)
    return out
