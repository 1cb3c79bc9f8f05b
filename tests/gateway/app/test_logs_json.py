"""Structured logs: with ``observability.logs.request_lines`` one line per finished request
carries its id, tenant, route, tier, model, status and latency — never the key or the prompt —
and ``format: json`` renders every record as one JSON object (exception text redacted)."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest

from gateway.log_safety import RedactExceptions, log_config
from gateway.telemetry.logs import REQUEST_LOGGER, JsonFormatter
from tests.gateway.app.observe_support import app_with
from tests.gateway.scripted_upstream import ScriptedUpstream

PROMPT = "my very private prompt"
LINES = {"observability": {"logs": {"format": "json", "request_lines": True}, "metrics": {"enabled": False}}}


async def test_one_json_line_per_request_without_secrets(tmp_path: Path, upstream: ScriptedUpstream,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    async with app_with(tmp_path, upstream, **LINES) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "tier-low", "messages": [{"role": "user", "content": PROMPT}]})
        assert r.status_code == 200
        bad = await gw.client.post("/v1/messages", headers={"x-api-key": "tg-wrong-key-0123456789"},
                                   json={"model": "low", "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]})
        assert bad.status_code == 401
    fmt = JsonFormatter()
    lines = [orjson.loads(fmt.format(rec)) for rec in caplog.records if rec.name == REQUEST_LOGGER]
    assert len(lines) == 2
    ok, refused = lines
    assert ok["request_id"] == r.json()["id"] and ok["tenant_id"] == gw.tenant_id
    assert (ok["method"], ok["route"], ok["status"], ok["tier"], ok["model"]) == (
        "POST", "/v1/chat/completions", 200, "low", "up-a")
    assert ok["latency_ms"] > 0 and ok["level"] == "info" and ok["ts"].endswith("Z")
    assert (refused["route"], refused["status"]) == ("/v1/messages", 401) and "request_id" not in refused
    text = " ".join(fmt.format(rec) for rec in caplog.records)
    assert PROMPT not in text and gw.key not in text and "tg-wrong-key" not in text


def test_json_config_and_redacted_exceptions() -> None:
    cfg = log_config("info", "json")
    assert {f["()"] for f in cfg["formatters"].values()} == {"gateway.telemetry.logs.JsonFormatter"}
    assert log_config("info")["formatters"]["default"]["()"] == "uvicorn.logging.DefaultFormatter"
    try:
        raise ValueError("password=hunter2 in a driver message")
    except ValueError as exc:
        record = logging.LogRecord("tiergate.x", logging.ERROR, __file__, 1, "db write failed", None,
                                   (type(exc), exc, exc.__traceback__))
    assert RedactExceptions().filter(record)
    line = orjson.loads(JsonFormatter().format(record))
    assert line["msg"].startswith("db write failed [ValueError at tests.") and "hunter2" not in str(line)
