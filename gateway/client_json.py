"""JSON from clients: orjson with a nesting-depth limit.

orjson parses up to 1024 levels but re-encodes at most 254, so a body nested 255-1023 levels
deep parsed fine and then failed (a 500) wherever the gateway encoded it again (to an upstream,
into a batch line, into the ledger). ``loads`` refuses anything deeper than ``max_depth`` with
a 400 that says so; ``server.max_json_depth`` (default 64, at most 200) keeps every re-encoding
far from orjson's limit. The walk visits containers only: a chat body costs a few hundred
isinstance checks. Pure: orjson and gateway.errors only (the batch validator uses it too).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import InvalidRequest

DEFAULT_MAX_DEPTH = 64


def exceeds_depth(doc: Any, max_depth: int) -> bool:
    """True when ``doc`` has lists/objects nested more than ``max_depth`` levels (a scalar is 0)."""
    if not isinstance(doc, (dict, list)):
        return False
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        for child in (node.values() if isinstance(node, dict) else node):
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def too_deep(what: str, max_depth: int, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(f"{what} nests JSON arrays/objects more than {max_depth} levels deep",
                          param=param, code="json_too_deep")


def loads(raw: bytes | str, *, max_depth: int = DEFAULT_MAX_DEPTH, what: str = "the request body") -> Any:
    """The parsed document; InvalidRequest (400) when it is not JSON or is nested too deep."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        if "depth limit" in str(err) or "recursion" in str(err).lower():
            raise too_deep(what, max_depth) from None
        raise InvalidRequest(f"{what} is not valid JSON", code="invalid_json") from None
    if exceeds_depth(doc, max_depth):
        raise too_deep(what, max_depth)
    return doc
