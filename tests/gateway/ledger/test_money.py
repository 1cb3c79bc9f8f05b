"""Money in integer nano-USD: a price's cost of a usage (exact rates, one half-up rounding per
call), the conversions at the edges (config/request USD in; headers, JSON and database decimals
out), and litellm's per-token prices shifted to per-million without binary noise."""

from __future__ import annotations

import random
from decimal import Decimal

import pytest

from gateway.ledger.pricing import _per_million
from gateway.money import (
    decimal_to_nanos,
    format_usd,
    fraction_of,
    legacy_usd_to_nanos,
    nanos_to_decimal,
    rate,
    usd_number,
    usd_to_nanos,
)
from gateway.providers.base import Usage
from gateway.settings import Price


def test_whole_rates_are_exact() -> None:
    price = Price(input=0.1, cached_input=0.05, output=0.4)  # 100 / 50 / 400 nano-USD per token
    assert rate(0.1) == Decimal(100)  # never 100.00000000000001: the decimal that was configured
    usage = Usage(prompt_tokens=1_000_000, cached_tokens=200_000, completion_tokens=500_000)
    assert price.cost_nanos(usage) == 800_000 * 100 + 200_000 * 50 + 500_000 * 400 == 290_000_000
    assert price.cost_nanos(usage) == price.nanos(1_000_000, 200_000, 500_000)


def test_fractional_rates_are_summed_exactly_then_rounded_once_half_up() -> None:
    price = Price(input=0.0375, output=0.0001)  # 37.5 and 0.1 nano-USD per token
    assert price.nanos(1, 0, 0) == 38  # 37.5 rounds half-up
    assert price.nanos(2, 0, 0) == 75  # exact, not 38 + 38
    assert price.nanos(0, 0, 4) == 0  # 0.4 rounds down
    assert price.nanos(0, 0, 5) == 1  # 0.5 rounds up
    # one rounding per call, not per token class: 37.5 + 0.5 = 38 exactly
    assert price.nanos(1, 0, 5) == 38
    tiny = Price(input=0.0001, output=0.0004)  # 0.1 and 0.4 nano-USD per token
    assert tiny.nanos(4, 0, 1) == 1  # 0.4 + 0.4 = 0.8 → 1 (rounding each part would give 0)


def test_cached_tokens_use_the_cached_price_or_the_input_price() -> None:
    assert Price(input=2.0, cached_input=1.25, output=10.0).nanos(10, 4, 1) == 6 * 2000 + 4 * 1250 + 10_000
    assert Price(input=2.0, output=10.0).nanos(10, 4, 1) == 10 * 2000 + 10_000


@pytest.mark.parametrize("seed", range(5))
def test_cost_never_decreases_with_more_tokens_so_a_worst_case_hold_covers_the_call(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(500):
        price = Price(input=rng.choice([0.0123, 0.5, 2.5001, 0.0375]),
                      output=rng.choice([0.0457, 2.0, 10.0003, 0.0001]))
        prompt, out = rng.randint(0, 5000), rng.randint(0, 5000)
        worst = price.nanos(prompt + rng.randint(0, 100), 0, out + rng.randint(0, 100))
        assert price.nanos(prompt, 0, out) <= worst
        assert isinstance(worst, int)


def test_usd_in_is_the_decimal_as_written_rounded_half_up() -> None:
    assert usd_to_nanos(0.1) == 100_000_000  # a parsed float means the decimal it was written as
    assert usd_to_nanos("0.000000001") == 1
    assert usd_to_nanos(Decimal("0.0000000005")) == 1 and usd_to_nanos("0.0000000004") == 0
    assert usd_to_nanos(12) == 12 * 10**9
    with pytest.raises(TypeError):
        usd_to_nanos(True)


def test_usd_out_is_exact() -> None:
    assert format_usd(0) == "0.000000000"
    assert format_usd(123_456_789) == "0.123456789"
    assert format_usd(-1_000) == "-0.000001000"
    assert format_usd(10**17 + 1) == "100000000.000000001"  # beyond a float's digits, still exact
    assert format_usd(1_500, 6) == "0.000002" and format_usd(1_499, 6) == "0.000001"
    assert nanos_to_decimal(123_456_789) == Decimal("0.123456789")
    assert usd_number(250_000_000) == 0.25


def test_database_decimals_and_old_journal_floats_convert_exactly() -> None:
    for n in (0, 1, 999_999_999, 123_456_789_012):
        assert decimal_to_nanos(nanos_to_decimal(n)) == n
    assert decimal_to_nanos(None) == 0
    assert decimal_to_nanos(0.3) == 300_000_000  # SQLite can hand back a float SUM
    # the old writer stored Decimal(str(v)).quantize(1e-9): half-even on the 10th decimal
    assert legacy_usd_to_nanos(0.000123456789) == 123_457
    assert legacy_usd_to_nanos(0.1 + 0.2) == 300_000_000
    assert legacy_usd_to_nanos(2.5e-9) == 2 and legacy_usd_to_nanos(3.5e-9) == 4


def test_fractions_of_limits_round_down_exactly() -> None:
    assert fraction_of(12_500_000_000, 0.8) == 10_000_000_000
    assert fraction_of(3, 0.5) == 1


def test_litellm_per_token_prices_become_clean_per_million_prices() -> None:
    assert _per_million(1.5e-07) == 0.15  # 1.5e-07 * 1e6 is 0.15000000000000002 in floats
    assert _per_million("2.5e-06") == 2.5
    assert rate(_per_million(1.5e-07)) == Decimal(150)
