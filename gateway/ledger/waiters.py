"""Waiters of the ledger's durability levels: asyncio futures resolved from the journal and sync
threads, and the error they fail with. Plain asyncio; imports nothing from the gateway."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("tiergate.ledger")


class LedgerError(RuntimeError):
    """The ledger could not make a record durable, or is not running."""

# (sequence number the waiter needs, its event loop, its future)
Waiter = tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]


def take_waiters(waiters: list[Waiter], upto: int) -> list[Waiter]:
    """Remove and return the waiters whose target is reached (call with the condition held)."""
    done = [w for w in waiters if w[0] <= upto]
    waiters[:] = [w for w in waiters if w[0] > upto]
    return done


def resolve_waiter(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None], exc: BaseException | None) -> None:
    def settle() -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        # The waiter's event loop is closed: nobody is waiting any more. The record itself is
        # unaffected (it is journaled, or still buffered for retry).
        log.debug("ledger: waiter's event loop already closed")
