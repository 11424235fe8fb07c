"""Structured JSON logs on stderr for the service's own loggers.

The ``umbra`` logger tree is configured, and so are the trees of the
libraries that log while the service runs: uvicorn's (a malformed request, a
port already taken), psycopg's (the pool's warnings while the database is
away) and asyncio's (a task's unretrieved exception). Their lines would
otherwise be plain text between the JSON ones, some spread over several
lines, just when an operator's log shipper most needs to read them. Records
carry literal keys passed through ``extra=``; secrets are never passed there
(tests capture a full pair/claim cycle to prove it).
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


#: Logger trees written as JSON on stderr. uvicorn sets its own loggers' levels (``log_level``); the
#: libraries' others keep the default (warnings and errors).
JSON_LOGGERS = ("umbra", "uvicorn", "psycopg", "asyncio")


def configure_logging(level: str = "INFO") -> None:
    for name in JSON_LOGGERS:
        logger = logging.getLogger(name)
        if name == "umbra":
            logger.setLevel(level)
        if any(getattr(h, "_umbra", False) for h in logger.handlers):
            continue
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        handler._umbra = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
