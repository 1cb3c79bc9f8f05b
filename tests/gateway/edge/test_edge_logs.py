"""Logs never carry exception text from the database layer or request content: an unhandled
error is a 500 in OpenAI's shape and one log line with its type and place (a database error's
text quotes its SQL parameters: here an uploaded file's name and first bytes), and a client that
disconnects mid-body is one quiet debug line, never a traceback. The stderr of a real
`tiergate serve` is checked in test_edge_serve."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.gateway.edge.edge_support import edge_gateway, openai_error
from tests.gateway.gateway_harness import Gateway
from tests.gateway.scripted_upstream import ScriptedUpstream

SECRET_NAME, SECRET_BYTES = "secret-customer-list.jsonl", b'{"custom_id": "SECRET-CONTENT-4711"}\n'


def _no_exception_text(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        assert record.exc_info is None and record.exc_text is None, (record.name, record.getMessage())
    text = caplog.text
    assert "Traceback" not in text and "SECRET" not in text and "secret-customer" not in text, text


async def _upload_into_a_broken_database(gw: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    with gw.session_factory() as s:
        s.execute(sa.text("DROP TABLE files CASCADE" if s.bind.dialect.name == "postgresql" else "DROP TABLE files"))
        s.commit()
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        r = await gw.client.post("/v1/files", headers=gw.auth, data={"purpose": "batch"},
                                 files={"file": (SECRET_NAME, SECRET_BYTES)})
    err = openai_error(r, 500)
    assert err["type"] == "server_error" and "SECRET" not in r.text
    _no_exception_text(caplog)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "Error at gateway.jobs.files:" in errors[0], errors


async def test_db_error_is_logged_as_type_and_place_sqlite(tmp_path: Path, upstream: ScriptedUpstream,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    async with edge_gateway(tmp_path, upstream) as gw:
        await _upload_into_a_broken_database(gw, caplog)


@pytest.mark.postgres
async def test_db_error_is_logged_as_type_and_place_postgres(tmp_path: Path, upstream: ScriptedUpstream,
                                                            caplog: pytest.LogCaptureFixture, postgres_url: str) -> None:
    async with edge_gateway(tmp_path, upstream, db_url=postgres_url) as gw:
        await _upload_into_a_broken_database(gw, caplog)


async def _hang_up_mid_body(gw: Gateway, path: str) -> None:
    """Call the app as uvicorn would for a client that sends part of its body, then disconnects."""
    multipart = path == "/v1/files"
    first = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nxx' if multipart
             else b'{"model": "lo')
    incoming = [{"type": "http.request", "body": first, "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass

    content_type = b"multipart/form-data; boundary=b" if multipart else b"application/json"
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "server": ("tiergate", 80), "client": ("127.0.0.1", 5555),
             "headers": [(b"host", b"tiergate"), (b"authorization", gw.auth["Authorization"].encode()),
                         (b"content-type", content_type), (b"content-length", b"1000")]}
    await gw.app(scope, receive, send)  # returns: nothing escapes to the server


async def test_client_disconnect_mid_body_is_one_quiet_line(tmp_path: Path, upstream: ScriptedUpstream,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    async with edge_gateway(tmp_path, upstream) as gw:
        for path in ("/v1/chat/completions", "/v1/batches", "/v1/files"):
            caplog.clear()
            with caplog.at_level(logging.DEBUG):
                await _hang_up_mid_body(gw, path)
            _no_exception_text(caplog)
            assert not [r for r in caplog.records if r.levelno >= logging.INFO], caplog.text
            assert [r.getMessage() for r in caplog.records if r.name == "tiergate.edge"] == [
                "client closed the connection before sending its whole request body"], path


def test_redacting_filter_and_describe() -> None:
    from gateway.log_safety import RedactExceptions, describe
    try:
        {}["SECRET-KEY"]
    except KeyError as exc:
        caught = exc
    text = describe(caught)
    assert text.startswith("KeyError at tests.gateway.edge.test_edge_logs:") and "SECRET" not in text
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed for %s", ("tenant",),
                               (type(caught), caught, caught.__traceback__))
    assert RedactExceptions().filter(record)
    formatted = logging.Formatter().format(record)
    assert formatted == f"failed for tenant [{text}]" and "Traceback" not in formatted
