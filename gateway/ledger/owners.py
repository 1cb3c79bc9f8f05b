"""Which ledger processes are alive: one lock file per running ``Ledger`` under
``<journal root>/.owners/<owner id>``, held with an exclusive ``flock`` for the life of the
ledger (the kernel drops it when the process dies, kill -9 included).

Every ``CallIntent`` names its owner. A ledger that starts takes over the owner files whose
lock is free (their process died), settles those owners' unfinished intents and then removes
the files; a ledger that stops cleanly removes its own file unless it still has intents open
(they are then settled by the next start, like a dead owner's). Two processes never settle one
owner: the settler holds the dead owner's lock while it settles. No database; imports nothing
from the gateway.
"""

from __future__ import annotations

import fcntl
import logging
import os
import uuid
from pathlib import Path

log = logging.getLogger("tiergate.ledger")
OWNERS_DIR = ".owners"


def _lock(path: Path, *, create: bool) -> int | None:
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:  # removed by the process that settled it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def claim_owner(root: str | Path) -> tuple[str, int]:
    """A new owner id for this ledger and the fd holding its lock."""
    directory = Path(root) / OWNERS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    owner = "o-" + uuid.uuid4().hex
    fd = _lock(directory / owner, create=True)
    if fd is None:
        raise OSError(f"cannot lock ledger owner file {directory / owner}")
    return owner, fd


def lock_dead_owners(root: str | Path, own: str) -> dict[str, int]:
    """The owners (other than ``own``) whose process is gone, each with its lock now held by us."""
    directory = Path(root) / OWNERS_DIR
    if not directory.is_dir():
        return {}
    dead: dict[str, int] = {}
    for path in sorted(directory.iterdir()):
        if path.name == own or not path.name.startswith("o-"):
            continue
        fd = _lock(path, create=False)
        if fd is not None:
            dead[path.name] = fd
    return dead


def release_owner(root: str | Path, owner: str, fd: int, *, remove: bool) -> None:
    """Give up the lock on ``owner``; ``remove``: its intents are all settled, delete its file."""
    try:
        if remove:
            (Path(root) / OWNERS_DIR / owner).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("ledger: could not remove owner file %s (%s)", owner, exc)
    finally:
        os.close(fd)
