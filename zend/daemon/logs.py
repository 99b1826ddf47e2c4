"""Structured logs: one JSON object per line (or plain text), with the event's fields."""

from __future__ import annotations

import json
import logging
import time

STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(event_fields(record))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def event_fields(record: logging.LogRecord) -> dict[str, object]:
    """What the call site passed in `extra`: the event's fields (code, error, job, ...)."""
    return {k: v for k, v in vars(record).items() if k not in STANDARD}


class TextFormatter(logging.Formatter):
    """A line for people: time, level, logger, message, then the event's fields as key=value
    (a "step failed" without its code and error says nothing)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = " ".join(f"{k}={_text_value(v)}" for k, v in event_fields(record).items())
        if not fields:
            return line
        head, newline, rest = line.partition("\n")  # a traceback stays below the fields
        return f"{head} {fields}{newline}{rest}"


def _text_value(value: object) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c.isspace() or c in "\"=" for c in text) else text


def setup_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
