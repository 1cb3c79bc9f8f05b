"""What an upstream call cost, and what the same tokens would have cost on the high tier, in
integer nano-USD (``Price.cost_nanos``: exact per-token rates, one half-up rounding per call).

Price source, in order: the tier's ``price`` override, the model's configured ``price``, and
for ``litellm`` models without a configured price litellm's bundled price map
(``litellm.model_cost``; set LITELLM_LOCAL_MODEL_COST_MAP=True so it is never fetched). The
baseline is the same token counts at the high tier's price. litellm is imported lazily, only
when a litellm model has no configured price. Imports only settings and providers.base.
"""

from __future__ import annotations

import logging
import os
from decimal import Decimal
from functools import lru_cache

from gateway.providers.base import Usage
from gateway.settings import ModelSettings, Price, Settings

log = logging.getLogger("tiergate.ledger")
BASELINE_TIER = "high"


@lru_cache(maxsize=512)
def litellm_price(model: str) -> Price | None:
    """Per-1M-token price from litellm's bundled map, or None if litellm does not know the model."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    info = litellm.model_cost.get(model) or litellm.model_cost.get(model.split("/", 1)[-1])
    if not info or info.get("input_cost_per_token") is None:
        return None
    cached = info.get("cache_read_input_token_cost")
    return Price(input=_per_million(info["input_cost_per_token"]),
                 cached_input=None if cached is None else _per_million(cached),
                 output=_per_million(info.get("output_cost_per_token") or 0))


def _per_million(per_token: object) -> float:
    """litellm's USD per token → USD per million tokens, shifted in decimal (1.5e-07 → 0.15,
    never 0.15000000000000002)."""
    return float(Decimal(str(per_token)).scaleb(6))


def model_price(model: ModelSettings) -> Price:
    if "price" in model.model_fields_set or model.provider != "litellm":
        return model.price
    price = litellm_price(model.model)
    if price is None:
        log.warning("no price for litellm model %r (configure models.<name>.price); costing it at 0",
                    model.model)
        return Price()
    return price


def price_for(settings: Settings, tier: str, model_name: str) -> Price:
    """The price of ``model_name`` when it serves ``tier`` (tier override first)."""
    tier_settings = settings.tiers[tier]  # type: ignore[index]
    if tier_settings.price is not None:
        return tier_settings.price
    try:
        model = settings.models[model_name]
    except KeyError:
        raise KeyError(f"model {model_name!r} is not configured under models:") from None
    return model_price(model)


def baseline_nanos(settings: Settings, usage: Usage) -> int:
    """What ``usage`` would have cost on the high tier's own model, in nano-USD."""
    high = settings.tiers[BASELINE_TIER]  # type: ignore[index]
    return price_for(settings, BASELINE_TIER, high.model).cost_nanos(usage)


def cost_nanos_for(settings: Settings, tier: str, model_name: str, usage: Usage) -> tuple[int, int]:
    """(cost, baseline cost) of one upstream call, in nano-USD."""
    return price_for(settings, tier, model_name).cost_nanos(usage), baseline_nanos(settings, usage)


def preload_prices(settings: Settings) -> dict[str, Price]:
    """Resolve every configured model's price once (imports litellm if a litellm model has no
    configured price). Call at startup, off the event loop (``asyncio.to_thread``), so the first
    request never pays litellm's multi-second import."""
    return {name: model_price(model) for name, model in settings.models.items()}
