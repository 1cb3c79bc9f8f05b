"""Fast unique ids for the hot path (request ids, ledger entry ids).

Ids need uniqueness, not secrecy: a per-process generator seeded from the OS (and reseeded in
forked children) avoids one getrandom syscall per id, which is slow on some VMs. 128 random
bits, formatted like ``uuid4().hex``. Imports nothing from the gateway.
"""

from __future__ import annotations

import os
import random

_ids = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(32)))


def fast_id() -> str:
    """128 random bits as 32 lowercase hex characters."""
    return f"{_ids.getrandbits(128):032x}"
