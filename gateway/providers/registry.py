"""Which ``ChatProvider`` serves each configured model.

One provider instance per kind per process: the OpenAI-compatible client (one pooled HTTP
session), the litellm adapter, and the local engine provider (passed in, or built lazily from
``gateway.providers.local`` on first use). Built by the app lifespan, never at import time.
Imports settings, errors and sibling provider modules only.
"""

from __future__ import annotations

import importlib
from typing import Any

from gateway.errors import ModelNotFound, UpstreamError
from gateway.providers.base import ChatProvider
from gateway.providers.litellm_provider import LiteLLMProvider
from gateway.providers.openai_compat import OpenAICompatProvider, SessionFactory
from gateway.settings import ModelSettings, Settings


class ProviderRegistry:
    def __init__(self, settings: Settings, *, http_session_factory: SessionFactory | None = None,
                 local_provider: ChatProvider | None = None) -> None:
        self.settings = settings
        self._http = OpenAICompatProvider(http_session_factory)
        self._litellm = LiteLLMProvider()
        self._local = local_provider

    def model(self, name: str) -> ModelSettings:
        try:
            return self.settings.models[name]
        except KeyError:
            raise ModelNotFound(f"The model '{name}' does not exist", param="model") from None

    def for_model(self, name: str) -> ChatProvider:
        kind = self.model(name).provider
        if kind == "openai":
            return self._http
        if kind == "litellm":
            return self._litellm
        return self._local_provider()

    @property
    def loaded_local(self) -> ChatProvider | None:
        """The local engine provider if one has been built (the metrics read its engines)."""
        return self._local

    def _local_provider(self) -> ChatProvider:
        if self._local is None:
            try:
                module: Any = importlib.import_module("gateway.providers.local")
                self._local = module.LocalEngineProvider(self.settings)
            except (ImportError, AttributeError, TypeError) as err:
                raise UpstreamError(f"the local engine provider is unavailable ({type(err).__name__})",
                                    retryable=False) from None
        assert self._local is not None
        return self._local

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._litellm.aclose()
        if self._local is not None:
            await self._local.aclose()
