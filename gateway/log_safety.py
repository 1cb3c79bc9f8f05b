"""What an exception may say in a log: its type and where it happened (module:line), never its
text. A database error's text quotes the SQL parameters (file names, uploaded bytes, prompts),
and a client's malformed input ends up in many exception messages, so neither may reach a log.

``describe(exc)`` is the one-line form every gateway log call uses instead of ``exc_info``;
``RedactExceptions`` is a logging filter that rewrites any record that still carries an
exception (from a library, or code that logs ``exc_info``) into that form — ``tiergate
serve`` puts it on every handler (``log_config``). Pure: the standard library only.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

OWN_PACKAGES = ("gateway.", "classifier.", "engine.")


def _frames(tb: TracebackType | None) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    while tb is not None:
        out.append((str(tb.tb_frame.f_globals.get("__name__", "?")), tb.tb_lineno))
        tb = tb.tb_next
    return out


def describe(exc: BaseException) -> str:
    """``"OperationalError at gateway.jobs.files:45 (raised in sqlalchemy.engine.default:951)"``:
    the type, the innermost frame in tiergate's own code and the frame that raised it."""
    frames = _frames(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    ours = [f for f in frames if f[0].startswith(OWN_PACKAGES)]
    raised = frames[-1]
    where = ours[-1] if ours else raised
    text = f"{type(exc).__name__} at {where[0]}:{where[1]}"
    if where != raised:
        text += f" (raised in {raised[0]}:{raised[1]})"
    return text


class RedactExceptions(logging.Filter):
    """Replaces a record's exception (and stack) by ``describe`` of it, appended to the message."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None or record.exc_text or record.stack_info:
            message = record.getMessage()
            if exc is not None:
                message = f"{message} [{describe(exc)}]"
            record.msg, record.args = message, None
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def log_config(level: str = "info", fmt: str = "text") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for uvicorn (``log_config=``): uvicorn's formats (or, with
    ``fmt="json"``, one JSON object per line: gateway.telemetry.logs.JsonFormatter), the root
    logger on stderr too (tiergate's own loggers at ``level``, libraries at warning), every
    handler redacting exceptions."""
    redact = {"()": f"{__name__}.RedactExceptions"}
    formatters: dict[str, Any] = {
        "default": {"()": "uvicorn.logging.DefaultFormatter", "fmt": "%(levelprefix)s %(name)s: %(message)s",
                    "use_colors": None},
        "access": {"()": "uvicorn.logging.AccessFormatter",
                   "fmt": '%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'},
    }
    if fmt == "json":
        json_formatter = {"()": "gateway.telemetry.logs.JsonFormatter"}
        formatters = {"default": json_formatter, "access": json_formatter}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"redact": redact},
        "formatters": formatters,
        "handlers": {
            "default": {"class": "logging.StreamHandler", "formatter": "default", "filters": ["redact"],
                        "stream": "ext://sys.stderr"},
            "access": {"class": "logging.StreamHandler", "formatter": "access", "filters": ["redact"],
                       "stream": "ext://sys.stdout"},
        },
        "root": {"handlers": ["default"], "level": "WARNING"},
        "loggers": {
            **{name: {"level": level.upper()} for name in ("tiergate", "gateway", "classifier", "engine")},
            "uvicorn": {"level": level.upper()},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": ["access"], "level": "INFO", "propagate": False},
        },
    }
