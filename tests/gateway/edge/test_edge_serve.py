"""The edge of a real `tiergate serve` (uvicorn + httptools, in a subprocess): an unauthenticated
100 MB body is refused without being read (the server's RSS stays flat), a client that sends its
headers or its body one byte at a time is cut off within the configured timeouts, idle and
keep-alive connections are closed, ``limit_concurrency`` answers 503, and nothing on stderr is
a traceback or quotes a database error's parameters or a request's content."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.gateway.edge.edge_support import ADMIN, Served, rss_mib, serve_subprocess
from tests.gateway.scripted_upstream import UPSTREAM_KEY, UPSTREAM_KEY_ENV, ScriptedUpstream

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.integration]
TIMEOUT_S = 1.0  # header, body and keep-alive timeouts of the served gateway
LIMIT = 16  # limit_concurrency


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with ScriptedUpstream() as upstream, serve_subprocess(
            tmp_path_factory.mktemp("served"), upstream, env={UPSTREAM_KEY_ENV: UPSTREAM_KEY},
            server={"header_read_timeout_s": TIMEOUT_S, "body_read_timeout_s": TIMEOUT_S,
                    "keep_alive_timeout_s": 1, "limit_concurrency": LIMIT}) as s:
        yield s


def _settled_rss(served: Served) -> float:
    """The server's RSS once start-up work (the tokenizer warm-up runs in the background after
    /readyz) has stopped growing it: two readings 0.5 s apart within 1 MiB, 20 s at most."""
    httpx.post(f"{served.base}/v1/batches", content=b"{}", timeout=5)  # the refusal path, warmed once
    last = rss_mib(served.proc.pid)
    for _ in range(40):
        time.sleep(0.5)
        now = rss_mib(served.proc.pid)
        if abs(now - last) < 1:
            return now
        last = now
    return last


def _connect(served: Served) -> socket.socket:
    return socket.create_connection(("127.0.0.1", served.port), timeout=10)


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed it."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data, time.monotonic() - start


@pytest.mark.parametrize(("request_line", "chunked"), [
    (b"POST /v1/batches", False), (b"POST /v1/batches", True), (b"PUT /admin/budgets/tenants/t1", False)])
def test_unauthenticated_100mb_body_leaves_rss_flat(served: Served, request_line: bytes, chunked: bool) -> None:
    before = _settled_rss(served)
    peak = before
    sock = _connect(served)
    length = b"transfer-encoding: chunked" if chunked else b"content-length: 104857600"
    sock.sendall(request_line + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + length + b"\r\n\r\n")
    chunk = b"x" * (1 << 20)
    sent = 0
    try:
        for _ in range(100):
            sock.sendall(b"100000\r\n" + chunk + b"\r\n" if chunked else chunk)
            sent += 1
            peak = max(peak, rss_mib(served.proc.pid))
    except OSError:
        pass  # the server answered 401 and closed the connection: nothing more to send
    answer, _ = _read_until_closed(sock, 5)
    sock.close()
    peak = max(peak, rss_mib(served.proc.pid))
    assert peak - before < 20, f"RSS grew {peak - before:.1f} MiB while refusing ({sent} MiB sent)"
    assert sent < 100 or answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert httpx.get(f"{served.base}/healthz", timeout=5).status_code == 200


def test_slow_header_sender_is_cut_off(served: Served) -> None:
    sock = _connect(served)
    start = time.monotonic()
    request = b"GET /healthz HTTP/1.1\r\nhost: x\r\nuser-agent: slowloris\r\n\r\n"
    closed = False
    for byte in request:
        try:
            sock.send(bytes([byte]))
        except OSError:
            closed = True
            break
        sock.settimeout(0.25)
        try:
            answer = sock.recv(4096)
        except TimeoutError:
            continue
        closed = True  # the server spoke (a 408) or closed: either way, it is done with us
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:100]
        break
    elapsed = time.monotonic() - start
    sock.close()
    assert closed and elapsed < TIMEOUT_S + 1.0, f"still open after {elapsed:.2f} s"


def test_idle_connection_is_closed(served: Served) -> None:
    sock = _connect(served)
    answer, elapsed = _read_until_closed(sock, 10)
    sock.close()
    assert elapsed < TIMEOUT_S + 1.0 and (answer == b"" or answer.startswith(b"HTTP/1.1 408")), (elapsed, answer)


def test_slow_body_sender_gets_408(served: Served) -> None:
    sock = _connect(served)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + served.key.encode()
                 + b"\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n")
    start = time.monotonic()
    answer = b""
    for byte in b'{"model": "low", "messages": [{"role": "user", "content": "' + b"x" * 140:
        try:
            sock.send(bytes([byte]))
        except OSError:
            break
        sock.settimeout(0.2)
        try:
            answer = sock.recv(65536)
        except TimeoutError:
            continue
        break
    rest, _ = _read_until_closed(sock, 5)
    elapsed = time.monotonic() - start
    sock.close()
    answer += rest
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b'"code":"request_timeout"' in answer and b"connection: close" in answer.lower()
    assert elapsed < TIMEOUT_S + 1.5, elapsed


def test_an_early_answer_closes_a_connection_with_an_unread_body(served: Served) -> None:
    """Without a key the body is not read; the connection is closed with the 401, so a client
    cannot keep it by trickling the rest of a small body after the answer."""
    sock = _connect(served)
    sock.sendall(b"POST /v1/batches HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 2000\r\n\r\n{")
    start = time.monotonic()
    answer = b""
    try:
        for _ in range(40):
            sock.settimeout(0.1)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                sock.send(b" ")
                continue
            if not chunk:
                break
            answer += chunk
    except OSError:
        pass
    elapsed = time.monotonic() - start
    sock.close()
    assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower(), answer[:300]
    assert elapsed < 2, f"connection held {elapsed:.2f} s"


def test_keep_alive_connection_is_closed_when_idle(served: Served) -> None:
    sock = _connect(served)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    sock.settimeout(5)
    answer = b""
    while b'{"status":"ok"}' not in answer:
        answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200")
    rest, elapsed = _read_until_closed(sock, 10)
    sock.close()
    assert rest == b"" and elapsed < 1 + 1.0, elapsed


def test_limit_concurrency_answers_503(served: Served) -> None:
    held = [_connect(served) for _ in range(LIMIT)]
    try:
        time.sleep(0.1)
        r = httpx.get(f"{served.base}/healthz", timeout=5)
        assert r.status_code == 503, r.text
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{served.base}/healthz", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_stderr_carries_no_traceback_and_no_content(served: Served, tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{Path(served.stderr).parent / 'served.db'}")
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE files"))
    engine.dispose()
    auth = {"Authorization": f"Bearer {served.key}"}
    r = httpx.post(f"{served.base}/v1/files", headers=auth, data={"purpose": "batch"},
                   files={"file": ("secret-customer-list.jsonl", b'{"custom_id": "SECRET-CONTENT-4711"}\n')})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    for path in (b"/v1/chat/completions", b"/v1/batches"):  # clients that hang up mid-body
        sock = _connect(served)
        sock.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + served.key.encode()
                     + b"\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\": \"SECRET")
        time.sleep(0.2)
        sock.close()
    assert httpx.put(f"{served.base}/admin/budgets/tenants/{served.tenant_id}", headers=ADMIN,
                     json={"limit_usd": 1e20}).status_code == 400
    time.sleep(0.5)
    log = served.log()
    assert "Traceback" not in log and "SECRET" not in log and "secret-customer" not in log, log[-3000:]
    assert "Exception in ASGI application" not in log and "ClientDisconnect" not in log
    assert "OperationalError at gateway.jobs.files:" in log, log[-3000:]
