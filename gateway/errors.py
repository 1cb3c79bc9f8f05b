"""The gateway's exception tree. Each error knows its HTTP status and OpenAI error shape;
routes map them once (gateway.app). Messages never contain secrets or stack traces."""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(GatewayError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class AuthenticationFailed(GatewayError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class PermissionDenied(GatewayError):
    status, type, code = 403, "invalid_request_error", "permission_denied"


class NotFound(GatewayError):
    status, type, code = 404, "invalid_request_error", "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(GatewayError):
    status, type, code = 413, "invalid_request_error", "payload_too_large"


class RequestTimeout(GatewayError):
    """The client did not send its request body within the server's body read timeout."""

    status, type, code = 408, "invalid_request_error", "request_timeout"


class ClientClosedRequest(GatewayError):
    """The client went away before the answer was ready (nginx's 499; nobody reads the body)."""

    status, type, code = 499, "invalid_request_error", "client_closed_request"


class RateLimited(GatewayError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class BudgetExceeded(GatewayError):
    """A hard budget cannot hold the request. Retrying does not help until the period resets or
    the limit is raised, so the answer says ``x-should-retry: false`` (the official SDKs honour
    it; they would otherwise retry a 429 twice)."""

    status, type, code = 429, "insufficient_quota", "budget_exceeded"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers = {**self.headers, "x-should-retry": "false"}


class UpstreamError(GatewayError):
    """The upstream model failed. ``retryable`` tells the router whether to retry/fall back."""

    status, type, code = 502, "upstream_error", "upstream_error"

    def __init__(self, message: str, *, upstream_status: int | None = None, retryable: bool = True,
                 **kw: Any) -> None:
        super().__init__(message, **kw)
        self.upstream_status = upstream_status
        self.retryable = retryable


class UpstreamTimeout(UpstreamError):
    status, type, code = 504, "upstream_error", "upstream_timeout"


class ServiceUnavailable(GatewayError):
    """A dependency the money path needs is down (the ledger's journal cannot be written, the
    budget counters cannot be reached under ``budgets.redis_outage: fail_closed``): nothing was
    started or billed; the client may retry after ``retry-after`` seconds."""

    status, type, code = 503, "server_error", "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 1, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers = {**self.headers, "retry-after": str(max(int(retry_after_s), 1))}
