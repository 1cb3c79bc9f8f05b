"""How ``tiergate serve`` runs uvicorn: the edge limits of ``server:`` in config.yaml applied to
the HTTP server itself.

uvicorn has no timeout for a request's line and headers: a client sending one byte a second
held a connection (and a slot) for as long as it liked. ``HeaderTimeoutHttpTools`` is uvicorn's
httptools protocol with that timeout: armed when the connection opens and when a request starts,
cancelled when its headers are complete; when it fires the client gets a 408 and the connection
is closed (a response already being sent on it finishes first). A connection lost mid-response
runs the response's hang-up hooks from ``connection_lost`` itself (gateway.web.hangup). Body reads are timed by
gateway.web.request_body, idle keep-alive by uvicorn (``timeout_keep_alive``), and
``limit_concurrency`` makes uvicorn answer 503 past that many connections + requests in flight.
Every log handler redacts exceptions to type + place (gateway.log_safety).

Imports uvicorn, settings, log_safety and gateway.web.hangup only.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.log_safety import log_config
from gateway.settings import Settings
from gateway.web.hangup import hang_up, offer

log = logging.getLogger("tiergate.serving")
DEFAULT_HEADER_TIMEOUT_S = 10.0
_408_BODY = (b'{"error": {"message": "the request headers did not arrive in time", "type": "invalid_request_error", '
             b'"param": null, "code": "request_timeout"}}')
_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: " + str(len(_408_BODY)).encode() + b"\r\n\r\n" + _408_BODY)


class EdgeConfig(uvicorn.Config):
    """uvicorn's Config plus the header read timeout (a plain attribute: it survives the pickling
    that hands the config to worker processes)."""

    def __init__(self, app: Any, *, header_read_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.header_read_timeout_s = header_read_timeout_s


class HeaderTimeoutHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a request-line + headers read timeout."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.header_timeout_s = float(getattr(config, "header_read_timeout_s", DEFAULT_HEADER_TIMEOUT_S))
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        offer(self.scope)  # type: ignore[arg-type]  # a lost connection is reported to the response at once (gateway.web.hangup)
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:  # gone before its response completed
            hang_up(cycle.scope)  # type: ignore[arg-type]

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        log.debug("closed a connection whose request headers took longer than %.3g s", self.header_timeout_s)
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(_408)
            self.transport.close()
        else:  # a pipelined request trickles in behind a response still being sent: finish that one
            self.cycle.keep_alive = False
            self.flow.pause_reading()


def uvicorn_config(settings: Settings, *, app: Any, host: str, port: int, workers: int = 1,
                   access_log: bool = False, factory: bool = True, **overrides: Any) -> EdgeConfig:
    """The uvicorn configuration ``tiergate serve`` runs with."""
    server = settings.server
    kwargs: dict[str, Any] = dict(
        host=host, port=port, workers=workers, factory=factory, loop="uvloop",
        http=f"{__name__}:HeaderTimeoutHttpTools", access_log=access_log, log_level=server.log_level,
        log_config=log_config(server.log_level, settings.observability.logs.format), timeout_graceful_shutdown=10,
        timeout_keep_alive=server.keep_alive_timeout_s, limit_concurrency=server.limit_concurrency,
        forwarded_allow_ips=server.forwarded_allow_ips,
    )
    kwargs.update(overrides)
    return EdgeConfig(app, header_read_timeout_s=server.header_read_timeout_s, **kwargs)


def run(config: EdgeConfig) -> None:
    """Serve until stopped: one process, or ``config.workers`` processes on one socket (what
    ``uvicorn.run`` does, with this config)."""
    from uvicorn.main import STARTUP_FAILURE
    from uvicorn.supervisors import Multiprocess

    if config.workers > 1:
        Multiprocess(config, sockets=[config.bind_socket()]).run()
        return
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
