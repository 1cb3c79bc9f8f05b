"""Validation of a batch input file (JSONL) before any line runs.

Each non-empty line must be ``{"custom_id": str, "method": "POST", "url": <the batch's
endpoint>, "body": {...}}`` with a chat-completions body the live route would accept (not
streamed); custom_ids are unique and free of control characters; the file has at least one
and at most ``max_lines`` lines; no line nests JSON deeper than the live route allows. The first problem raises ``InvalidRequest`` (400) naming the line in the message and the
field in ``param``. Imports schemas, errors, identifiers and client_json only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway import client_json
from gateway.errors import GatewayError, InvalidRequest
from gateway.ids import FORBIDDEN_MESSAGE, is_clean
from gateway.schemas import UnknownFields, parse_chat_request

ENDPOINTS = ("/v1/chat/completions",)
MAX_CUSTOM_ID = 256


@dataclass(frozen=True)
class LineSpec:
    line_no: int  # 1-based line of the input file
    custom_id: str
    body: dict[str, Any]


def _bad(line_no: int, message: str, param: str | None) -> InvalidRequest:
    return InvalidRequest(f"input file line {line_no}: {message}", param=param, code="invalid_batch_line")


def _line(line_no: int, raw: bytes, endpoint: str, max_depth: int, unknown_fields: UnknownFields) -> LineSpec:
    try:
        obj = client_json.loads(raw, max_depth=max_depth)
    except InvalidRequest as err:
        problem = (f"nests JSON more than {max_depth} levels deep" if err.code == "json_too_deep"
                   else "not valid JSON")
        raise _bad(line_no, problem, None) from None
    if not isinstance(obj, dict):
        raise _bad(line_no, "must be a JSON object", None)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise _bad(line_no, f"'custom_id' must be a non-empty string of at most {MAX_CUSTOM_ID} characters",
                   "custom_id")
    if not is_clean(custom_id):
        raise _bad(line_no, f"'custom_id' {FORBIDDEN_MESSAGE}", "custom_id")
    if obj.get("method") != "POST":
        raise _bad(line_no, "'method' must be 'POST'", "method")
    if obj.get("url") != endpoint:
        raise _bad(line_no, f"'url' must be the batch's endpoint '{endpoint}'", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _bad(line_no, "'body' must be a JSON object", "body")
    try:
        req = parse_chat_request(body, unknown_fields)  # "drop": removed from the stored body too
    except GatewayError as err:
        raise _bad(line_no, err.message, f"body.{err.param}" if err.param else "body") from None
    if req.stream:
        raise _bad(line_no, "batch requests cannot be streamed", "body.stream")
    return LineSpec(line_no, custom_id, body)


def parse_batch_file(content: bytes, endpoint: str, max_lines: int, *,
                     max_depth: int = client_json.DEFAULT_MAX_DEPTH,
                     unknown_fields: UnknownFields = "reject") -> list[LineSpec]:
    """The file's lines, validated; raises ``InvalidRequest`` on the first problem. A line nested
    deeper than ``max_depth`` is refused like the live route refuses such a body."""
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint",
                             code="invalid_value")
    specs: list[LineSpec] = []
    seen: set[str] = set()
    for i, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(specs) >= max_lines:
            raise InvalidRequest(f"the input file has more than {max_lines} requests", param="input_file_id",
                                 code="too_many_requests")
        spec = _line(i, raw, endpoint, max_depth, unknown_fields)
        if spec.custom_id in seen:
            raise _bad(i, f"custom_id '{spec.custom_id}' is used by an earlier line", "custom_id")
        seen.add(spec.custom_id)
        specs.append(spec)
    if not specs:
        raise InvalidRequest("the input file has no requests", param="input_file_id", code="empty_file")
    return specs
