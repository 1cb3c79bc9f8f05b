"""Ids: the ones tiergate makes and the ones a client sends.

``fast_id``: unique ids for the hot path (request ids, ledger entry ids, holds). Ids need
uniqueness, not secrecy: a per-process generator seeded from the OS (and reseeded in forked
children) avoids one getrandom syscall per id, which is slow on some VMs. 128 random bits,
formatted like ``uuid4().hex``.

Identifiers a client sends — ids in paths, queries and bodies, file names, ``custom_id``s,
paging cursors — are checked at the edge, before any database sees them: no NUL, no other control
character and no lone surrogate (PostgreSQL text cannot hold NUL, its UTF-8 encoding cannot
hold a surrogate, and control characters have no business in an id), and a bounded length.
A bad one is a 400 in OpenAI's shape naming the param. ``Identifier`` is the annotated type for
FastAPI path/query parameters and pydantic fields; ``check_identifier`` is the same check for
values read by hand.

Pure: pydantic and gateway.errors only.
"""

from __future__ import annotations

import os
import random
import re
from typing import Annotated

from pydantic import AfterValidator, StringConstraints

from gateway.errors import InvalidRequest

_ids = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(32)))


def fast_id() -> str:
    """128 random bits as 32 lowercase hex characters."""
    return f"{_ids.getrandbits(128):032x}"


MAX_ID_CHARS = 256
_FORBIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
FORBIDDEN_MESSAGE = "must not contain NUL, control characters or lone surrogates"


def is_clean(value: str) -> bool:
    """True when ``value`` has no character an identifier may not hold."""
    return _FORBIDDEN.search(value) is None


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def is_storable(value: str) -> bool:
    """True when a database text column can hold ``value`` (no NUL, no lone surrogate)."""
    return _UNSTORABLE.search(value) is None


def _clean(value: str) -> str:
    if not is_clean(value):
        raise ValueError(FORBIDDEN_MESSAGE)
    return value


Identifier = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS), AfterValidator(_clean)]


def check_identifier(value: str, param: str, *, max_chars: int = MAX_ID_CHARS) -> str:
    """``value`` unchanged, or InvalidRequest (400) naming ``param``."""
    if not value or len(value) > max_chars:
        raise InvalidRequest(f"'{param}' must be 1 to {max_chars} characters", param=param, code="invalid_value")
    if not is_clean(value):
        raise InvalidRequest(f"'{param}' {FORBIDDEN_MESSAGE}", param=param, code="invalid_value")
    return value
