"""Money: integer nano-USD (1e-9 USD) from pricing to the edge.

Every amount tiergate computes — a call's cost, a request's tally, a budget hold or
settlement, a ledger row — is an ``int`` of nano-USD, so sums are exact and the ledger, the
budget counters (in memory, in Redis) and the database (``Numeric(18, 9)``: nine decimals of
USD, exactly one nano-USD) agree to the last digit. Conversions happen only at the edges:

* in: configured or requested USD amounts (``usd_to_nanos``: the decimal the operator or
  client wrote, rounded half-up to a whole nano-USD), prices (``rate``), database decimals
  (``decimal_to_nanos``), old float journal fields (``legacy_usd_to_nanos``);
* out: HTTP headers and messages (``format_usd``), JSON numbers (``usd_number``), database
  columns (``nanos_to_decimal``, exact).

Pure: the standard library only; imports nothing from the gateway.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from functools import lru_cache
from typing import Protocol

NANOS_PER_USD = 10**9
NANO = Decimal("0.000000001")


class TokenCounts(Protocol):
    """What a price needs of a call's usage (``gateway.providers.base.Usage`` fits)."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...


def _decimal(amount: Decimal | int | str | float) -> Decimal:
    if isinstance(amount, bool):
        raise TypeError("a money amount is not a bool")
    if isinstance(amount, float):
        # The shortest repr is the decimal the value was written as (0.1 -> "0.1", never
        # 0.1000000000000000055...): config files and request bodies are parsed into floats.
        return Decimal(repr(amount))
    return amount if isinstance(amount, Decimal) else Decimal(amount)


def usd_to_nanos(amount: Decimal | int | str | float) -> int:
    """A USD amount (as written: Decimal, text, int, or a parsed float) → nano-USD, rounded
    half-up to a whole nano-USD."""
    return int((_decimal(amount) * NANOS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def decimal_to_nanos(value: Decimal | int | str | float | None) -> int:
    """A database amount (``Numeric(18, 9)`` or a SUM of one; None is 0) → nano-USD."""
    return 0 if value is None else usd_to_nanos(Decimal(str(value)))


def legacy_usd_to_nanos(value: float) -> int:
    """A float USD field of an old journal line → nano-USD, rounded exactly as the writer of
    that format stored it (``Decimal(str(v)).quantize(1e-9)``: half-even)."""
    return int(Decimal(str(value)).quantize(NANO, rounding=ROUND_HALF_EVEN) * NANOS_PER_USD)


def nanos_to_decimal(nanos: int) -> Decimal:
    """nano-USD → Decimal USD with nine decimals, exactly (for ``Numeric(18, 9)`` columns)."""
    return Decimal(nanos).scaleb(-9)


def format_usd(nanos: int, places: int = 9) -> str:
    """nano-USD as fixed-point USD text: exact with 9 places, rounded half-up with fewer."""
    value = nanos_to_decimal(nanos)
    if places < 9:
        value = value.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)
    return f"{value:.{places}f}"


def usd_number(nanos: int) -> float:
    """nano-USD as a JSON number of USD (the nearest float to the exact amount)."""
    return nanos / NANOS_PER_USD


@lru_cache(maxsize=1024)
def rate(usd_per_million_tokens: float) -> Decimal:
    """A configured price (USD per million tokens) as exact nano-USD per token."""
    return _decimal(usd_per_million_tokens).scaleb(3)  # × 1e9 nano-USD / 1e6 tokens


def round_nanos(amount: Decimal) -> int:
    """An exact decimal nano-USD amount → whole nano-USD, half-up (the one rounding of a cost)."""
    return int(amount.to_integral_value(rounding=ROUND_HALF_UP))


def fraction_of(nanos: int, fraction: float) -> int:
    """``fraction`` (as written, e.g. 0.8) of ``nanos``, rounded down to a whole nano-USD."""
    return int(Decimal(nanos) * _decimal(fraction))
