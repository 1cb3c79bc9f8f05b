"""``BudgetStatus``: the tightest budget applying to a caller right now, in nano-USD, and its
edge forms (the ``x-tiergate-budget-remaining-usd`` header, the admin API's JSON in USD).
Must not import routes, the app, the pipeline or providers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.budgets.periods import PeriodName
from gateway.money import format_usd, usd_number

REMAINING_HEADER = "x-tiergate-budget-remaining-usd"


def remaining_headers(remaining_nanos: int | None) -> dict[str, str]:
    """The remaining-budget header (never negative), or none when no hard limit applies."""
    return {} if remaining_nanos is None else {REMAINING_HEADER: format_usd(max(remaining_nanos, 0))}


def _usd(nanos: int | None) -> float | None:
    return None if nanos is None else usd_number(nanos)


@dataclass(frozen=True)
class BudgetStatus:
    """The tightest budget applying to a caller right now (None fields: no limit set)."""

    remaining_nanos: int | None
    soft_exceeded: bool
    hard_limit_nanos: int | None
    soft_limit_nanos: int | None = None
    spent_nanos: int = 0
    held_nanos: int = 0
    subject: str | None = None
    period: PeriodName | None = None
    period_key: str | None = None
    resets_in_s: float | None = None

    def headers(self) -> dict[str, str]:
        return remaining_headers(self.remaining_nanos)

    def to_json(self) -> dict[str, Any]:
        """The admin API's and dashboard's form: amounts as USD numbers."""
        return {"remaining_usd": _usd(self.remaining_nanos), "soft_exceeded": self.soft_exceeded,
                "hard_limit_usd": _usd(self.hard_limit_nanos), "soft_limit_usd": _usd(self.soft_limit_nanos),
                "spent_usd": usd_number(self.spent_nanos), "held_usd": usd_number(self.held_nanos),
                "subject": self.subject, "period": self.period, "period_key": self.period_key,
                "resets_in_s": self.resets_in_s}


UNLIMITED = BudgetStatus(remaining_nanos=None, soft_exceeded=False, hard_limit_nanos=None)
