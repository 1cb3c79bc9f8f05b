"""What an upstream call cost, and what the same tokens would have cost on the high tier, in
integer nano-USD (``Price.cost_nanos``: exact per-token rates, one half-up rounding per call).

Price source, in order: the tier's ``price`` override, the model's configured ``price``, and
for ``litellm`` models without a configured price litellm's bundled price map
(``litellm.model_cost``; set LITELLM_LOCAL_MODEL_COST_MAP=True so it is never fetched). The
baseline is the same token counts at the high tier's price. litellm is imported lazily, only
when a litellm model has no configured price. ``build_intent`` prices a call's intent the same
way. Imports only settings, providers.base and ledger.entries.
"""

from __future__ import annotations

import logging
import math
import os
from decimal import Decimal
from functools import lru_cache

from gateway.ledger.entries import CallIntent
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


def call_cost_nanos(settings: Settings, price_tier: str | None, model_name: str, usage: Usage) -> tuple[int, int]:
    """(cost, baseline) of one call at ``price_tier``'s prices; a model called by its own name
    (``price_tier`` None or not a tier) at its own price."""
    if price_tier is not None and price_tier in settings.tiers:
        return cost_nanos_for(settings, price_tier, model_name, usage)
    return model_price(settings.models[model_name]).cost_nanos(usage), baseline_nanos(settings, usage)


def build_intent(settings: Settings, *, call_id: str, request_id: str, tenant_id: str, key_id: str | None,
                 stage: str, tier: str, price_tier: str | None, model_name: str, prompt_tokens: int,
                 max_output_tokens: int) -> CallIntent:
    """The intent of one upstream call about to be made, priced as its ledger row will be: the
    ``estimate`` (prompt + ``ledger.interrupted_output_fraction`` of the output cap) and the
    ``reserved`` worst case (prompt + the whole cap), for ``ledger.interrupted_billing``."""
    estimate_out = math.ceil(max_output_tokens * settings.ledger.interrupted_output_fraction)
    est, est_base = call_cost_nanos(settings, price_tier, model_name, Usage(prompt_tokens, estimate_out))
    res, res_base = call_cost_nanos(settings, price_tier, model_name, Usage(prompt_tokens, max_output_tokens))
    if price_tier is not None and price_tier in settings.tiers:
        price = price_for(settings, price_tier, model_name)
    else:
        price = model_price(settings.models[model_name])
    return CallIntent(id=call_id, request_id=request_id, tenant_id=tenant_id, key_id=key_id, stage=stage, tier=tier,
                      model=model_name, prompt_tokens=prompt_tokens, max_output_tokens=max_output_tokens,
                      estimate_output_tokens=estimate_out,
                      price={"input": price.input, "cached_input": price.cached_input, "output": price.output},
                      estimate_cost_nanos=est, estimate_baseline_nanos=est_base, reserved_cost_nanos=res,
                      reserved_baseline_nanos=res_base)
