"""serve's quiet console (dynamo_flexkv/serve/logs.py): which component lines it shows, on lines
as serve's components write them (Dynamo's Rust tracing and the Python records it bridges, vLLM,
the cache server, etcd, NATS, redis-server), and the plain text the log files get."""

import threading

from dynamo_flexkv.serve.logs import ERROR, INFO, WARN, Console, ConsoleFilter, classify, plain

RUST_INFO = "2026-12-07T12:58:53.313105Z  INFO dynamo_runtime::distributed: Initializing KV store discovery backend"
RUST_WARN = "2026-12-07T12:58:53.353612Z  WARN mm_routing: /tmp/x/model is not supported for MM-aware KV routing"
RUST_ERROR = "2026-12-07T12:58:56.287168Z ERROR dynamo_runtime::component::client: monitor_instance_source: closed"
OURS = "2026-12-07T13:20:16.803317Z  INFO dynamo_flexkv.core.storage.ssd.adopt: disk tier: adopted 0 blocks"
BRIDGED = "2026-12-07T13:09:48.749621Z  INFO main.setup_vllm_engine: worker for vllm-small has been initialized"
VLLM_INFO = "(EngineCore pid=2116) INFO 12-07 13:09:20 [core.py:129] Initializing a V1 LLM engine (v0.31.0)"
VLLM_WARN = "(Worker pid=2872) WARNING 12-07 13:09:46 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD."
CACHE_SERVER = "2026-12-07 13:00:00,123 INFO dynamo_flexkv.core.node.server: node cache: listening on /run/x.sock"
NATS = "[123] 2026/12/07 13:00:00.123456 [WRN] Plaintext passwords detected"
REDIS = "123:M 07 Dec 2026 13:00:00.123 * Ready to accept connections tcp"
ETCD = "2026-12-07 13:00:00.123456 I | etcdmain: etcd Version: 3.4.23"


def test_each_format_is_read_with_its_level_and_whose_it_is():
    assert classify(RUST_INFO) == (INFO, False)
    assert classify(RUST_WARN) == (WARN, False)
    assert classify(RUST_ERROR) == (ERROR, False)
    assert classify(OURS) == (INFO, True)
    assert classify(BRIDGED) == (INFO, False)
    assert classify(VLLM_INFO) == (INFO, False)
    assert classify(VLLM_WARN) == (WARN, False)
    assert classify(CACHE_SERVER) == (INFO, True)
    assert classify(NATS) == (WARN, False)
    assert classify(REDIS) == (INFO, False)
    assert classify(ETCD) == (INFO, False)
    assert classify("Traceback (most recent call last):") == (ERROR, False)
    assert classify("/x/dispatcher.py:138: FutureWarning: `reduce_op` is deprecated") == (WARN, False)
    assert classify('  File "/x/core.py", line 1, in main') is None  # a continuation line


def test_quiet_shows_warnings_errors_and_our_lines_with_what_follows_them():
    lines = [
        ("banner before any record", True),
        (RUST_INFO, False),
        ("  a continuation of that INFO record", False),
        (RUST_WARN, True),
        (OURS, True),
        (VLLM_INFO, False),
        ("Traceback (most recent call last):", True),
        ('  File "/x/core.py", line 1, in main', True),
        ("RuntimeError: Engine core initialization failed", True),
        (BRIDGED, False),
        (RUST_ERROR, True),
    ]
    quiet = ConsoleFilter(Console.QUIET)
    assert [(ln, quiet.show(ln)) for ln, _ in lines] == lines
    every = ConsoleFilter(Console.ALL)
    assert all(every.show(ln) for ln, _ in lines)


def test_log_lines_lose_their_terminal_escape_codes():
    coloured = "\x1b[2m2026-12-07T12:58:53.313105Z\x1b[0m \x1b[32m INFO\x1b[0m \x1b[2mdynamo_runtime::worker\x1b[0m: hi"
    assert plain(coloured) == "2026-12-07T12:58:53.313105Z  INFO dynamo_runtime::worker: hi"
    assert classify(plain(coloured)) == (INFO, False)
    assert plain("no codes") == "no codes"


# Dynamo's benign ERROR races of a stop, as the frontend wrote them (serve/logs.py STOP_RACES).
STOP_MONITOR = (
    "2026-12-07T15:52:59.381690Z ERROR dynamo_runtime::component::client: monitor_instance_source: "
    "The Sender is dropped: channel closed, endpoint=dynamo/flexkv/generate"
)
STOP_FILE_WATCH = (
    "2026-12-07T11:50:55.869625Z ERROR dynamo_runtime::storage::kv::file: Failed to send file watch event "
    "error=channel closed"
)
STOP_BROKER = (
    "2026-12-07T15:52:42.592255Z ERROR dynamo_llm::kv_router::indexer::recovery::broker_zmq: Brokered KV "
    "membership task ended unexpectedly kv_state_endpoint=dynamo/flexkv/generate"
)
OTHER_ERROR = (
    "2026-12-07T15:52:59.381690Z ERROR dynamo_runtime::component::client: endpoint_watcher: discovery stream "
    "error: broken; shutting down"
)


def test_dynamo_stop_races_are_hidden_only_while_serve_stops():
    stopping = threading.Event()
    quiet = ConsoleFilter(Console.QUIET, stopping)
    races = (STOP_MONITOR, STOP_FILE_WATCH, STOP_BROKER)
    assert all(quiet.show(ln) for ln in races)  # while the graph runs, an error like any other
    stopping.set()
    assert not any(quiet.show(ln) for ln in races)
    assert not quiet.show("  a continuation of that record")
    assert quiet.show(OTHER_ERROR)  # any other ERROR line stays shown at a stop
    assert quiet.show(RUST_WARN)
    assert quiet.show(STOP_MONITOR.replace(" ERROR ", "  WARN "))  # the exact ERROR line only
    every = ConsoleFilter(Console.ALL, stopping)
    assert all(every.show(ln) for ln in races)  # --console all shows every line
