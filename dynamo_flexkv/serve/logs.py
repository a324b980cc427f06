"""What serve does with its components' output: the environment that keeps it plain text, the
log files (every line, no terminal colour codes) and the console (``--console``: every line, or
quiet: serve's own lines, the components' warnings and errors, and this package's own lines).

A component's line is classified by the level its logger wrote into it. The formats serve's
components write: Dynamo's Rust tracing (``2026-01-01T00:00:00.000000Z  WARN target: message``,
which also carries the Python records Dynamo bridges), Python's logging as the cache server and
vLLM write it (``... INFO name: message``, ``(EngineCore pid=1) WARNING 01-01 00:00:00 [file.py:1]
message``), etcd, NATS and redis-server. A line with no level of its own (a traceback's frames,
a multi-line message) belongs to the record above it; one that starts a Python traceback or
warning is an error or warning itself; a line before any record is shown."""

from __future__ import annotations

import re
import threading
from enum import Enum

# Set for every component serve starts (and every rendered Dynamo pod). DYN_SDK_DISABLE_ANSI_LOGGING:
# Dynamo's Rust tracing writes colour codes into a pipe unless told not to (NO_COLOR is not read).
# DYN_SKIP_SGLANG_LOG_FORMATTING: Dynamo's logging setup otherwise writes an SGLang logging config
# to a temp file it never removes, once per process (none of serve's components runs SGLang).
COMPONENT_LOG_ENV = {"DYN_SDK_DISABLE_ANSI_LOGGING": "1", "DYN_SKIP_SGLANG_LOG_FORMATTING": "1"}

# The logger names (Dynamo's tracing target, for records of this package) that mark our own lines.
OUR_TARGET = "dynamo_flexkv"

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def plain(line: str) -> str:
    """``line`` without terminal escape sequences: Dynamo's vLLM log formatter colours its lines
    whatever the environment says (dynamo.runtime.logging.VllmColorFormatter)."""
    return _ANSI.sub("", line) if "\x1b" in line else line


class Console(Enum):
    """``serve --console``: what the terminal shows of the components' logs (the files get all)."""

    QUIET = "quiet"
    ALL = "all"


# Ordered: a line's level is its index; QUIET shows WARN and above.
DEBUG, INFO, WARN, ERROR = range(4)
_LEVELS = {
    "TRACE": DEBUG,
    "DEBUG": DEBUG,
    "DBG": DEBUG,
    "TRC": DEBUG,
    "INFO": INFO,
    "INF": INFO,
    "NOTICE": INFO,
    "WARN": WARN,
    "WARNING": WARN,
    "WRN": WARN,
    "ERROR": ERROR,
    "ERR": ERROR,
    "CRITICAL": ERROR,
    "FATAL": ERROR,
    "FTL": ERROR,
}
_ETCD = {"D": DEBUG, "I": INFO, "N": INFO, "W": WARN, "E": ERROR, "C": ERROR}
_REDIS = {".": DEBUG, "-": DEBUG, "*": INFO, "#": WARN}
_FORMATS = (
    # Dynamo (Rust tracing, and the Python records it bridges): 2026-...Z  INFO target: message
    re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z\s+(?P<level>[A-Z]+) (?P<target>[^\s:]+(?:::[^\s:]+)*):"),
    # Python logging with the logger's name (the cache server): 2026-01-01 00:00:00,000 INFO name: message
    re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ (?P<level>[A-Z]+) (?P<target>[\w.]+):"),
    # vLLM, in each of its processes: (EngineCore pid=1) WARNING 01-01 00:00:00 [file.py:1] message
    re.compile(r"^(?:\([^)]*\) )?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:]+ \["),
    # nats-server: [123] 2026/01/01 00:00:00.000000 [INF] message
    re.compile(r"^\[\d+\] [\d/]+ [\d:.]+ \[(?P<level>[A-Z]{3})\]"),
)
_ETCD_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:.]+ (?P<level>[DINWEC]) \|")
_ETCD_JSON = re.compile(r'^\{"level":"(?P<level>\w+)"')
_REDIS_LINE = re.compile(r"^\d+:[XCSM] \d+ \w+ \d+ [\d:.]+ (?P<level>[.\-*#]) ")
# A line that starts its own error or warning without a logger: an uncaught exception, Python's
# warnings module (``file.py:1: FutureWarning: ...``).
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):|^\w+(?:\.\w+)*(?:Error|Exception): ")
_PY_WARNING = re.compile(r"\b[A-Z]\w*Warning: ")


def classify(line: str) -> tuple[int, bool] | None:
    """(level, ours) of a line that starts a record, None for a continuation line."""
    for pattern in _FORMATS:
        m = pattern.match(line)
        if m:
            target = m.groupdict().get("target") or ""
            return _LEVELS.get(m.group("level").upper(), INFO), target.startswith(OUR_TARGET)
    m = _ETCD_LINE.match(line) or _ETCD_JSON.match(line)
    if m:
        level = m.group("level")
        return (_ETCD.get(level) if len(level) == 1 else _LEVELS.get(level.upper(), INFO)) or INFO, False
    m = _REDIS_LINE.match(line)
    if m:
        return _REDIS[m.group("level")], False
    if _TRACEBACK.match(line):
        return ERROR, False
    if _PY_WARNING.search(line):
        return WARN, False
    return None


# ERROR lines Dynamo's frontend logs while serve stops a healthy graph, each a benign race in Dynamo
# 1.6.1 (measured: 6 of 8 stops of agg_router with serve's order, each kind below seen; 4 of 4 with
# the frontend stopped before its workers' model went). When the frontend drops a model (its workers' discovery entries
# went) or shuts down, it cancels the tasks of the model's router together with what feeds them:
#  - dynamo_runtime::component::client's monitor_instance_source waits in a tokio::select! on its
#    cancellation token and on its discovery feed; both become ready at once and select! picks one
#    at random: the feed's branch logs "The Sender is dropped: channel closed" at ERROR (then
#    cancels itself). A feed that really fails logs its own ERROR first (endpoint_watcher:
#    discovery stream error), which stays shown.
#  - storage::kv::file's watcher callback sends a file event into a watch stream just dropped.
#  - the KV router's brokered membership task (KV events over the broker) ends with its router.
# No stop order avoids them (the frontend must drop the model, or shut down, with its router), and
# nothing is lost: the workers have drained and exited. While serve stops (and only then) the quiet
# console shows these exact lines no more than an INFO line; the log files keep every line.
STOP_RACES = (
    ("dynamo_runtime::component::client", "monitor_instance_source: The Sender is dropped: channel closed"),
    ("dynamo_runtime::storage::kv::file", "Failed to send file watch event error=channel closed"),
    ("dynamo_llm::kv_router::indexer::recovery::broker_zmq", "Brokered KV membership task ended unexpectedly"),
)
_STOP_RACE_LINES = tuple(re.compile(rf"\sERROR {re.escape(target)}: {re.escape(text)}") for target, text in STOP_RACES)


def stop_race(line: str) -> bool:
    """Whether ``line`` is one of Dynamo's ERROR lines of a healthy stop (STOP_RACES)."""
    return any(p.search(line) for p in _STOP_RACE_LINES)


class ConsoleFilter:
    """Whether each line of one component's output reaches the console (one per component: a
    continuation line follows the record of its own component). ``stopping``: set once serve
    began to stop the graph; from then on the lines of STOP_RACES count as INFO."""

    def __init__(self, console: Console, stopping: threading.Event | None = None) -> None:
        self.console = console
        self.stopping = stopping
        self._showing = True  # lines before the first record are shown

    def show(self, line: str) -> bool:
        if self.console is Console.ALL:
            return True
        found = classify(line)
        if found is not None:
            level, ours = found
            if level == ERROR and self.stopping is not None and self.stopping.is_set() and stop_race(line):
                level = INFO
            self._showing = ours or level >= WARN
        return self._showing
