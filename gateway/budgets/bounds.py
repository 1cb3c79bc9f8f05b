"""Bounds on every budget and rate-limit value an admin sets (admin API and CLI alike, through
``put_policy``), so that no stored policy can break a request later.

- USD amounts: finite, 0 or at least one nano-dollar, in whole nano-dollars (the ledger's and
  the counters' unit: ``Numeric(18, 9)`` and integer nanos; see ``usd`` for Python floats), at most ``MAX_USD``
  (100 million per period: nanos stay far inside 64 bits, digits inside ``Numeric(18, 9)``).
- A soft limit is at most the hard limit (when both are set, after the update is applied).
- Alert thresholds: 1 to 10 fractions of the limit, each in (0, 1].
- Requests and tokens per minute: positive, at most ``MAX_REQUESTS_PER_MIN`` /
  ``MAX_TOKENS_PER_MIN`` (both fit PostgreSQL's ``integer``).

A violation is ``PolicyValueError`` (a ValueError naming the param). Pure: the standard
library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

MAX_USD = Decimal(100_000_000)
NANO = Decimal("0.000000001")
MAX_REQUESTS_PER_MIN = 10_000_000
MAX_TOKENS_PER_MIN = 1_000_000_000
MAX_ALERT_THRESHOLDS = 10


class PolicyValueError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def usd(name: str, value: float | Decimal | str | None) -> Decimal | None:
    """``value`` as a Decimal amount of whole nano-dollars, or PolicyValueError. Decimal and text
    input (the admin API, the CLI) must be exact; a Python float (computed by a caller, with
    binary noise such as 3.4500000000000004e-05) is rounded to the nearest nano-dollar, but one
    below a nano-dollar is refused all the same."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise PolicyValueError(f"{name} must be a number of USD", name)
    try:
        amount = Decimal(repr(value) if isinstance(value, float) else str(value))
    except InvalidOperation:
        raise PolicyValueError(f"{name} must be a number of USD", name) from None
    if not amount.is_finite() or amount < 0:
        raise PolicyValueError(f"{name} must be a finite amount >= 0", name)
    if amount > MAX_USD:
        raise PolicyValueError(f"{name} must be at most {MAX_USD} USD", name)
    whole = amount.quantize(NANO, rounding=ROUND_HALF_UP)
    if (amount != whole and not isinstance(value, float)) or 0 < amount < NANO:
        raise PolicyValueError(f"{name} must be 0 or a whole number of nano-dollars (at most 9 decimal places, "
                               f"at least {NANO:f})", name)
    return whole


def per_minute(name: str, value: int | None, maximum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= maximum:
        raise PolicyValueError(f"{name} must be an integer from 1 to {maximum}", name)
    return value


def thresholds(values: Sequence[float] | None) -> list[float] | None:
    if values is None:
        return None
    out = sorted(float(t) for t in values)
    if not 0 < len(out) <= MAX_ALERT_THRESHOLDS or not all(0 < t <= 1 for t in out):
        raise PolicyValueError(f"alert_thresholds must be 1 to {MAX_ALERT_THRESHOLDS} fractions of the limit, "
                               "each in (0, 1], e.g. 0.5 0.8 1.0", "alert_thresholds")
    return out


def consistent(limit_usd: Decimal | None, soft_limit_usd: Decimal | None) -> None:
    """Refuse a soft limit above the hard limit."""
    if limit_usd is not None and soft_limit_usd is not None and soft_limit_usd > limit_usd:
        raise PolicyValueError(f"soft_limit_usd ({soft_limit_usd}) must not exceed limit_usd ({limit_usd})",
                               "soft_limit_usd")
