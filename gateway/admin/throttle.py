"""``LoginThrottle``: failed admin logins per client address: after ``max_failures`` inside ``window_s`` the
address is refused until the oldest failure leaves the window, so the admin key cannot be
guessed at request speed. In-process (each replica counts its own). Pure: the clock is
passed in; must not import the rest of the gateway.

``ActionLimiter``: state-changing admin actions (console forms, admin API writes) per client
address: at most ``max_actions`` inside ``window_s``, then 429 until the oldest leaves the window.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class LoginThrottle:
    def __init__(self, *, max_failures: int = 10, window_s: float = 300.0, max_clients: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_failures, self.window_s, self.max_clients = max_failures, window_s, max_clients
        self._clock = clock
        self._failures: dict[str, deque[float]] = {}

    def _recent(self, client: str) -> deque[float]:
        q = self._failures.get(client, deque())
        horizon = self._clock() - self.window_s
        while q and q[0] <= horizon:
            q.popleft()
        return q

    def retry_after_s(self, client: str) -> float | None:
        """Seconds until ``client`` may try again, or None when it may try now."""
        q = self._recent(client)
        if len(q) < self.max_failures:
            return None
        return max(q[0] + self.window_s - self._clock(), 0.0)

    def failed(self, client: str) -> None:
        if client not in self._failures and len(self._failures) >= self.max_clients:
            self._failures = {c: q for c, q in self._failures.items() if self._recent(c)}
        q = self._recent(client)
        q.append(self._clock())
        self._failures[client] = q

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)


class ActionLimiter:
    def __init__(self, *, max_actions: int = 120, window_s: float = 60.0, max_clients: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = LoginThrottle(max_failures=max_actions, window_s=window_s, max_clients=max_clients, clock=clock)

    def take(self, client: str) -> float | None:
        """Count one action of ``client``; None when allowed, else the seconds to wait (not counted)."""
        wait = self._log.retry_after_s(client)
        if wait is None:
            self._log.failed(client)
        return wait
