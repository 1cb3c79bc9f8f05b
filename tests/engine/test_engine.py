"""LLMEngine on a tiny random Mixtral saved in HF format and loaded by our engine: batched,
paged, chunked, preempted and prefix-cached runs give the tokens of full recomputation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.engine import EngineError, InvalidExperts, LLMEngine, PromptTooLong
from engine.model import CausalLM, load_model
from engine.sampling import SamplingParams
from tests.engine.hf_tiny import build_hf_model, save_hf_model

PROMPTS = [[(7 * i + 3 * j) % 150 + 5 for j in range(3 + 5 * i)] for i in range(5)]  # 3..23 tokens


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matrices: thread wake-ups cost more than they save (and CI shares its cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[CausalLM, object]:
    path = save_hf_model(build_hf_model("mixtral", seed=1), tmp_path_factory.mktemp("mixtral"))
    return load_model(Path(path))


def make_engine(tiny: tuple[CausalLM, object], **kw: object) -> LLMEngine:
    model, config = tiny
    opts: dict = dict(block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=16)
    opts.update(kw)
    return LLMEngine(model, config, eos_token_ids=(), **opts)


@torch.inference_mode()
def oracle(model: CausalLM, prompt: list[int], n: int, k: int | None = None) -> tuple[list[int], list[float]]:
    """Greedy decoding by full recomputation, no cache; also the chosen tokens' logprobs."""
    ids = list(prompt)
    lps = []
    for _ in range(n):
        logits = model(torch.tensor(ids), torch.arange(len(ids)), None, None, k)[-1]
        tok = int(logits.argmax())
        lps.append(float(torch.log_softmax(logits.float(), -1)[tok]))
        ids.append(tok)
    return ids[len(prompt):], lps


GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_batched_paged_chunked_generation_equals_recomputation(tiny) -> None:
    engine = make_engine(tiny)
    outs = engine.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.output_token_ids == oracle(tiny[0], prompt, 8)[0]
        assert out.finish_reason == "length" and out.num_output_tokens == 8
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_preemption_resumes_with_identical_greedy_and_seeded_output(tiny) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=123, max_tokens=10)
    roomy = make_engine(tiny)
    alone = [roomy.generate([p], seeded)[0].output_token_ids for p in PROMPTS]
    tight = make_engine(tiny, num_blocks=14, max_num_seqs=5)
    outs = tight.generate(PROMPTS, seeded)
    assert tight.scheduler.num_preemptions > 0
    assert [o.output_token_ids for o in outs] == alone
    greedy = tight.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    assert [o.output_token_ids for o in greedy] == [oracle(tiny[0], p, 10)[0] for p in PROMPTS]


def test_per_request_experts_per_token_in_one_batch(tiny) -> None:
    engine = make_engine(tiny)
    ks = [1, 2, 4, None, 3]
    ids = [engine.add_request(p, GREEDY, experts_per_token=k) for p, k in zip(PROMPTS, ks, strict=True)]
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.output_token_ids
    for rid, p, k in zip(ids, PROMPTS, ks, strict=True):
        assert final[rid] == oracle(tiny[0], p, 8, k)[0], f"k={k}"
    # k=1 really changes the computation for some prompt
    assert any(oracle(tiny[0], p, 8, 1)[0] != oracle(tiny[0], p, 8, 2)[0] for p in PROMPTS)
    with pytest.raises(InvalidExperts):
        engine.add_request([1, 2], GREEDY, experts_per_token=5)
    with pytest.raises(InvalidExperts):
        engine.add_request([1, 2], GREEDY, experts_per_token=0)


def test_logprobs_match_the_model_distribution(tiny) -> None:
    engine = make_engine(tiny)
    p = SamplingParams(temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    rid = engine.add_request(PROMPTS[2], p)
    got = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == rid
            got.extend(o.new_logprobs)
    tokens, lps = oracle(tiny[0], PROMPTS[2], 5)
    assert [g.token_id for g in got] == tokens
    assert [g.logprob for g in got] == pytest.approx(lps, abs=1e-4)
    assert all(len(g.top) == 3 and g.top[0][0] == g.token_id for g in got)


def test_stop_token_ids_and_max_tokens_finish_reasons(tiny) -> None:
    engine = make_engine(tiny)
    want = oracle(tiny[0], PROMPTS[1], 8)[0]
    stop_at = want[3]
    first = want.index(stop_at)
    out = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop_at,)))[0]
    assert out.finish_reason == "stop" and out.output_token_ids == want[:first + 1]
    eos_engine = LLMEngine(tiny[0], tiny[1], eos_token_ids=(stop_at,), block_size=4, num_blocks=64)
    out = eos_engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.finish_reason == "stop"
    out = eos_engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.output_token_ids == want


def test_abort_frees_blocks_and_other_requests_continue(tiny) -> None:
    engine = make_engine(tiny)
    a = engine.add_request(PROMPTS[4], SamplingParams(temperature=0, max_tokens=50))
    b = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    engine.step()
    assert engine.allocator.num_free < engine.allocator.num_blocks
    assert engine.abort(a) and not engine.abort(a)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == b
            if o.finished:
                done[b] = o.output_token_ids
    assert done[b] == oracle(tiny[0], PROMPTS[0], 8)[0]
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_prefix_cache_hits_are_reported_and_do_not_change_output(tiny) -> None:
    engine = make_engine(tiny, max_num_batched_tokens=64)
    shared = PROMPTS[4][:16]
    first = engine.generate([[*shared, 9]], GREEDY)[0]
    second = engine.generate([[*shared, 11]], GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 16
    assert second.output_token_ids == oracle(tiny[0], [*shared, 11], 8)[0]
    # K/V computed with another expert count are not reused
    other_k = engine.generate([[*shared, 11]], GREEDY, experts_per_token=1)[0]
    assert other_k.num_cached_tokens == 0
    assert other_k.output_token_ids == oracle(tiny[0], [*shared, 11], 8, 1)[0]


def test_context_limits(tiny) -> None:
    big = make_engine(tiny, max_model_len=100_000, num_blocks=1024)
    assert big.limits.max_model_len == tiny[1].max_position_embeddings
    engine = make_engine(tiny, max_model_len=20)
    with pytest.raises(PromptTooLong):
        engine.add_request(list(range(1, 21)), GREEDY)
    with pytest.raises(EngineError):
        engine.add_request([], GREEDY)
    out = engine.generate([list(range(1, 16))], SamplingParams(temperature=0, max_tokens=100))[0]
    assert out.finish_reason == "length" and out.num_output_tokens == 5


class CharTokenizer:
    """Token i decodes to one printable character; token 5 is multi-byte split over two tokens."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_text_streams_and_stop_strings_truncate(tiny) -> None:
    model, config = tiny
    engine = LLMEngine(model, config, tokenizer=CharTokenizer(), eos_token_ids=(), block_size=4, num_blocks=64)
    free_run = engine.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=12))[0]
    text = free_run.text
    assert len(text) == 12
    stop = text[5:7]
    cut = text.index(stop)
    rid = engine.add_request(PROMPTS[3], SamplingParams(temperature=0, max_tokens=12, stop=(stop,)))
    streamed = ""
    last = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == rid
            streamed += o.new_text
            last = o
    assert last is not None and last.finish_reason == "stop"
    assert streamed == last.text == text[:cut]


def test_bench_weight_bytes_count_every_parameter_when_all_experts_are_active(tiny) -> None:
    from engine.bench_traffic import decode_weight_bytes

    model, config = tiny
    total = sum(p.numel() for p in model.parameters())
    embedding_rows_not_read = (config.vocab_size - 1) * config.hidden_size
    assert decode_weight_bytes(config, config.num_experts) == 4 * (total - embedding_rows_not_read)
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size * 4
    assert decode_weight_bytes(config, 1) == decode_weight_bytes(config, 2) - per_expert * config.num_hidden_layers


def test_bench_step_bytes_grow_with_the_experts_a_batch_touches(tiny) -> None:
    from engine.bench_traffic import (
        decode_weight_bytes,
        expert_coverage,
        shared_weight_bytes,
        step_weight_bytes,
    )

    _, config = tiny
    e, k = config.num_experts, 2
    assert expert_coverage(e, k, 1) == pytest.approx(k / e)
    assert expert_coverage(e, e, 1) == 1.0
    assert step_weight_bytes(config, k, 1) == pytest.approx(decode_weight_bytes(config, k))
    every_expert = decode_weight_bytes(config, e)
    assert decode_weight_bytes(config, k) < step_weight_bytes(config, k, 4) < step_weight_bytes(config, k, 64)
    assert step_weight_bytes(config, k, 64) == pytest.approx(every_expert, rel=1e-3)
    # what every token reads: the same whichever k, and what is left with no expert at all
    per_expert = decode_weight_bytes(config, 2) - decode_weight_bytes(config, 1)
    assert shared_weight_bytes(config, 1) == shared_weight_bytes(config, k) == decode_weight_bytes(config, 1) - per_expert


def test_bench_working_set_ceilings_scale_the_traffic_ceiling_by_each_working_sets_rate() -> None:
    """Part (c)'s ceilings at each step's own working set: with one rate for both they are the ceilings
    the bench prints before them; a slower rate for the bigger working set lowers both by that much
    (the multiply-add bound aside), and the bandwidth is asked for each step's size in GiB."""
    import re

    from engine.bench import working_set_ceilings

    one_bytes, many_bytes, most, ceiling = 264e6, 823e6, 16, 16 * 264 / 823
    shared, one = 76e6, 70.0
    streamed = one_bytes * one
    slow_macs = 1e15  # the products never bound: the second ceiling is then the traffic one
    asked: list[float] = []

    def flat(gib: float) -> float:
        asked.append(gib)
        return 16e9

    line = working_set_ceilings(flat, one_bytes, many_bytes, most, 4.1, ceiling, (shared, slow_macs, streamed, one))
    assert asked == [pytest.approx(one_bytes / (1 << 30)), pytest.approx(many_bytes / (1 << 30))]
    m = re.search(r"264 MB 16.0 GB/s, 823 MB 16.0 GB/s\): weight-traffic ceiling ([\d.]+)x, achieved (\d+)% of it "
                  r"\(target >= 90%: BELOW target\); with the 16-token products as above ([\d.]+)x", line)
    assert m is not None, line
    assert float(m.group(1)) == pytest.approx(ceiling, abs=0.005) == float(m.group(3))

    def cached(gib: float) -> float:  # the small working set 1.2x faster: the large one's ceiling 1.2x lower
        return 19.2e9 if gib < 0.5 else 16e9

    line = working_set_ceilings(cached, one_bytes, many_bytes, most, 4.1, ceiling, (shared, slow_macs, streamed, one))
    m = re.search(r"weight-traffic ceiling ([\d.]+)x, achieved (\d+)% of it \(target >= 90%: meets target\); "
                  r"with the 16-token products as above ([\d.]+)x", line)
    assert m is not None, line
    assert float(m.group(1)) == pytest.approx(ceiling / 1.2, abs=0.005) == float(m.group(3))
    assert int(m.group(2)) == round(100 * 4.1 / (ceiling / 1.2))
    # products bound by the multiply-adds: the second ceiling is the lower one
    line = working_set_ceilings(cached, one_bytes, many_bytes, most, 4.1, ceiling, (shared, 50e9, streamed, one))
    m = re.search(r"weight-traffic ceiling ([\d.]+)x, .* as above ([\d.]+)x", line)
    assert m is not None and float(m.group(2)) < float(m.group(1))


async def test_async_engine_streams_concurrently_and_cleans_up(tiny) -> None:
    import asyncio

    from engine.async_engine import AsyncLLMEngine, EngineDeadError

    aengine = AsyncLLMEngine(make_engine(tiny))
    try:
        async def collect(prompt: list[int], k: int | None) -> list[int]:
            tokens: list[int] = []
            async for out in aengine.generate(prompt, GREEDY, k):
                tokens.extend(out.new_token_ids)
            return tokens

        got = await asyncio.gather(*(collect(p, k) for p, k in zip(PROMPTS, [1, 2, 1, 2, 3], strict=True)))
        assert got == [oracle(tiny[0], p, 8, k)[0] for p, k in zip(PROMPTS, [1, 2, 1, 2, 3], strict=True)]
        async for _ in aengine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=500)):
            break  # leaving early aborts the request
        for _ in range(100):
            if await aengine.run_on_engine_thread(lambda e: e.num_unfinished_requests) == 0:
                break
            await asyncio.sleep(0.01)
        free = await aengine.run_on_engine_thread(lambda e: e.allocator.num_free)
        assert free == aengine.engine.allocator.num_blocks
        slow = aengine.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True))
        await anext(slow)
        aengine.shutdown()  # stops after the current step; the live stream is failed, not left hanging
        with pytest.raises(EngineDeadError):
            async for _ in slow:
                pass
    finally:
        aengine.shutdown()


def test_bench_decode_rate_runs_every_stream_to_completion(tiny) -> None:
    from engine.bench import engine_decode_tokens_per_s

    engine = make_engine(tiny)
    assert engine_decode_tokens_per_s(engine, PROMPTS[:4], 5) > 0
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free == engine.allocator.num_blocks
