"""``ChatProvider`` over ``litellm.acompletion`` for every provider string litellm knows
(Anthropic, Bedrock, Vertex, Gemini, ...). The key comes from the model's ``api_key_env`` and
the base URL from config.yaml only; litellm is imported lazily (it is slow to import).

Imports settings, errors and providers.base; litellm at call time.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator
from typing import Any

from gateway.errors import GatewayError, InvalidRequest, UpstreamError, UpstreamTimeout
from gateway.providers.base import CALL_ID_HEADER, CallOptions
from gateway.providers.payload import EXTENSION_PARAMS, SPECS
from gateway.settings import ModelSettings


def _litellm() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    return litellm


def _map_error(err: Exception) -> GatewayError:
    """litellm's OpenAI-style exceptions → the gateway tree (messages never echo credentials)."""
    litellm = _litellm()
    status = getattr(err, "status_code", None)
    if isinstance(err, litellm.Timeout):
        return UpstreamTimeout("upstream timed out", retryable=True)
    if isinstance(err, litellm.RateLimitError):
        return UpstreamError("upstream rate limited the request", upstream_status=429, retryable=True)
    if isinstance(err, litellm.ContextWindowExceededError):
        return InvalidRequest("the prompt is longer than the model's context window",
                              code="context_length_exceeded", param="messages")
    if isinstance(err, litellm.BadRequestError):
        return InvalidRequest("upstream rejected the request", code="upstream_bad_request")
    if isinstance(err, litellm.APIConnectionError):
        return UpstreamError("upstream connection failed", retryable=True)
    if isinstance(status, int):
        return UpstreamError(f"upstream returned HTTP {status}", upstream_status=status,
                             retryable=status == 429 or status >= 500)
    return UpstreamError(f"upstream call failed ({type(err).__name__})", retryable=False)


def _to_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        return obj
    return obj.model_dump(exclude_none=True)  # type: ignore[no-any-return]


def litellm_kwargs(model: ModelSettings, body: dict[str, Any], options: CallOptions) -> dict[str, Any]:
    """``litellm.acompletion``'s keyword arguments: the allow-listed OpenAI parameters (the same
    list ``provider_payload`` applied; taken again here so that no other key can ever become a
    litellm setting such as ``fallbacks``, ``api_base`` or ``metadata``), then the model, URL and
    key from config.yaml, with litellm's own retries off (tiergate's router retries, and bills
    each HTTP call as one ledger row)."""
    allowed = SPECS["litellm"].forward | (EXTENSION_PARAMS & set(model.extra_params))
    kwargs = {k: v for k, v in body.items() if k in allowed}
    kwargs.update(model=model.model, timeout=options.timeout_s or model.timeout_s, num_retries=0,
                  max_retries=0)
    if model.api_base:
        kwargs["api_base"] = model.api_base
    key = model.api_key()
    if key:
        kwargs["api_key"] = key
    headers = dict(options.trace_headers)  # as the lean client sends them: trace context, the call's id
    if options.call_id is not None:
        headers[CALL_ID_HEADER] = options.call_id
    if headers:
        kwargs["extra_headers"] = headers
    return kwargs


class LiteLLMProvider:
    def _kwargs(self, model: ModelSettings, body: dict[str, Any], options: CallOptions) -> dict[str, Any]:
        return litellm_kwargs(model, body, options)

    async def complete(self, model: ModelSettings, body: dict[str, Any],
                       options: CallOptions = CallOptions()) -> dict[str, Any]:
        litellm = _litellm()
        try:
            resp = await litellm.acompletion(**self._kwargs(model, body, options))
        except GatewayError:
            raise
        except Exception as err:
            raise _map_error(err) from None
        return _to_dict(resp)

    async def stream(self, model: ModelSettings, body: dict[str, Any],
                     options: CallOptions = CallOptions()) -> AsyncGenerator[dict[str, Any], None]:
        litellm = _litellm()
        kwargs = self._kwargs(model, body, options)
        try:
            resp = await litellm.acompletion(**kwargs, stream=True, stream_options={"include_usage": True})
            async for chunk in resp:
                yield _to_dict(chunk)
        except GatewayError:
            raise
        except Exception as err:
            raise _map_error(err) from None

    async def aclose(self) -> None:
        return None
