"""`LocalEngineProvider`: the in-process `ChatProvider` for ``provider: local`` models.

OpenAI chat body → chat template → token ids → the bundled engine (one `AsyncLLMEngine`
per model directory, loaded on first use off the event loop, its step loop on a
background thread) → OpenAI ``chat.completion`` dicts or ``chat.completion.chunk``
streams with usage (prefix-cache hits reported as cached tokens), logprobs/top_logprobs
and finish reasons. The expert count comes from `CallOptions`, never from the client; so do
the speculative mode (tier config, or the client's allow-listed ``tiergate.speculative``) and
the prefix-cache salt (the tenant, so cached blocks never cross tenants).

Imports the engine's public API, provider base, settings and errors only; nothing of
FastAPI or the database.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

from engine import (
    AsyncLLMEngine,
    EngineError,
    LLMEngine,
    PromptTooLong,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from gateway.errors import GatewayError, InvalidRequest, UpstreamError, UpstreamTimeout
from gateway.providers.base import CallOptions, Usage
from gateway.settings import ModelSettings, Settings

EngineFactory = Callable[[Path, ModelSettings], AsyncLLMEngine]


def default_engine_factory(path: Path, model: ModelSettings) -> AsyncLLMEngine:
    """``model.draft_model`` arrives resolved (absolute) from `LocalEngineProvider`."""
    import torch

    return AsyncLLMEngine(LLMEngine.from_dir(path, max_model_len=model.context_window,
                                             draft_model_dir=model.draft_model,
                                             kv_dtype=torch.int8 if model.kv_dtype == "int8" else None,
                                             quantization=model.engine.quantization))


class LocalEngineProvider:
    def __init__(self, settings: Settings | None = None, *, base_dir: str | Path | None = None,
                 engine_factory: EngineFactory = default_engine_factory) -> None:
        self._settings = settings if base_dir is None else None
        self._base_dir = Path(base_dir if base_dir is not None else (settings.base_dir if settings else "."))
        self._factory = engine_factory
        # (model, draft model, KV dtype, quantization): one engine each
        self._engines: dict[tuple[Path, Path | None, str, str], AsyncLLMEngine] = {}
        self._lock = threading.Lock()

    # -- engines ------------------------------------------------------------------------------
    def model_path(self, model: ModelSettings) -> Path:
        if self._settings is not None:  # beside the config file, else the bundled model of that name
            return self._settings.resolve_asset(model.model)
        p = Path(model.model)
        return (p if p.is_absolute() else self._base_dir / p).resolve()

    def _engine_sync(self, model: ModelSettings) -> AsyncLLMEngine:
        path = self.model_path(model)
        draft = (self.model_path(model.model_copy(update={"model": model.draft_model}))
                 if model.draft_model is not None else None)
        key = (path, draft, model.kv_dtype, model.engine.quantization)
        with self._lock:
            engine = self._engines.get(key)
            if engine is None or not engine.is_running:
                if not ((path / "config.json").is_file() or (path.suffix == ".gguf" and path.is_file())):
                    raise UpstreamError(f"local model {str(path)!r} is neither a directory with a config.json "
                                        "nor a .gguf file", retryable=False)
                if draft is not None:
                    if not (draft / "config.json").is_file():
                        raise UpstreamError(f"draft model directory {str(draft)!r} has no config.json",
                                            retryable=False)
                    model = model.model_copy(update={"draft_model": str(draft)})
                engine = self._factory(path, model)
                self._engines[key] = engine
            return engine

    def loaded_engines(self) -> dict[str, AsyncLLMEngine]:
        """The engines loaded so far, by model directory name (for the metrics)."""
        with self._lock:
            return {key[0].name: engine for key, engine in self._engines.items()}

    async def engine_for(self, model: ModelSettings) -> AsyncLLMEngine:
        """The model's engine, loading it on a worker thread the first time."""
        return await asyncio.to_thread(self._engine_sync, model)

    async def aclose(self) -> None:
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            await asyncio.to_thread(engine.shutdown)

    # -- ChatProvider -------------------------------------------------------------------------
    async def complete(self, model: ModelSettings, body: dict[str, Any],
                       options: CallOptions = CallOptions()) -> dict[str, Any]:
        engine = await self.engine_for(model)
        prompt, params = _prepare(engine, body)
        text, last, logprobs = "", None, []
        try:
            async with asyncio.timeout(options.timeout_s):
                async for out in _generate(engine, prompt, params, options):
                    text += out.new_text
                    logprobs.extend(out.new_logprobs)
                    last = out
        except TimeoutError:
            raise UpstreamTimeout("the local engine timed out") from None
        assert last is not None
        choice: dict[str, Any] = {
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": _logprobs_dict(engine, logprobs) if params.wants_logprobs else None,
            "finish_reason": last.finish_reason,
        }
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or model.model, "choices": [choice],
                "usage": _usage(last).to_openai(), "system_fingerprint": None}

    async def stream(self, model: ModelSettings, body: dict[str, Any],
                     options: CallOptions = CallOptions()) -> AsyncGenerator[dict[str, Any], None]:
        """Chunks: role, content deltas, one with finish_reason, then one with usage and no choices."""
        engine = await self.engine_for(model)
        prompt, params = _prepare(engine, body)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": body.get("model") or model.model, "system_fingerprint": None}

        def chunk(delta: dict[str, Any], finish: str | None = None, lps: list[TokenLogprob] | None = None
                  ) -> dict[str, Any]:
            lp = _logprobs_dict(engine, lps) if lps is not None else None
            return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

        outputs = _generate(engine, prompt, params, options)
        loop = asyncio.get_running_loop()
        deadline = None if options.timeout_s is None else loop.time() + options.timeout_s

        async def next_output() -> RequestOutput | None:
            try:
                async with asyncio.timeout_at(deadline):  # one deadline for the whole answer
                    return await anext(outputs, None)
            except TimeoutError:
                raise UpstreamTimeout("the local engine timed out") from None

        try:
            out = await next_output()  # validation errors surface before anything is sent
            yield chunk({"role": "assistant", "content": ""})
            while out is not None:
                lps = out.new_logprobs if params.wants_logprobs else None
                if out.new_text or lps:
                    yield chunk({"content": out.new_text}, lps=lps)
                if out.finished:
                    yield chunk({}, out.finish_reason)
                    yield {**head, "choices": [], "usage": _usage(out).to_openai()}
                    return
                out = await next_output()
        finally:
            await outputs.aclose()


async def _generate(engine: AsyncLLMEngine, prompt: list[int], params: SamplingParams,
                    options: CallOptions) -> AsyncGenerator[RequestOutput, None]:
    try:
        async for out in engine.generate(prompt, params, options.experts_per_token,
                                         speculative=options.speculative, cache_salt=options.cache_salt):
            yield out
    except PromptTooLong as err:
        raise InvalidRequest(str(err), param="messages", code="context_length_exceeded") from None
    except GatewayError:
        raise
    except (EngineError, ValueError) as err:
        raise InvalidRequest(str(err)) from None
    except RuntimeError as err:
        raise UpstreamError(f"the local engine failed: {err}", retryable=False) from None


def _text_of(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise InvalidRequest("message content must be a string or a list of text parts", param="messages")


def _prepare(engine: AsyncLLMEngine, body: dict[str, Any]) -> tuple[list[int], SamplingParams]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    if (body.get("n") or 1) != 1:
        raise InvalidRequest("the local engine serves n=1 only", param="n")
    convo = [{"role": m.get("role", "user"), "content": _text_of(m.get("content"))} for m in messages
             if isinstance(m, dict)]
    try:
        prompt = engine.tokenizer.encode_chat(convo, add_generation_prompt=True)
    except ValueError as err:  # the chat template refused the conversation
        raise InvalidRequest(f"chat template: {err}", param="messages") from None
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    temperature = body.get("temperature")
    top_p = body.get("top_p")
    try:
        params = SamplingParams(
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=int(body.get("top_k") or 0),
            seed=body.get("seed"),
            max_tokens=body.get("max_completion_tokens") or body.get("max_tokens"),
            stop=stop,
            logprobs=bool(body.get("logprobs")),
            top_logprobs=int(body.get("top_logprobs") or 0),
        )
    except (TypeError, ValueError) as err:
        raise InvalidRequest(f"invalid sampling parameters: {err}") from None
    return prompt, params


def _usage(out: RequestOutput) -> Usage:
    return Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                 cached_tokens=out.num_cached_tokens)


def _logprobs_dict(engine: AsyncLLMEngine, lps: list[TokenLogprob]) -> dict[str, Any]:
    tok = engine.tokenizer

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tok.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}
