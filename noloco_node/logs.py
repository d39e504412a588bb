"""Logging for every command: human-readable lines by default, JSON lines with ``--log-format json``.

JSON lines carry time, level, logger, message and, for errors, the traceback, one object per line, so a log
shipper can index them. hivemind installs its own handler on its loggers (and prints WARN for WARNING); those
records are routed through ours instead, so one format holds for the whole process.

Secrets never reach a log line: :func:`redact` registers a value (the swarm secret), and every handler's output,
traceback included, has it replaced by ``[secret]`` after formatting, whatever logger or library wrote it.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Literal

LogFormat = Literal["text", "json"]
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LEVEL_NAMES = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR"}
_LEVEL_NAMES[logging.CRITICAL] = "CRITICAL"


class JsonLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds"),
            # The standard names, whatever a library renamed them to (hivemind prints WARN for WARNING).
            "level": _LEVEL_NAMES.get(record.levelno, record.levelname),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


_SECRETS: list[str] = []


def redact(value: str) -> None:
    """From now on, replace ``value`` by ``[secret]`` in every log line."""
    if value and value not in _SECRETS:
        _SECRETS.append(value)


def scrub(text: str) -> str:
    for value in _SECRETS:
        text = text.replace(value, "[secret]")
    return text


class _Redacting(logging.Formatter):
    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return scrub(self.inner.format(record))


def configure_logging(level: str, log_format: LogFormat) -> None:
    handler = logging.StreamHandler(sys.stderr)
    inner = JsonLineFormatter() if log_format == "json" else logging.Formatter(_TEXT_FORMAT)
    handler.setFormatter(_Redacting(inner))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    _route_hivemind_logs()


def _route_hivemind_logs() -> None:
    try:
        from hivemind.utils import logging as hivemind_logging
    except ImportError:  # commands that never touch the DHT still work without hivemind importable
        return
    # "nowhere": hivemind drops its own handler and propagates its records to the root logger, i.e. ours.
    hivemind_logging.use_hivemind_log_handler("nowhere")
