"""cost_nanos_for: tier override, model price, litellm's bundled price map, baseline at the high
tier; every cost is exact integer nano-USD."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.ledger import cost_nanos_for, price_for
from gateway.ledger.pricing import litellm_price
from gateway.providers.base import Usage
from gateway.settings import settings_from_dict

USAGE = Usage(prompt_tokens=1_000_000, cached_tokens=200_000, completion_tokens=500_000, reasoning_tokens=100)


def _settings(**overrides: Any):  # type: ignore[no-untyped-def]
    models = {
        "cheap": {"provider": "local", "model": "engine/models/demo-moe",
                  "price": {"input": 0.1, "cached_input": 0.05, "output": 0.4}},
        "strong": {"provider": "openai", "model": "gpt-x", "api_base": "http://127.0.0.1:9/v1",
                   "price": {"input": 2.0, "output": 8.0}},
        "gpt4o-mini": {"provider": "litellm", "model": "gpt-4o-mini"},
        "mystery": {"provider": "litellm", "model": "nobody/knows-this-model"},
    }
    tiers = {t: {"model": "cheap"} for t in ("none", "minimal", "low", "medium", "xhigh")}
    tiers["high"] = {"model": "strong"}
    tiers.update(overrides)
    return settings_from_dict({"models": models, "tiers": tiers})


def test_model_price_and_high_tier_baseline() -> None:
    cost, baseline = cost_nanos_for(_settings(), "low", "cheap", USAGE)
    assert cost == 290_000_000  # 0.8M × $0.1 + 0.2M × $0.05 + 0.5M × $0.4 = $0.29, exactly
    # no cached price on "strong": cached tokens are charged at the input price
    assert baseline == 6_000_000_000  # 1M × $2 + 0.5M × $8


def test_tier_price_overrides_model_price() -> None:
    s = _settings(medium={"model": "cheap", "price": {"input": 1.0, "output": 3.0}},
                  high={"model": "cheap", "price": {"input": 10.0, "output": 30.0}})
    cost, baseline = cost_nanos_for(s, "medium", "cheap", USAGE)
    assert cost == 2_500_000_000
    assert baseline == 25_000_000_000
    assert cost_nanos_for(s, "high", "cheap", USAGE)[0] == baseline  # on the high tier cost == baseline


def test_fallback_model_is_priced_as_itself() -> None:
    cost, _ = cost_nanos_for(_settings(), "low", "strong", USAGE)
    assert cost == 6_000_000_000


def test_unknown_model_is_an_error() -> None:
    with pytest.raises(KeyError, match="not configured"):
        cost_nanos_for(_settings(), "low", "nope", USAGE)


# The tests that reach litellm are slow: importing it alone takes ~4 s.
@pytest.mark.slow
def test_litellm_model_without_price_uses_bundled_map() -> None:
    import litellm

    info = litellm.model_cost["gpt-4o-mini"]
    price = price_for(_settings(), "low", "gpt4o-mini")
    assert price.input == pytest.approx(info["input_cost_per_token"] * 1e6)
    assert price.output == pytest.approx(info["output_cost_per_token"] * 1e6)
    assert price.input > 0
    cost, _ = cost_nanos_for(_settings(), "low", "gpt4o-mini", USAGE)
    assert isinstance(cost, int) and cost > 0


@pytest.mark.slow
def test_litellm_model_unknown_to_the_map_costs_zero_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert litellm_price("nobody/knows-this-model") is None
    with caplog.at_level("WARNING", logger="tiergate.ledger"):
        assert cost_nanos_for(_settings(), "low", "mystery", USAGE)[0] == 0
    assert "no price" in caplog.text


@pytest.mark.slow
def test_preload_prices_resolves_every_model() -> None:
    from gateway.ledger import preload_prices

    prices = preload_prices(_settings())
    assert set(prices) == {"cheap", "strong", "gpt4o-mini", "mystery"}
    assert prices["strong"].output == 8.0 and prices["gpt4o-mini"].input > 0 and prices["mystery"].input == 0
