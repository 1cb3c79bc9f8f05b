"""Structured logs (``observability.logs``).

``format: json``: every log record is one JSON object per line — ``ts`` (UTC, ISO 8601),
``level``, ``logger``, ``msg`` and the request fields a record carries. Exceptions were already
reduced to their type and place by gateway.log_safety.RedactExceptions (on every handler), so no
exception text reaches a line.

``request_lines: true``: ``RequestLog`` writes one line per finished HTTP request on the
``tiergate.request`` logger (INFO): ``request_id``, ``tenant_id``, ``method``, ``route`` (the
template, never the path with its ids), ``status``, ``latency_ms``, ``tier`` and ``model`` when the
request was routed. Nothing else: never a key, a header, a prompt or an answer.

Imports the standard library and orjson only.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import orjson

REQUEST_FIELDS = ("request_id", "tenant_id", "method", "route", "status", "latency_ms", "tier", "model")
REQUEST_LOGGER = "tiergate.request"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        for name in REQUEST_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        return orjson.dumps(out).decode()


class RequestLog:
    """One line per finished request (called by gateway.web.observe.Observer)."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(REQUEST_LOGGER)

    def write(self, scope: dict[str, Any], route: str, tier: str, model: str, status: int, seconds: float,
              request: Any = None) -> None:
        if not self.logger.isEnabledFor(logging.INFO):
            return
        fields: dict[str, Any] = {"method": scope.get("method"), "route": route, "status": status,
                                  "latency_ms": round(seconds * 1000, 3)}
        if request is not None:  # a routed request (gateway.chat.request.ChatRequest)
            fields.update(request_id=request.request_id, tenant_id=request.tenant_id, tier=tier, model=model)
        self.logger.info("%s %s %d %.1f ms", fields["method"], route, status, fields["latency_ms"], extra=fields)
