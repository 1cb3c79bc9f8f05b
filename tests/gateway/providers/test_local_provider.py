"""LocalEngineProvider on a tiny random model directory: OpenAI shapes, streaming equals the
non-streamed answer, usage, logprobs, experts per token, errors, cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import AsyncLLMEngine, LLMEngine, SamplingParams
from gateway.errors import InvalidRequest, UpstreamError
from gateway.providers.base import CallOptions, Usage
from gateway.providers.local import LocalEngineProvider
from gateway.settings import ModelSettings
from tests.gateway.tiny_local_model import write_tiny_model

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """A tiny model: thread wake-ups cost more than they save (and CI shares its cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("local") / "tiny-moe")


@pytest.fixture
async def provider(model_dir: Path):
    p = LocalEngineProvider(base_dir=model_dir.parent)
    yield p
    await p.aclose()


@pytest.fixture
def model(model_dir: Path) -> ModelSettings:
    return ModelSettings(provider="local", model=model_dir.name, context_window=128)


def direct(model_dir: Path, n: int, k: int | None = None) -> tuple[list[int], str, int]:
    engine = LLMEngine.from_dir(model_dir)
    prompt = engine.tokenizer.encode_chat([{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hi"}])
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n), experts_per_token=k)[0]
    return out.output_token_ids, out.text, len(prompt)


BODY = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 12}


async def test_complete_returns_an_openai_completion_matching_the_engine(provider, model, model_dir) -> None:
    resp = await provider.complete(model, BODY)
    _tokens, text, n_prompt = direct(model_dir, 12)
    assert resp["object"] == "chat.completion" and resp["id"].startswith("chatcmpl-")
    assert resp["model"] == "tiny"
    choice = resp["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    usage = Usage.from_openai(resp["usage"])
    assert (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, 12)
    assert resp["usage"]["total_tokens"] == n_prompt + 12


async def test_stream_concatenates_to_the_completion_and_ends_with_usage(provider, model) -> None:
    whole = await provider.complete(model, BODY)
    chunks = [c async for c in provider.stream(model, BODY)]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        whole["usage"]["prompt_tokens"], whole["usage"]["completion_tokens"])
    # the second identical prompt reuses the cached prefix blocks
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


async def test_logprobs_and_top_logprobs(provider, model) -> None:
    resp = await provider.complete(model, {**BODY, "max_tokens": 4, "logprobs": True, "top_logprobs": 2})
    content = resp["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        assert entry["bytes"] == list(entry["token"].encode())


async def test_experts_per_token_comes_from_call_options(provider, model, model_dir) -> None:
    outs = {}
    for k in (1, 2):
        resp = await provider.complete(model, {**BODY, "max_tokens": 10}, CallOptions(experts_per_token=k))
        outs[k] = resp["choices"][0]["message"]["content"]
        assert outs[k] == direct(model_dir, 10, k)[1]
    with pytest.raises(InvalidRequest):
        await provider.complete(model, BODY, CallOptions(experts_per_token=99))


async def test_request_errors_map_to_openai_errors(provider, model, model_dir) -> None:
    long_text = "The quick brown fox jumps over the lazy dog. " * 40
    with pytest.raises(InvalidRequest) as err:
        await provider.complete(model, {**BODY, "messages": [{"role": "user", "content": long_text}]})
    assert err.value.code == "context_length_exceeded" and err.value.status == 400
    with pytest.raises(InvalidRequest):
        await provider.complete(model, {**BODY, "top_p": 0})
    with pytest.raises(InvalidRequest):
        await provider.complete(model, {**BODY, "messages": []})
    missing = ModelSettings(provider="local", model="no-such-model")
    with pytest.raises(UpstreamError) as up:
        await provider.complete(missing, BODY)
    assert up.value.retryable is False


async def test_stop_string_cuts_the_answer(provider, model) -> None:
    full = (await provider.complete(model, BODY))["choices"][0]["message"]["content"]
    stop = full[3:5]
    resp = await provider.complete(model, {**BODY, "stop": [stop]})
    assert resp["choices"][0]["finish_reason"] == "stop"
    assert resp["choices"][0]["message"]["content"] == full[:full.index(stop)]


async def test_abandoned_stream_frees_its_blocks_and_engine_is_shared(provider, model) -> None:
    engine: AsyncLLMEngine = await provider.engine_for(model)
    assert await provider.engine_for(model) is engine
    stream = provider.stream(model, {**BODY, "max_tokens": 200})
    async for chunk in stream:
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            break
    await stream.aclose()  # type: ignore[attr-defined]

    def state(e: LLMEngine) -> tuple[int, int, int]:
        return e.num_unfinished_requests, e.allocator.num_free, e.allocator.num_blocks

    for _ in range(100):
        pending, free, total = await engine.run_on_engine_thread(state)
        if pending == 0 and free == total:
            break
        await asyncio.sleep(0.02)
    assert (pending, free) == (0, total)


async def test_concurrent_requests_are_batched_and_independent(provider, model) -> None:
    bodies = [{**BODY, "max_tokens": 6 + i, "messages": [{"role": "user", "content": f"question {i}"}]}
              for i in range(4)]
    together = await asyncio.gather(*(provider.complete(model, b) for b in bodies))
    alone = [await provider.complete(model, b) for b in bodies]
    assert [r["choices"][0]["message"]["content"] for r in together] == \
        [r["choices"][0]["message"]["content"] for r in alone]


# -- through the whole gateway (auth, ledger, tiers) with the official openai SDK -----------------------------

@pytest.mark.integration
def test_openai_sdk_streams_local_model_through_the_gateway(model_dir: Path, tmp_path: Path) -> None:
    import openai
    import sqlalchemy as sa

    from gateway.app import create_app
    from gateway.auth import KeyStore
    from gateway.db.models import LedgerEntryRow
    from gateway.ledger import Ledger
    from gateway.runtime import RuntimeParts
    from gateway.settings import settings_from_dict
    from tests.gateway.gateway_harness import make_database, served

    url, sf, _, raw = make_database(tmp_path)
    local = {"provider": "local", "model": str(model_dir), "context_window": 256,
             "price": {"input": 0.05, "output": 0.2}}
    tiers = {t: {"model": "local/tiny-moe", "engine": {"experts_per_token": 2}} for t in
             ("none", "minimal", "medium", "high", "xhigh")}
    tiers["low"] = {"model": "local/tiny-moe", "engine": {"experts_per_token": 1}}
    settings = settings_from_dict({
        "database": {"url_env": "TIERGATE_TEST_UNSET_DB_URL", "default_url": url},
        "ledger": {"journal_dir": "journal", "flush_interval_ms": 5},
        "models": {"local/tiny-moe": local}, "tiers": tiers}, base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    provider = LocalEngineProvider(settings)
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf), local_provider=provider))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    try:
        with served(app) as base:
            client = openai.OpenAI(base_url=base, api_key=raw, max_retries=0)
            chunks = list(client.chat.completions.create(
                model="local/tiny-moe", messages=msgs, temperature=0, max_tokens=8, stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == direct(model_dir, 8)[1]
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
            low = client.chat.completions.create(model="tier-low", messages=msgs, temperature=0,  # type: ignore[arg-type]
                                                 max_tokens=8)
            assert low.choices[0].message.content == direct(model_dir, 8, k=1)[1]  # the tier's expert count
        assert ledger.flush(10)
        with sf() as s:
            rows = list(s.scalars(sa.select(LedgerEntryRow)))
        expected = sorted([8, len(direct(model_dir, 8, k=1)[0])])
        assert sorted((r.model, r.completion_tokens) for r in rows) == [("local/tiny-moe", n) for n in expected]
    finally:
        ledger.stop()


async def test_timeouts_abort_the_request(provider, model) -> None:
    import time

    from gateway.errors import UpstreamTimeout

    engine: AsyncLLMEngine = await provider.engine_for(model)

    def stall() -> asyncio.Future:  # keep the engine thread busy so the deadline surely passes
        return asyncio.ensure_future(engine.run_on_engine_thread(lambda e: time.sleep(0.4)))

    blocker = stall()
    with pytest.raises(UpstreamTimeout):
        async for _ in provider.stream(model, BODY, CallOptions(timeout_s=0.1)):
            pass
    await blocker
    blocker = stall()
    with pytest.raises(UpstreamTimeout):
        await provider.complete(model, BODY, CallOptions(timeout_s=0.1))
    await blocker
    assert await engine.run_on_engine_thread(lambda e: (e.num_unfinished_requests, e.allocator.num_free)) == (
        0, engine.engine.allocator.num_blocks)


LONG = [{"role": "system", "content": "Repeat the text back, fixing nothing."},
        {"role": "user", "content": "the cat sat on the mat and the cat sat on the hat " * 2}]


async def test_speculative_modes_give_the_plain_greedy_answer(provider, model, model_dir) -> None:
    body = {**BODY, "messages": LONG, "max_tokens": 16}
    plain = (await provider.complete(model, body))["choices"][0]["message"]["content"]
    for mode in ("auto", "prompt_lookup", "self"):
        resp = await provider.complete(model, body, CallOptions(speculative=mode))
        assert resp["choices"][0]["message"]["content"] == plain, mode
    with pytest.raises(InvalidRequest):  # no draft model configured for this model
        await provider.complete(model, body, CallOptions(speculative="draft"))
    drafted = ModelSettings(provider="local", model=model_dir.name, context_window=128, draft_model=model_dir.name)
    resp = await provider.complete(drafted, body, CallOptions(speculative="draft"))
    assert resp["choices"][0]["message"]["content"] == plain


async def test_prefix_cache_hits_are_reported_per_tenant(provider, model) -> None:
    body = {**BODY, "messages": LONG, "max_tokens": 2}
    first = await provider.complete(model, body, CallOptions(cache_salt="tenant-a"))
    again = await provider.complete(model, body, CallOptions(cache_salt="tenant-a"))
    other = await provider.complete(model, body, CallOptions(cache_salt="tenant-b"))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # B never reads A's blocks


@pytest.mark.integration
def test_cached_tokens_reach_the_client_and_the_bill_per_tenant(model_dir: Path, tmp_path: Path) -> None:
    """Through the gateway: tenant A's repeat shows cached_tokens and is billed at cached_input; tenant B
    sending the same prompt gets no hit; ``tiergate.speculative`` is accepted and keeps the answer."""
    from decimal import Decimal

    import openai
    import sqlalchemy as sa

    from gateway.app import create_app
    from gateway.auth import KeyStore, generate_key, hash_key
    from gateway.db.models import LedgerEntryRow
    from gateway.db.queries import add_api_key, create_tenant
    from gateway.ledger import Ledger
    from gateway.runtime import RuntimeParts
    from gateway.settings import settings_from_dict
    from tests.gateway.gateway_harness import make_database, served

    url, sf, tenant_a, raw_a = make_database(tmp_path)
    raw_b = generate_key()
    with sf() as s, s.begin():
        tenant_b = create_tenant(s, "globex").id
        add_api_key(s, tenant_b, raw_b, hash_key(raw_b), name="b")
    price = {"input": 1.0, "cached_input": 0.1, "output": 2.0}
    local = {"provider": "local", "model": str(model_dir), "context_window": 256, "price": price}
    tiers = {t: {"model": "local/tiny-moe"} for t in ("none", "minimal", "low", "medium", "high", "xhigh")}
    settings = settings_from_dict({
        "database": {"url_env": "TIERGATE_TEST_UNSET_DB_URL", "default_url": url},
        "ledger": {"journal_dir": "journal", "flush_interval_ms": 5},
        "models": {"local/tiny-moe": local}, "tiers": tiers}, base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    provider = LocalEngineProvider(settings)
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf), local_provider=provider))
    try:
        with served(app) as base:
            a = openai.OpenAI(base_url=base, api_key=raw_a, max_retries=0)
            b = openai.OpenAI(base_url=base, api_key=raw_b, max_retries=0)
            kw: dict = dict(model="local/tiny-moe", messages=LONG, temperature=0, max_tokens=4)
            a1 = a.chat.completions.create(**kw)
            a2 = a.chat.completions.create(**kw, extra_body={"tiergate": {"speculative": "prompt_lookup"}})
            b1 = b.chat.completions.create(**kw, extra_body={"tiergate": {"speculative": True}})
            with pytest.raises(openai.BadRequestError):
                a.chat.completions.create(**kw, extra_body={"tiergate": {"speculative": "medusa"}})
        assert a1.choices[0].message.content == a2.choices[0].message.content == b1.choices[0].message.content
        cached = [r.usage.prompt_tokens_details.cached_tokens for r in (a1, a2, b1)]  # type: ignore[union-attr]
        assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0
        assert ledger.flush(10)
        with sf() as s:
            rows = sorted(s.scalars(sa.select(LedgerEntryRow)), key=lambda r: r.created_at)
        assert [(r.tenant_id, r.cached_tokens) for r in rows] == [(tenant_a, 0), (tenant_a, cached[1]),
                                                                   (tenant_b, 0)]
        p, n = a2.usage.prompt_tokens, a2.usage.completion_tokens  # type: ignore[union-attr]
        expected = (Decimal(p - cached[1]) * Decimal("1.0") + Decimal(cached[1]) * Decimal("0.1")
                    + Decimal(n) * Decimal("2.0")) / Decimal(1_000_000)
        assert rows[1].cost_usd == expected
        assert rows[1].cost_usd < rows[0].cost_usd
    finally:
        ledger.stop()


async def test_kv_dtype_int8_from_model_settings(provider, model, model_dir) -> None:
    import torch

    int8 = ModelSettings(provider="local", model=model_dir.name, context_window=128, kv_dtype="int8")
    resp = await provider.complete(int8, {**BODY, "max_tokens": 4})
    assert resp["usage"]["completion_tokens"] == 4
    assert (await provider.engine_for(int8)).engine.runner.kv_caches[0][0].dtype == torch.int8
    assert (await provider.engine_for(model)).engine.runner.kv_caches[0][0].dtype == torch.float32  # its own engine


def test_a_tier_drafting_without_a_draft_model_is_a_config_error(tmp_path: Path) -> None:
    from gateway.settings import ConfigError, settings_from_dict

    local = {"provider": "local", "model": "m"}
    tiers = {t: {"model": "m"} for t in ("none", "minimal", "low", "medium", "high", "xhigh")}
    settings_from_dict({"models": {"m": local}, "tiers": {**tiers, "low": {"model": "m", "engine": {
        "speculative": "auto"}}}}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match="draft_model"):
        settings_from_dict({"models": {"m": local}, "tiers": {**tiers, "low": {"model": "m", "engine": {
            "speculative": "draft"}}}}, base_dir=tmp_path)
    with pytest.raises(ConfigError):
        settings_from_dict({"models": {"m": local}, "tiers": {**tiers, "low": {"model": "m", "engine": {
            "speculative": "medusa"}}}}, base_dir=tmp_path)
