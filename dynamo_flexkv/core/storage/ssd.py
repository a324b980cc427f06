"""Disk tier storage: block files striped over directories, O_DIRECT, and a journal that lets a
restarted worker re-adopt what is on disk.

Block ``b`` lives in directory ``b % D`` at offset ``(b // D) * block_bytes`` of that
directory's data file. The journal (in the first directory) starts with the layout fingerprint and
records ``S block seq parent checksum tokens`` (tokens: base64 u32 ids, so a restarted worker can
announce the block to the router again) after a block's bytes landed and ``R block`` when it left,
before its slot is reused; each line ends with the CRC32 of the rest, so a damaged line is
dropped, never read as another block. Appends and compactions are serialized by a lock. On
restart the journal is replayed: live entries of another namespace or model layout make adopt()
raise SsdLayoutError (another tenant's cache: only an explicit wipe drops it), those of an older
journal format are *mismatched*, entries that do not fit (out of range, orphaned, duplicated) are
*foreign*, blocks whose bytes fail their checksum are *torn*; the rest are adopted and the journal
is compacted.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import json
import logging
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dynamo_flexkv.core.errors import FlexKVError

log = logging.getLogger(__name__)

JOURNAL = "flexkv-journal.log"
DATA = "flexkv-blocks.kv"
LOCK = "flexkv.lock"
JOURNAL_FORMAT = 2  # 2: every line sealed with a CRC32


class SsdInUseError(RuntimeError, FlexKVError):
    """Another process holds this cache directory: two writers would corrupt each other."""


class SsdLayoutError(RuntimeError, FlexKVError):
    """The cache directory holds blocks of another namespace or model layout: opening it would drop
    them, so it is refused until the caller picks another directory or wipes this one."""


def lock_dir(directory: str) -> int:
    """Takes the directory's lock for this process (the fd holds it; closing releases it)."""
    fd = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise SsdInUseError(
            f"ssd_cache_dir {directory!r} is in use by pid {holder}: give each worker "
            "its own directory, or stop the process using it"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def check_dir_free(directory: str) -> None:
    """Raises SsdInUseError when a live process holds ``directory`` (lock taken and released)."""
    if os.path.exists(os.path.join(directory, LOCK)):
        os.close(lock_dir(directory))


@dataclass(frozen=True)
class DiskEntry:
    block_id: int
    seq_hash: int
    parent: int | None
    checksum: int
    tokens: bytes | None = None  # the block's token ids (u32 LE): a restart can announce it again


@dataclass
class AdoptReport:
    adopted: list[DiskEntry] = field(default_factory=list)  # parents before children
    torn: int = 0
    foreign: int = 0
    mismatched: int = 0
    stale: int = 0  # blocks of other weights (another lineage): dropped, never adopted


class SsdStore:
    def __init__(
        self,
        dirs: Sequence[str],
        num_blocks: int,
        block_bytes: int,
        fingerprint: dict,
        *,
        direct: bool = True,
        lineage: dict | None = None,
    ) -> None:
        if not dirs:
            raise ValueError("the disk tier needs at least one ssd_cache_dir")
        if block_bytes % 4096:
            raise ValueError(f"disk blocks must be multiples of 4096 bytes for O_DIRECT, got {block_bytes}")
        self.dirs = list(dirs)
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.fingerprint = dict(fingerprint, block_bytes=block_bytes, journal=JOURNAL_FORMAT)
        # What weights the blocks were computed with (the model's identity and a weight version).
        # Another layout or namespace is another tenant's cache (refused); other weights make the
        # blocks stale (dropped at start: a worker restarted with new weights comes back empty).
        self.lineage = dict(lineage or {})
        self.direct = direct
        per_file = -(-num_blocks // len(self.dirs))
        self.fds: list[int] = []
        self._locks: list[int] = []
        self._journal: int | None = None  # O_APPEND descriptor
        self._lock = threading.Lock()  # journal appends come from transfer threads and evictions
        self._closed = False
        try:
            for d in self.dirs:
                os.makedirs(d, mode=0o700, exist_ok=True)
                self._lock_dir(d)
                flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
                fd = os.open(os.path.join(d, DATA), flags, 0o600)
                self.fds.append(fd)
                if os.fstat(fd).st_size < per_file * block_bytes:
                    os.ftruncate(fd, per_file * block_bytes)
        except BaseException:
            self.close()  # nothing opened so far may leak, whatever failed
            raise
        self.entries: dict[int, DiskEntry] = {}  # what the journal says each live slot holds
        self._journal_path = os.path.join(self.dirs[0], JOURNAL)
        self._journal_lines = self._journal_bytes = 0
        self._rewrite_pending = self._header_matched = False
        self.journal_failures = 0  # journal writes that failed (ENOSPC, EIO); counted, never silent
        self.compact_slack = 4096  # dead journal lines tolerated beyond 4 per live block

    def _lock_dir(self, directory: str) -> None:
        self._locks.append(lock_dir(directory))

    # ---- addressing ------------------------------------------------------------------------------
    def locate(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(fd, byte offset) of each block."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise IndexError(f"disk block id out of range [0, {self.num_blocks})")
        d = len(self.fds)
        fds = np.asarray(self.fds, dtype=np.int32)[ids % d]
        offsets = (ids // d).astype(np.uint64) * np.uint64(self.block_bytes)
        return fds, offsets

    # ---- journal ----------------------------------------------------------------------------------
    def record_stored(self, entries: Iterable[DiskEntry]) -> None:
        """Journals blocks whose bytes landed. Raises OSError when the journal cannot be written
        (ENOSPC, EIO): the caller must then not commit the blocks."""
        entries = list(entries)
        with self._lock:
            before = {e.block_id: self.entries.get(e.block_id) for e in entries}
            self.entries.update((e.block_id, e) for e in entries)
            try:
                self._append([_stored_line(e) for e in entries])
            except BaseException:
                for b, prev in before.items():
                    if prev is None:
                        self.entries.pop(b, None)
                    else:
                        self.entries[b] = prev
                raise

    def record_removed(self, block_ids: Iterable[int]) -> None:
        """Journals slots that left the tier, before they are reused. Never raises for I/O: a lost
        removal is safe (the slot's next block fails the old checksum at restart); it is counted."""
        with self._lock:
            lines = [_sealed(f"R {b}") for b in block_ids if self.entries.pop(b, None) is not None]
            try:
                self._append(lines)
            except OSError as e:
                log.warning("disk journal: cannot record %d removals (%s)", len(lines), e.strerror)

    def _append(self, lines: list[str]) -> None:  # self._lock held; self.entries already updated
        if not lines:
            return
        if self._closed:
            raise RuntimeError("the disk tier is closed: its directory may belong to another manager now")
        if self._journal is None:  # the first record: the fresh journal holds it already
            self._start_journal(list(self.entries.values()))
            return
        data = "".join(lines).encode("ascii")
        try:
            _write_all(self._journal, data)
        except OSError:
            # No partial line may stay behind: the next line would merge with it.
            self.journal_failures += 1
            self._rewrite_pending = True  # lost removals: the next compaction makes the journal exact
            with contextlib.suppress(OSError):
                os.ftruncate(self._journal, self._journal_bytes)
            raise
        self._journal_bytes += len(data)
        self._journal_lines += len(lines)
        # Stores and removals only append; rewrite once the dead lines dominate.
        if self._rewrite_pending or self._journal_lines > 4 * len(self.entries) + self.compact_slack:
            try:
                self._start_journal(list(self.entries.values()))
            except OSError as e:  # keep appending to the old journal; try again later
                log.warning("disk journal: compaction failed (%s)", e.strerror)
                self._rewrite_pending = False
                self._journal_lines = 0

    def _start_journal(self, entries: list[DiskEntry]) -> None:  # self._lock held (or constructing)
        """Writes a fresh journal (header + ``entries``) beside the old one, then renames it in."""
        tmp = self._journal_path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                header = json.dumps({"fingerprint": self.fingerprint, "lineage": self.lineage}, sort_keys=True) + "\n"
                data = (header + "".join(_stored_line(e) for e in entries)).encode("ascii")
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._journal_path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None
        self._journal = os.open(self._journal_path, os.O_WRONLY | os.O_APPEND)
        self._journal_bytes = len(data)
        self._journal_lines = len(entries)
        self._rewrite_pending = False

    def _continue_journal(self) -> None:  # self._lock held
        """Appends to the existing journal after cutting a torn last line (it would merge with the next)."""
        fd = os.open(self._journal_path, os.O_RDWR | os.O_APPEND)
        size = os.fstat(fd).st_size
        tail = os.pread(fd, min(size, 1 << 16), max(0, size - (1 << 16)))
        cut = size - (len(tail) - (tail.rfind(b"\n") + 1))
        if cut != size:
            os.ftruncate(fd, cut)
        self._journal, self._journal_bytes, self._journal_lines = fd, cut, 0

    # ---- restart ----------------------------------------------------------------------------------
    def adopt(self, read_block: Callable[[list[DiskEntry]], np.ndarray]) -> AdoptReport:
        """Replays the journal and verifies each surviving block with ``read_block(entries) ->
        checksums`` (the caller reads through its mover). Compacts the journal to what is adopted."""
        report = AdoptReport()
        entries = self._replay(report)
        # Keep only chains whose every ancestor survived: parents first, prefix-closed.
        by_hash = {e.seq_hash: e for e in entries}
        if len(by_hash) != len(entries):
            report.foreign += len(entries) - len(by_hash)
        ordered, seen = [], set()
        pending = list(by_hash.values())
        while pending:
            rest = []
            for e in pending:
                if e.parent is None or e.parent in seen:
                    ordered.append(e)
                    seen.add(e.seq_hash)
                else:
                    rest.append(e)
            if len(rest) == len(pending):
                report.foreign += len(rest)  # orphans: their parent is gone or never was
                break
            pending = rest
        if ordered:
            sums = read_block(ordered)
            good = set()
            for e, s in zip(ordered, sums):
                ok = int(s) == e.checksum and (e.parent is None or e.parent in good)
                if ok:
                    good.add(e.seq_hash)
                    report.adopted.append(e)
                else:
                    report.torn += 1
        with self._lock:
            self.entries = {e.block_id: e for e in report.adopted}
            try:
                self._start_journal(report.adopted)
            except OSError as e:  # e.g. a full disk: the old journal still says the same
                if not self._header_matched:
                    raise
                log.warning("disk journal: cannot compact at start (%s); appending to the old one", e.strerror)
                self._continue_journal()
        log.info(
            "disk tier: adopted %d blocks, dropped %d torn, %d foreign, %d of another layout, %d of other weights",
            len(report.adopted),
            report.torn,
            report.foreign,
            report.mismatched,
            report.stale,
        )
        return report

    def _replay(self, report: AdoptReport) -> list[DiskEntry]:
        try:
            with open(self._journal_path, encoding="ascii", errors="replace") as f:
                header = f.readline()
                lines = f.readlines()
        except FileNotFoundError:
            return []
        try:
            head = json.loads(header)
            fp, lineage = head.get("fingerprint"), head.get("lineage")
        except (json.JSONDecodeError, AttributeError):
            fp = lineage = None
        if isinstance(fp, dict) and lineage is None and "model" in fp:  # journals before lineage: the
            fp = dict(fp)  # model's identity sat in the fingerprint
            lineage = {"model": fp.pop("model")}
        live: dict[int, DiskEntry] = {}
        for line in lines:
            body = _unsealed(line)
            parts = body.split() if body is not None else []
            try:
                if parts[0] == "S" and len(parts) in (5, 6):
                    b = int(parts[1])
                    parent = None if parts[3] == "-" else int(parts[3], 16)
                    tokens = base64.b64decode(parts[5], validate=True) if len(parts) == 6 else None
                    live[b] = DiskEntry(b, int(parts[2], 16), parent, int(parts[4], 16), tokens)
                elif parts[0] == "R" and len(parts) == 2:
                    live.pop(int(parts[1]), None)
                else:
                    raise ValueError(line)
            except (ValueError, IndexError, binascii.Error):
                report.foreign += 1  # a torn last line, a damaged line, or garbage
        self._header_matched = fp == self.fingerprint
        if fp != self.fingerprint:
            if live and isinstance(fp, dict):
                self._refuse_other_tenant(fp, len(live))
            report.mismatched = len(live)  # unreadable header or older journal format: nothing to keep
            return []
        if (lineage or {}) != self.lineage:
            report.stale = len(live)
            if live:
                log.warning(
                    "disk tier: dropping %d blocks computed with other weights (%s on disk, %s here)",
                    len(live),
                    lineage,
                    self.lineage,
                )
            return []
        out = []
        for e in live.values():
            if 0 <= e.block_id < self.num_blocks:
                out.append(e)
            else:
                report.foreign += 1
        return out

    def _refuse_other_tenant(self, found: dict, blocks: int) -> None:
        """Blocks of another namespace or model shape are another tenant's cache, not garbage."""
        keys = sorted(
            k for k in set(found) | set(self.fingerprint) if k != "journal" and found.get(k) != self.fingerprint.get(k)
        )
        if not keys:
            return  # only the journal format changed: this tenant's own blocks, not readable any more
        diff = ", ".join(f"{k} {found.get(k)!r} on disk vs {self.fingerprint.get(k)!r} here" for k in keys)
        files = [self._journal_path] + [os.path.join(d, DATA) for d in self.dirs]
        raise SsdLayoutError(
            f"ssd_cache_dir {self.dirs[0]!r} holds {blocks} blocks of another namespace or model layout ({diff}); "
            f"opening it here would drop them: give this namespace/model its own ssd_cache_dir, or wipe "
            f"the old cache explicitly by deleting {', '.join(files)}"
        )

    def set_lineage(self, lineage: dict) -> None:
        """The weights changed: the journal's header says so at once (its blocks were dropped
        first), so a restart with these weights adopts only what is stored from now on."""
        with self._lock:
            self.lineage = dict(lineage)
            self._start_journal([e for e in self.entries.values()])

    def checksum_of(self, block_id: int) -> int:
        return self.entries[block_id].checksum

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._journal is not None:
                os.close(self._journal)
                self._journal = None
            for fd in self.fds + self._locks:
                os.close(fd)  # closing the lock file releases the directory
            self.fds, self._locks = [], []


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _stored_line(e: DiskEntry) -> str:
    parent = "-" if e.parent is None else f"{e.parent:x}"
    tokens = "" if e.tokens is None else " " + base64.b64encode(e.tokens).decode("ascii")
    return _sealed(f"S {e.block_id} {e.seq_hash:x} {parent} {e.checksum:x}{tokens}")


def _sealed(body: str) -> str:
    """A journal line ends with the CRC32 of its body: a damaged line (a flipped bit in a hash)
    must read as garbage, never as another block."""
    return f"{body} {zlib.crc32(body.encode('ascii')):08x}\n"


def _unsealed(line: str) -> str | None:
    """The body of an intact line; None for a torn or damaged one."""
    body, _, crc = line.rstrip("\n").rpartition(" ")
    try:
        ok = len(crc) == 8 and int(crc, 16) == zlib.crc32(body.encode("ascii", errors="strict"))
    except (ValueError, UnicodeEncodeError):
        return None
    return body if ok and line.endswith("\n") else None
