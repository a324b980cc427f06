"""Property-based fuzzing (hypothesis) of everything that parses outside input: the config loader,
the SSD journal replay, the router event frames and the trace reader. Example counts are small so
the file runs in seconds; a failure prints the smallest input that breaks the property."""

import atexit
import json
import os
import shutil
import tempfile
import zlib

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_flexkv.core.config import CacheConfig, ConfigError
from dynamo_flexkv.core.storage.ssd import JOURNAL, DiskEntry, SsdStore

FAST = settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
# The only place fuzzed directories may point; in memory where possible (journals fsync).
SCRATCH = tempfile.mkdtemp(prefix="flexkv-fuzz-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
atexit.register(shutil.rmtree, SCRATCH, True)

# ---- config loader ------------------------------------------------------------------------------

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.sampled_from(["lru", "LFU", "slru", "bogus", "1", "0", "yes", "off", "16", "0.5", "1e400", "-3", "nan"]),
)
DIRS = st.sampled_from([f"{SCRATCH}/a", f"{SCRATCH}/a;{SCRATCH}/b", [f"{SCRATCH}/c"], "", 7, None])
KEYS = [f.name for f in __import__("dataclasses").fields(CacheConfig)]


def _config_or_error(make):
    """Either a valid config or a ConfigError naming a key: nothing else may escape."""
    try:
        cfg = make()
    except ConfigError as e:
        assert any(k in str(e) for k in KEYS + ["config"]), e
        return None
    assert isinstance(cfg, CacheConfig)
    assert cfg == CacheConfig.from_dict({k: getattr(cfg, k) for k in KEYS})  # values round-trip
    return cfg


@FAST
@given(st.dictionaries(st.sampled_from(KEYS + ["cpu_cache_gbb", "bogus"]), ANY_VALUE, max_size=6), DIRS)
def test_config_from_dict_and_constructor(values, dirs):
    values = dict(values, ssd_cache_dir=dirs) if "ssd_cache_dir" in values else values
    _config_or_error(lambda: CacheConfig.from_dict(values))
    if set(values) <= set(KEYS):
        _config_or_error(lambda: CacheConfig(**values))


@FAST
@given(
    st.dictionaries(
        st.sampled_from(
            [f"FLEXKV_{k.upper()}" for k in KEYS if k != "ssd_cache_dir"]
            + ["DYN_KVBM_CPU_CACHE_GB", "DYN_KVBM_DISK_CACHE_GB"]
        ),
        st.text(max_size=10),
        max_size=5,
    )
)
def test_config_from_environment(env):
    _config_or_error(lambda: CacheConfig.load(env=env))


@FAST
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_config_from_yaml_bytes(data):
    path = os.path.join(SCRATCH, "fuzz.yaml")
    with open(path, "wb") as f:
        f.write(data)
    _config_or_error(lambda: CacheConfig.load(path, env={}))


# ---- SSD journal replay ---------------------------------------------------------------------------

N_SLOTS = 32


def _checksum(slot, seq_hash, parent):
    # The bytes of a block depend on its whole prefix, so the same hash under another parent
    # (possible only in these generated histories) must read back as different bytes.
    return zlib.crc32(f"{slot}:{seq_hash}:{parent}".encode()) | (slot << 40)


def _write_journal(directory, history):
    """Replays ``history`` (("S", slot, hash, parent) / ("R", slot)) into a real journal; returns
    what each slot holds at the end (the 'disk')."""
    s = SsdStore([directory], N_SLOTS, 4096, {"model": "fuzz"}, direct=False)
    truth = {}
    for op in history:
        if op[0] == "S":
            _, slot, h, parent = op
            s.record_stored([DiskEntry(slot, h, parent, _checksum(slot, h, parent), b"\x01\x00\x00\x00" * 2)])
            truth[slot] = (h, parent)
        else:
            s.record_removed([op[1]])
            truth.pop(op[1], None)
    s.close()
    return truth


HISTORY = st.lists(
    st.one_of(
        st.tuples(
            st.just("S"),
            st.integers(0, N_SLOTS - 1),
            st.integers(1, 2**64 - 1),
            st.none() | st.none() | st.integers(1, 2**64 - 1),
        ),
        st.tuples(st.just("R"), st.integers(0, N_SLOTS - 1)),
    ),
    max_size=40,
)


def _replay(directory, truth):
    """Restart: every adopted block is exactly what its slot holds; nothing raises."""
    s = SsdStore([directory], N_SLOTS, 4096, {"model": "fuzz"}, direct=False)
    try:
        report = s.adopt(
            lambda entries: [_checksum(e.block_id, *truth[e.block_id]) if e.block_id in truth else 0 for e in entries]
        )
    finally:
        s.close()
    for e in report.adopted:
        assert (e.seq_hash, e.parent) == truth[e.block_id], f"slot {e.block_id} adopted as another block"
    return report


@FAST
@given(HISTORY, st.data())
def test_journal_replay_after_truncation(history, data):
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        truth = _write_journal(d, history)
        path = os.path.join(d, JOURNAL)
        if not os.path.exists(path):  # nothing was ever recorded
            return
        raw = open(path, "rb").read()
        cut = data.draw(st.integers(0, len(raw)), label="truncate at")
        with open(path, "wb") as f:
            f.write(raw[:cut])
        report = _replay(d, truth)
        if cut == len(raw):  # intact: every root block (a hash held once) comes back
            hashes = [h for h, _ in truth.values()]
            roots = {b for b, (h, p) in truth.items() if p is None and hashes.count(h) == 1}
            assert roots <= {e.block_id for e in report.adopted}


@FAST
@given(HISTORY.filter(lambda h: any(op[0] == "S" for op in h)), st.data())
def test_journal_replay_after_bit_flips(history, data):
    """A flipped bit in a record must never turn it into another block (a hash digit stays a valid
    hex digit after most flips; only the line's CRC tells)."""
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        truth = _write_journal(d, history)
        path = os.path.join(d, JOURNAL)
        damaged = bytearray(open(path, "rb").read())
        starts = [i + 1 for i, c in enumerate(damaged) if c == ord("\n")][:-1]  # record lines, not the header
        if not starts:
            return
        for _ in range(data.draw(st.integers(1, 3), label="flips")):
            line = data.draw(st.sampled_from(starts), label="line")
            end = damaged.index(b"\n", line)
            pos = data.draw(st.integers(line, end - 1), label="byte")
            damaged[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        with open(path, "wb") as f:
            f.write(bytes(damaged))
        _replay(d, truth)


@FAST
@given(st.binary(max_size=400))
def test_journal_replay_of_random_bytes(raw):
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        SsdStore([d], N_SLOTS, 4096, {"model": "fuzz"}, direct=False).close()
        header = json.dumps({"fingerprint": {"model": "fuzz", "block_bytes": 4096, "journal": 2}}, sort_keys=True)
        with open(os.path.join(d, JOURNAL), "wb") as f:
            f.write(header.encode() + b"\n" + raw)
        assert _replay(d, {}).adopted == []


# ---- router event frames --------------------------------------------------------------------------


def _signed(h):
    return h - (1 << 64) if h >= (1 << 63) else h


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_event_frames_decode_to_what_was_published(data):
    from dynamo_flexkv.core.index import Tier
    from dynamo_flexkv.integrations.events import KvEventRelay

    bs = data.draw(st.sampled_from([1, 4, 16]), label="block size")
    relay = KvEventRelay(bs, flush_interval=0.001)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(relay.endpoint)
    try:
        assert relay.wait_for_subscriber(10)
        known = {t: [] for t in (None, Tier.HOST, Tier.DISK)}
        want = []  # per block: (type, medium, hash, parent, tokens)
        for _ in range(data.draw(st.integers(1, 12), label="calls")):
            tier = data.draw(st.sampled_from(list(known)), label="tier")
            medium = {None: None, Tier.HOST: "CPU_PINNED", Tier.DISK: "DISK"}[tier]
            if known[tier] and data.draw(st.booleans(), label="remove"):
                gone = data.draw(st.lists(st.sampled_from(known[tier]), min_size=1, max_size=3, unique=True))
                relay.removed(tier, gone)
                for h in gone:
                    known[tier].remove(h)
                    want.append(("R", medium, _signed(h), None, None))
                continue
            parent = data.draw(st.none() | st.sampled_from(known[tier]) if known[tier] else st.none(), label="parent")
            hashes = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4, unique=True), label="hashes")
            if any(h in known[tier] or h == parent for h in hashes):
                continue
            tokens = data.draw(
                st.lists(st.integers(0, 2**32 - 1), min_size=bs * len(hashes), max_size=bs * len(hashes))
            )
            relay.stored(tier, hashes, parent, tokens)
            prev = parent
            for i, h in enumerate(hashes):
                want.append(
                    ("S", medium, _signed(h), None if prev is None else _signed(prev), tokens[i * bs : (i + 1) * bs])
                )
                prev = h
            known[tier].extend(hashes)
        relay.close()
        got, seq = [], 0
        while len(got) < len(want):
            topic, seq_bytes, payload = sub.recv_multipart()
            assert int.from_bytes(seq_bytes, "big") == seq
            seq += 1
            ts, events, dp_rank = msgspec.msgpack.decode(payload)
            assert dp_rank == 0 and isinstance(ts, float)
            for ev in events:
                if ev["type"] == "BlockRemoved":
                    got += [("R", ev.get("medium"), h, None, None) for h in ev["block_hashes"]]
                else:
                    assert ev["type"] == "BlockStored" and ev["block_size"] == bs
                    prev = ev["parent_block_hash"]
                    for i, h in enumerate(ev["block_hashes"]):
                        got.append(("S", ev.get("medium"), h, prev, ev["token_ids"][i * bs : (i + 1) * bs]))
                        prev = h
        assert got == want
    finally:
        sub.close(linger=0)


# ---- trace parsing -------------------------------------------------------------------------------

# What load_trace promises: a line is a record whose timestamp, input_length and output_length are
# numbers and whose hash_ids is a list of numbers (each read as int()); any other line, an infinite
# or NaN number included (JSON's Infinity / NaN), is refused with a ValueError naming the file and
# that line. Lines are made good or bad by construction, so the property knows which outcome is right.
TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
NUMBER = st.integers(-(10**30), 10**30) | st.floats(allow_nan=False, allow_infinity=False)
NOT_A_NUMBER = st.sampled_from([float("inf"), float("-inf"), float("nan"), None, [], [1], "", "x", "1.5", "1e400"])
NOT_A_LIST = st.sampled_from([float("inf"), float("nan"), None, 5, 1.5])  # "" would iterate as no hashes
GOOD_RECORD = st.fixed_dictionaries(
    {
        "timestamp": NUMBER,
        "input_length": NUMBER,
        "output_length": NUMBER,
        "hash_ids": st.lists(NUMBER, max_size=4),
    }
)


@st.composite
def bad_line(draw) -> str:
    r = draw(GOOD_RECORD)
    how = draw(st.sampled_from(["number", "hash", "hashes", "missing", "not a record", "not json"]))
    if how == "number":
        r[draw(st.sampled_from(TRACE_FIELDS[:3]))] = draw(NOT_A_NUMBER)
    elif how == "hash":
        r["hash_ids"].insert(draw(st.integers(0, len(r["hash_ids"]))), draw(NOT_A_NUMBER))
    elif how == "hashes":
        r["hash_ids"] = draw(NOT_A_LIST)
    elif how == "missing":
        del r[draw(st.sampled_from(TRACE_FIELDS))]
    elif how == "not a record":
        return json.dumps(draw(ANY_VALUE))  # null, a number (Infinity too), a string, a list
    else:
        return "{not json"
    return json.dumps(r)


@FAST
@given(st.lists(GOOD_RECORD.map(lambda r: (True, r)) | bad_line().map(lambda x: (False, x)), min_size=1, max_size=5))
def test_trace_reader_loads_every_record_or_names_the_first_bad_line(lines):
    from dynamo_flexkv.workload import load_trace

    path = os.path.join(SCRATCH, "fuzz-trace.jsonl")
    with open(path, "w") as f:
        for good, line in lines:
            f.write((json.dumps(line) if good else line) + "\n")
    first_bad = next((n for n, (good, _) in enumerate(lines, 1) if not good), None)
    if first_bad is not None:
        with pytest.raises(ValueError) as refused:
            load_trace(path)
        assert str(refused.value).startswith(f"{path}:{first_bad}: not a trace record ("), refused.value
        assert str(refused.value).endswith("expected timestamp, input_length, output_length, hash_ids"), refused.value
        return
    got = [(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in load_trace(path)]
    assert got == [
        (int(r["timestamp"]), int(r["input_length"]), int(r["output_length"]), tuple(int(h) for h in r["hash_ids"]))
        for _, r in lines
    ]


def test_trace_reader_names_the_line_of_an_infinite_number(tmp_path):
    """An infinite timestamp is refused, naming the file and line, and why."""
    from dynamo_flexkv.workload import load_trace

    path = tmp_path / "trace.jsonl"
    good = {"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, timestamp=float("inf"))) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: not a trace record \(cannot convert float infinity"):
        load_trace(str(path))
