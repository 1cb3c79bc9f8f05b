"""What each provider type may receive: the last allow-list before a request leaves the gateway.

The request body reaching this module was re-encoded from the validated wire model
(``gateway.schemas.ChatCompletionRequest.forwardable``) or built by the gateway itself (pipeline
stages). ``provider_payload`` cuts it down to the fields the model's provider type takes:

- ``forward``: sent to the provider as they are;
- ``ignore``: accepted from clients but never sent (they do not change the answer, e.g. the
  client's ``metadata``, or the provider does not take them);
- anything else: a 400 naming the parameter and the model (``unsupported_parameter``), before
  any upstream call is made — e.g. ``tools`` for the bundled engine.

The sampling extensions ``top_k``/``min_p``/``repetition_penalty`` go only to models that list
them under ``extra_params``. Media parts: the bundled engine takes text only; for the others an
``image_url``/``file`` must be inline (``data:``) unless the model sets ``remote_media: true``,
because a URL would be fetched by the upstream (or by litellm, on the gateway's own host) from
wherever the client points it.

Imports settings, errors and the schemas' field names only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest
from gateway.settings import ModelSettings

EXTENSION_PARAMS: frozenset[str] = frozenset({"top_k", "min_p", "repetition_penalty"})

_CORE = frozenset({"messages", "temperature", "top_p", "n", "max_tokens", "max_completion_tokens", "stop",
                   "seed"})
_OPENAI_ONLY = frozenset({"user", "safety_identifier", "prompt_cache_key", "service_tier", "modalities",
                          "reasoning_effort", "verbosity", "tools", "tool_choice", "parallel_tool_calls",
                          "functions", "function_call", "response_format", "prediction", "presence_penalty",
                          "frequency_penalty", "logit_bias", "logprobs", "top_logprobs"})
_NOT_FORWARDED = frozenset({"metadata", "store", "tiergate"})  # tiergate: the gateway's own options


@dataclass(frozen=True)
class ProviderSpec:
    forward: frozenset[str]
    ignore: frozenset[str]
    text_only: bool = False


SPECS: dict[str, ProviderSpec] = {
    "openai": ProviderSpec(forward=_CORE | _OPENAI_ONLY, ignore=_NOT_FORWARDED),
    # litellm translates OpenAI parameters for each provider; fields it would take as its own
    # settings (metadata, fallbacks, api_base, ...) never reach it.
    "litellm": ProviderSpec(
        forward=_CORE | (_OPENAI_ONLY - {"safety_identifier", "prompt_cache_key", "service_tier", "modalities",
                                         "prediction"}),
        ignore=_NOT_FORWARDED | {"safety_identifier", "prompt_cache_key", "service_tier", "modalities"}),
    "local": ProviderSpec(
        forward=_CORE | {"logprobs", "top_logprobs", "top_k"},
        ignore=_NOT_FORWARDED | {"user", "safety_identifier", "prompt_cache_key", "service_tier", "modalities",
                                 "parallel_tool_calls", "reasoning_effort", "verbosity"},
        text_only=True),
}


def provider_payload(name: str, model: ModelSettings, body: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``body`` that model ``name`` (configured as ``model``) may receive."""
    spec = SPECS[model.provider]
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key in spec.forward or (key in EXTENSION_PARAMS and key in model.extra_params):
            out[key] = value
        elif key == "response_format" and value == {"type": "text"}:
            continue  # plain text is what every model answers anyway
        elif key not in spec.ignore:
            raise InvalidRequest(f"'{key}' is not supported by model '{name}'", param=key,
                                 code="unsupported_parameter")
    _check_media(name, model, spec, out.get("messages") or [])
    return out


def _check_media(name: str, model: ModelSettings, spec: ProviderSpec, messages: list[dict[str, Any]]) -> None:
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type")
            param = f"messages[{i}].content[{j}]"
            if kind in ("text", "refusal"):
                continue
            if spec.text_only:
                raise InvalidRequest(f"model '{name}' takes text content only; got a '{kind}' part",
                                     param=param, code="unsupported_parameter")
            url = (part.get("image_url") or {}).get("url") if kind == "image_url" else None
            if url is not None and not url.startswith("data:") and not model.remote_media:
                raise InvalidRequest(f"model '{name}' takes images inline only (a data: URL); "
                                     "remote URLs are off for it (models.<name>.remote_media)",
                                     param=f"{param}.image_url.url", code="unsupported_parameter")
