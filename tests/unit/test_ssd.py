"""The disk tier's journal: what a restarted worker re-adopts, and what it drops."""

import os

import pytest

from dynamo_flexkv.core.storage.ssd import JOURNAL, DiskEntry, SsdLayoutError, SsdStore

BB = 4096
FP = {"namespace": ""}
WEIGHTS = {"model": "m"}


def store(tmp_path, fp=FP, n=64, lineage=WEIGHTS):
    return SsdStore([str(tmp_path / "a"), str(tmp_path / "b")], n, BB, fp, lineage=lineage)


def chain(start_block, hashes, parent=None):
    out, prev = [], parent
    for i, h in enumerate(hashes):
        out.append(DiskEntry(start_block + i, h, prev, 1000 + h))
        prev = h
    return out


def test_restart_adopts_valid_and_counts_the_rest(tmp_path):
    s = store(tmp_path)
    s.record_stored(chain(0, [1, 2, 3, 4]))  # slots 0..3
    s.record_stored(chain(10, [7, 8], parent=99))  # parent never stored: orphans
    s.record_removed([3])  # slot 3 (hash 4) left the tier
    s.close()
    with open(tmp_path / "a" / JOURNAL, "a") as f:
        f.write("S 5 garbage\n")  # a torn last line
    s = store(tmp_path)
    # Hash 2 reads back with the wrong checksum: torn, and its child 3 cannot be used either.
    report = s.adopt(lambda entries: [e.checksum + (e.seq_hash == 2) for e in entries])
    assert [e.seq_hash for e in report.adopted] == [1]
    assert report.torn == 2 and report.foreign == 1 + 2 and report.mismatched == 0
    s.close()
    # Another namespace on the same directory is refused: those blocks are another tenant's cache.
    # Nothing is dropped, and an explicit wipe (deleting the journal) frees the directory.
    s = store(tmp_path, fp={"namespace": "acme"})
    with pytest.raises(SsdLayoutError, match=r"namespace '' on disk vs 'acme' here.*deleting .*flexkv-journal.log"):
        s.adopt(lambda entries: [e.checksum for e in entries])
    s.close()
    s = store(tmp_path)
    assert [e.seq_hash for e in s.adopt(lambda entries: [e.checksum for e in entries]).adopted] == [1]
    s.close()
    os.unlink(tmp_path / "a" / JOURNAL)
    s = store(tmp_path, fp={"namespace": "acme"})
    assert s.adopt(lambda entries: [e.checksum for e in entries]).adopted == []
    s.close()


def test_blocks_of_other_weights_are_dropped_at_start_never_adopted(tmp_path):
    """A worker restarted with other weights (another model_id, or a weight version set by
    weights_changed) on the same directory starts, and adopts none of the old blocks."""
    s = store(tmp_path)
    s.record_stored(chain(0, [1, 2, 3]))
    s.close()
    s = store(tmp_path, lineage={"model": "m", "weights": "step-2"})
    report = s.adopt(lambda entries: [e.checksum for e in entries])
    assert report.adopted == [] and report.stale == 3 and report.mismatched == 0
    s.record_stored(chain(5, [9]))
    s.close()
    s = store(tmp_path, lineage={"model": "m", "weights": "step-2"})  # the new weights' own blocks stay
    assert [e.seq_hash for e in s.adopt(lambda entries: [e.checksum for e in entries]).adopted] == [9]
    s.set_lineage({"model": "m", "weights": "step-3"})  # changed at run time: the header says so at once
    s.close()
    s = store(tmp_path, lineage={"model": "m", "weights": "step-2"})
    assert s.adopt(lambda entries: [e.checksum for e in entries]).stale == 1
    s.close()


def test_a_journal_from_before_lineage_keeps_its_blocks(tmp_path):
    """Journals written before the weights moved out of the fingerprint named the model there."""
    s = SsdStore([str(tmp_path / "a"), str(tmp_path / "b")], 64, BB, {"namespace": "", "model": "m"})
    s.record_stored(chain(0, [1, 2]))
    s.close()
    with open(tmp_path / "a" / JOURNAL) as f:
        head, rest = f.readline(), f.read()
    with open(tmp_path / "a" / JOURNAL, "w") as f:  # the old header: no lineage key
        f.write(head.replace(', "lineage": {}', "").replace('"lineage": {}, ', "") + rest)
    s = store(tmp_path)
    assert [e.seq_hash for e in s.adopt(lambda entries: [e.checksum for e in entries]).adopted] == [1, 2]
    s.close()


def test_older_journal_format_is_dropped_not_refused(tmp_path):
    s = store(tmp_path)
    s.record_stored(chain(0, [1, 2]))
    s.close()
    s = SsdStore([str(tmp_path / "a"), str(tmp_path / "b")], 64, BB, FP)
    s.fingerprint["journal"] = -1  # as if written by another journal format
    report = s.adopt(lambda entries: [e.checksum for e in entries])
    assert report.adopted == [] and report.mismatched == 2
    s.close()


def test_journal_is_compacted(tmp_path):
    s = store(tmp_path, n=20000)
    s.record_stored(chain(0, list(range(1, 12001))))
    s.record_removed(range(10, 12000))
    lines = sum(1 for _ in open(tmp_path / "a" / JOURNAL))
    assert lines < 4 * 10 + 4096 + 2 + 1000  # rewritten once dead lines dominated
    s.close()
    s = store(tmp_path, n=20000)
    report = s.adopt(lambda entries: [e.checksum for e in entries])
    assert [e.block_id for e in report.adopted] == list(range(10)) and report.foreign == 0
    s.close()


def test_files_are_private(tmp_path):
    s = store(tmp_path)
    s.record_stored(chain(0, [1]))
    for d in ("a", "b"):
        assert oct(os.stat(tmp_path / d / "flexkv-blocks.kv").st_mode & 0o777) == "0o600"
    assert oct(os.stat(tmp_path / "a" / JOURNAL).st_mode & 0o777) == "0o600"
    s.close()


def test_a_directory_serves_one_manager_at_a_time(tmp_path):
    import pytest

    from dynamo_flexkv.core.storage.ssd import SsdInUseError

    first = store(tmp_path)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(SsdInUseError, match=f"is in use by pid {os.getpid()}: give each worker its own directory"):
        store(tmp_path)
    assert len(os.listdir("/proc/self/fd")) == fds  # the refused store left nothing open
    first.close()
    store(tmp_path).close()  # free again once the first closed


def test_concurrent_appends_evictions_and_compactions_replay_exactly(tmp_path):
    """Disk writes (transfer threads), removals (evictions under the index lock) and compactions
    race on one journal; replaying it afterwards gives exactly the blocks last recorded."""
    import threading

    import numpy as np

    n_threads, ops, per_thread = 4, 600, 40
    s = store(tmp_path, n=n_threads * per_thread)
    s.compact_slack = 32  # compact every few dozen dead lines
    live = [dict() for _ in range(n_threads)]
    errors = []

    def worker(w):
        rng = np.random.default_rng(w)
        try:
            for i in range(ops):
                b = w * per_thread + int(rng.integers(per_thread))
                if b in live[w] and rng.random() < 0.5:
                    s.record_removed([b])
                    del live[w][b]
                else:
                    h = (w << 32) | i  # unique hash, its own root
                    s.record_stored([DiskEntry(b, h, None, 1000 + h)])
                    live[w][b] = h
        except Exception as e:  # noqa: BLE001 - a worker thread's failure, reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s.close()
    s = store(tmp_path, n=n_threads * per_thread)
    report = s.adopt(lambda entries: [e.checksum for e in entries])
    want = {b: h for d in live for b, h in d.items()}
    assert {e.block_id: e.seq_hash for e in report.adopted} == want
    assert report.foreign == 0 and report.torn == 0
    s.close()
