"""One log format for every process of a run: time, process, level, message.

Entry points call ``setup_logging`` once (the simulated processes in diloco.sim.child, the
CLIs) and pass the ``ProcessLog`` it returns wherever the library takes a ``log(message)``
callable. Text lines look like::

    2026-12-04T21:40:01.123Z [site 2] INFO site 2 round 3 done: train_loss=2.1034 global 1f0c…

and with ``logging.json=true`` each record is one JSON object on its own line::

    {"time": "2026-12-04T21:40:01.123Z", "process": "site 2", "level": "INFO", "message": "..."}

Times are UTC with milliseconds. A message of several lines (a traceback) stays one record:
in text its lines follow the first; in JSON it is one string. Uncaught exceptions (main and
other threads) and Python warnings go through the same handler, so a JSON log holds nothing
but JSON lines unless something writes to stdout or stderr past the logging module.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, TextIO

from diloco.fields import setting

Log = Callable[[str], None]

# A text line: time, [process], level, message (the first line of a multi-line message).
LINE = re.compile(r"^(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) \[(?P<process>.+?)\] (?P<level>[A-Z]+) (?P<message>.*)$")
FIELDS = ("time", "process", "level", "message")


@dataclass(frozen=True)
class LoggingConfig:
    """The ``logging`` section of a run: every process's log lines (stdout; diloco-sim:
    <run dir>/logs/<process>.log)."""

    json: bool = setting(
        False, doc='false: text lines "<time> [<process>] LEVEL message"; true: one JSON object per line {time, process, level, message}, for log collectors'
    )

    def __post_init__(self) -> None:
        if not isinstance(self.json, bool):
            raise ValueError(f"logging.json={self.json!r}: must be true or false")


def _time(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(record.msecs):03d}Z"


def _message(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    """The record's message with its exception and stack, if any, below it."""
    message = record.getMessage()
    if record.exc_info:
        message += "\n" + formatter.formatException(record.exc_info)
    if record.stack_info:
        message += "\n" + formatter.formatStack(record.stack_info)
    return message.rstrip("\n")


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{_time(record)} [{getattr(record, 'process_name', '?')}] {record.levelname} {_message(self, record)}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {"time": _time(record), "process": getattr(record, "process_name", "?"), "level": record.levelname, "message": _message(self, record)}
        return json.dumps(fields, ensure_ascii=False)


class _ProcessName(logging.Filter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def filter(self, record: logging.LogRecord) -> bool:
        record.process_name = self.process
        return True


class ProcessLog:
    """A ``log(message)`` callable that logs at INFO through the logging module (what the
    library's ``log=`` parameters take); ``at(level, message)`` logs at another level."""

    def __init__(self, name: str = "diloco") -> None:
        self.logger = logging.getLogger(name)

    def __call__(self, message: str) -> None:
        self.logger.info(message)

    def at(self, level: int, message: str) -> None:
        self.logger.log(level, message)


def log_at(log: Log, level: int, message: str) -> None:
    """``message`` at ``level`` through a ProcessLog; any other ``log`` callable (print, a
    list's append) just gets the message."""
    at = getattr(log, "at", None)
    if callable(at):
        at(level, message)
    else:
        log(message)


_HANDLER_MARK = "_diloco_handler"


def setup_logging(process: str, *, json: bool = False, stream: TextIO | None = None, level: int = logging.INFO) -> ProcessLog:
    """Sends every log record of this process (the root logger: ours, the libraries', Python's
    warnings, uncaught exceptions) to ``stream`` (default stdout) in the one format, naming
    ``process``; replaces the handlers set before (hydra's among them). Returns the log
    callable to pass on."""
    if not process or "\n" in process:
        raise ValueError(f"process name {process!r}: must be non-empty, on one line")
    handler = logging.StreamHandler(stream if stream is not None else sys.stdout)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    handler.addFilter(_ProcessName(process))
    setattr(handler, _HANDLER_MARK, True)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        if getattr(old, _HANDLER_MARK, False):
            old.close()
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread
    return ProcessLog()


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    logging.getLogger("diloco").critical("uncaught exception", exc_info=(kind, value, tb))


def _log_uncaught_in_thread(args: Any) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("diloco").critical(f"uncaught exception in thread {name}", exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def parse_line(line: str) -> dict[str, str] | None:
    """A log line as {time, process, level, message}: a JSON line or a text line's first
    line; None for anything else (a traceback's continuation, output past the logging module)."""
    line = line.rstrip("\n")
    if line.startswith("{"):
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            return None
        return {k: d[k] for k in FIELDS} if isinstance(d, dict) and set(FIELDS) <= set(d) else None
    m = LINE.match(line)
    return m.groupdict() if m else None
