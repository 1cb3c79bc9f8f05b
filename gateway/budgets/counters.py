"""The budget-counter contract both backends (in-process, Redis) implement.

A counter is ``spent`` (settled nano-dollars in one subject's period window, loaded
from the database on first use) plus ``held`` (outstanding reservations). Reserving
checks ``spent + held + amount <= limit`` for every counter of a hold atomically and
either holds on all of them or on none. Must not import routes, the app or the pipeline.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.budgets.holds import CounterRef, Hold

SpentLoader = Callable[[CounterRef], Awaitable[int]]


@dataclass(frozen=True)
class CounterState:
    spent_nanos: int
    held_nanos: int

    def remaining(self, limit_nanos: int) -> int:
        return limit_nanos - self.spent_nanos - self.held_nanos


@dataclass(frozen=True)
class ReserveOutcome:
    ok: bool
    states: tuple[CounterState, ...]  # one per counter, after the hold when ok
    denied_index: int | None = None  # which counter refused


class CounterBackend(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def reserve(self, hold: Hold, load: SpentLoader) -> ReserveOutcome: ...

    async def settle(self, hold: Hold, actual_nanos: int) -> tuple[CounterState, ...]: ...

    async def release(self, hold: Hold) -> None: ...

    async def snapshot(self, refs: Sequence[CounterRef], load: SpentLoader) -> tuple[CounterState, ...]: ...
