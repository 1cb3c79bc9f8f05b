"""Exact speculative decoding through the engine: the controller, and greedy identity with plain decoding for
every proposer on every model family, through batched, chunked, block-crossing runs whose KV cache rollback must
leave nothing behind (the verify rule and prompt lookup alone: tests/engine/test_speculative_verify.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.engine import InvalidSpeculative, LLMEngine
from engine.model import CausalLM, load_model
from engine.sampling import SamplingParams
from engine.spec_control import SpecConfig, SpecCosts, SpecTotals
from tests.engine.hf_tiny import FAMILIES, build_hf_model, save_hf_model
from tests.engine.test_speculative_verify import _chi2

GREEDY = SamplingParams(temperature=0, max_tokens=24)
# copy-friendly prompts (repeated phrases) so prompt lookup has something to propose, and a plain one
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
    [20 + (i % 6) for i in range(22)],
    [(7 * j) % 150 + 3 for j in range(9)],
]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- greedy identity through the engine, every proposer and family -------------------------------------
class _Models(dict[str, tuple[CausalLM, Any]]):
    """Tiny random models per family, built on first use (each test pays only for its own)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory

    def __missing__(self, family: str) -> tuple[CausalLM, Any]:
        path = save_hf_model(build_hf_model(family, seed=3), self.factory.mktemp(family))
        self[family] = load_model(Path(path))
        return self[family]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> _Models:
    return _Models(tmp_path_factory)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    """A different small model with the same vocabulary: mostly wrong drafts (the rejection path)."""
    path = save_hf_model(build_hf_model("llama", seed=17, num_hidden_layers=1), tmp_path_factory.mktemp("draft"))
    return load_model(Path(path))[0]


def _engine(model: CausalLM, config: Any, **kw: Any) -> LLMEngine:
    opts: dict[str, Any] = dict(block_size=4, num_blocks=96, max_num_seqs=4, max_num_batched_tokens=16,
                                eos_token_ids=())
    opts.update(kw)
    return LLMEngine(model, config, **opts)


def _run(engine: LLMEngine, mode: str | None, params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = engine.generate(PROMPTS, params, speculative=mode)
    assert engine.allocator.num_free == engine.allocator.num_blocks  # rollback leaves no block behind
    for d in engine.speculator.drafters.values():
        assert d.allocator.num_free == d.allocator.num_blocks
    return [o.output_token_ids for o in outs]


def _proposers(family: str) -> list[str]:
    return ["prompt_lookup", "draft", "draft-other"] + (["self"] if family not in ("llama", "qwen2") else [])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_equals_plain_decoding_for_every_proposer(family: str, family_models: Any,
                                                                   other_draft: CausalLM) -> None:
    model, config = family_models[family]
    plain = _run(_engine(model, config), None)
    for proposer in _proposers(family):
        # "draft": the target itself as the draft model (always right: long accepted runs across blocks);
        # "draft-other": an unrelated model (mostly rejected)
        draft = other_draft if proposer == "draft-other" else model
        engine = _engine(model, config, draft_model=draft,
                         speculative=SpecConfig(probe_verifies=10_000))  # never pause: verify every step
        mode = proposer.removesuffix("-other")
        got = _run(engine, mode)
        assert got == plain, f"{family}/{proposer}"
        totals = engine.speculator.totals[mode]
        assert totals.drafted > 0, f"{family}/{proposer} never speculated"
        if proposer in ("draft", "prompt_lookup"):
            assert totals.accepted > 0, f"{family}/{proposer} never accepted a draft"
        if proposer == "draft":  # the target drafting for itself is always right
            assert totals.accepted == totals.drafted


def test_prefix_cache_after_speculation_holds_only_accepted_tokens(family_models: Any) -> None:
    """Blocks published while verifying drafts are reused by a later request, which must decode the same."""
    model, config = family_models["mixtral"]
    engine = _engine(model, config, draft_model=model)
    first = engine.generate([PROMPTS[0]], GREEDY, speculative="draft")[0]
    follow = [*PROMPTS[0], *first.output_token_ids[:17]]
    again = engine.generate([follow], SamplingParams(temperature=0, max_tokens=8), speculative="draft")[0]
    assert again.num_cached_tokens >= 28
    plain = _engine(model, config).generate([follow], SamplingParams(temperature=0, max_tokens=8))[0]
    assert again.output_token_ids == plain.output_token_ids


def test_sampled_speculation_runs_and_respects_stop_rules(family_models: Any) -> None:
    model, config = family_models["qwen3_moe"]
    engine = _engine(model, config, draft_model=model)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=20, logprobs=True, top_logprobs=2)
    for mode in ("prompt_lookup", "draft", "self"):
        outs = engine.generate(PROMPTS, params, speculative=mode)
        for o in outs:
            assert o.num_output_tokens == 20 and o.finish_reason == "length"
            assert len(o.output_token_ids) == 20
        assert engine.allocator.num_free == engine.allocator.num_blocks


def test_min_tokens_and_stop_tokens_hold_under_speculation(family_models: Any) -> None:
    model, config = family_models["llama"]
    plain = _engine(model, config).generate(PROMPTS, GREEDY)
    stop = plain[0].output_token_ids[5]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop,))
    spec = _engine(model, config, draft_model=model).generate(PROMPTS, params, speculative="draft")
    ref = _engine(model, config).generate(PROMPTS, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in ref]
    assert spec[0].finish_reason == "stop" and spec[0].output_token_ids[-1] == stop


def test_speculative_modes_are_validated(family_models: Any) -> None:
    model, config = family_models["llama"]
    engine = _engine(model, config)
    with pytest.raises(InvalidSpeculative):
        engine.add_request(PROMPTS[0], GREEDY, speculative="self")  # dense model
    with pytest.raises(InvalidSpeculative):
        engine.add_request(PROMPTS[0], GREEDY, speculative="draft")  # no draft model
    with pytest.raises(InvalidSpeculative):
        engine.add_request(PROMPTS[0], GREEDY, speculative="medusa")
    with pytest.raises(ValueError):
        SpecConfig(default="sometimes")


def test_prefix_cache_is_isolated_per_salt(family_models: Any) -> None:
    """Tenant B never hits tenant A's blocks; A hits its own."""
    model, config = family_models["mixtral"]
    engine = _engine(model, config, max_num_batched_tokens=64)
    prompt = PROMPTS[1]
    a1 = engine.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    b1 = engine.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    a2 = engine.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert a1.num_cached_tokens == 0 and b1.num_cached_tokens == 0
    assert a2.num_cached_tokens == 20
    assert a1.output_token_ids == b1.output_token_ids == a2.output_token_ids


@pytest.mark.slow
def test_sampled_engine_output_follows_the_exact_model_distribution(tmp_path: Path) -> None:
    """Through the whole engine (batched, paged, drafts verified by rejection sampling): the third sampled
    and third sampled tokens' distributions over 2,000 seeded requests equal the model's exact marginals,
    summed over every path before them, for every proposer. An 8-token vocabulary makes the sums exact."""
    model, config = load_model(save_hf_model(build_hf_model("mixtral", seed=5, vocab_size=8), tmp_path / "t"))
    draft = load_model(save_hf_model(build_hf_model("llama", seed=6, vocab_size=8, num_hidden_layers=1),
                                     tmp_path / "d"))[0]
    prompt = [1, 2, 3, 1, 2]
    temperature = 1.3
    with torch.inference_mode():
        def probs(ids: list[int]) -> torch.Tensor:
            logits = model(torch.tensor(ids), torch.arange(len(ids)), None, None, None)[-1]
            return torch.softmax(logits.double() / temperature, dim=-1)

        first = probs(prompt)
        second = torch.zeros(8, dtype=torch.float64)
        third = torch.zeros(8, dtype=torch.float64)
        for a in range(8):
            after_a = probs([*prompt, a])
            second += first[a] * after_a
            for b in range(8):
                third += first[a] * after_a[b] * probs([*prompt, a, b])
    n = 2000
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
    for mode in ("prompt_lookup", "draft", "self"):
        engine = _engine(model, config, draft_model=draft, num_blocks=512, max_num_seqs=64,
                         max_num_batched_tokens=512, speculative=SpecConfig(probe_verifies=10_000))
        outs = engine.generate([prompt] * n, params, speculative=mode)
        for position, exact in ((1, second), (2, third)):
            pvalue = _chi2([o.output_token_ids[position] for o in outs], exact.float())
            assert pvalue > 1e-3, (mode, position, pvalue)
        totals = engine.speculator.totals[mode]
        assert 0 < totals.accepted < totals.drafted  # both the accept and the residual path ran


def _measured(plain: float, verify: dict[int, float], draft_token: float = 0.0, proposer: str = "draft") -> SpecCosts:
    costs = SpecCosts()
    for _ in range(3):
        costs.record_plain(plain)
        for k, seconds in verify.items():
            costs.record_verify(seconds, k)
    if draft_token:
        costs.record_draft(proposer, draft_token * 4, 4)
    return costs


def test_new_requests_start_plain_while_a_proposer_does_not_pay_engine_wide(family_models: Any) -> None:
    model, config = family_models["mixtral"]
    engine = _engine(model, config, draft_model=model)
    spec = engine.speculator
    # drafting a token costs as much as a plain step, and half the drafts fail at once: it never pays
    spec.costs = _measured(1.0, {1: 1.3, 4: 1.8}, draft_token=1.0)
    acceptance = spec._acceptance("draft", 0)
    for n in range(40):
        acceptance.record(4, n % 2)
    ids = [engine.add_request(PROMPTS[0], GREEDY, speculative="draft") for _ in range(3)]
    assert all(engine._seqs[i].spec.active(0) for i in ids)  # no engine-wide evidence yet
    spec.totals["draft"] = SpecTotals(verifies=40)
    ids = [engine.add_request(PROMPTS[0], GREEDY, speculative="draft") for _ in range(16)]
    states = [engine._seqs[i].spec for i in ids]
    assert [st.active(0) for st in states].count(True) == 2 and states[7].active(0) and states[15].active(0)
    assert states[7].probing and not states[6].probing  # one in eight drafts once, whatever the estimate says
    ids = [engine.add_request(PROMPTS[0], GREEDY, speculative="draft") for _ in range(32)]
    probes = [n for n, i in enumerate(ids) if engine._seqs[i].spec.active(0)]
    # each probe that finds it still not paying puts the next twice as far off: after 8, 16, then 32 skipped
    assert probes == [15] and spec.totals["draft"].next_probe == 64
    spec.costs = _measured(1.0, {1: 1.3, 4: 1.8}, draft_token=0.1)  # a cheap draft, mostly accepted: it pays
    for _ in range(40):
        acceptance.record(4, 4)
    assert all(engine._seqs[engine.add_request(PROMPTS[0], GREEDY, speculative="draft")].spec.active(0)
               for _ in range(8))


def test_prompt_lookup_drafts_where_its_match_predicts_acceptance(family_models: Any) -> None:
    """Per step and per matched n-gram length: a sequence whose last token matched alone (a bucket whose drafts
    failed) decodes plainly; one whose last four tokens matched (a bucket whose drafts held) drafts long."""
    model, config = family_models["mixtral"]
    engine = _engine(model, config, speculative=SpecConfig(engine_probe_every=1000), max_num_batched_tokens=64)
    spec = engine.speculator
    spec.costs = _measured(1.0, {1: 1.2, 4: 1.5, 8: 2.0})
    spec.totals["prompt_lookup"] = SpecTotals(verifies=100)
    for _ in range(30):
        spec._acceptance("prompt_lookup", 1).record(4, 0)
        spec._acceptance("prompt_lookup", 4).record(8, 8)
    weak = engine.add_request([9, 1, 2, 3, 4, 5, 6, 7, 8, 9], GREEDY, speculative="prompt_lookup")
    strong = engine.add_request([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], GREEDY, speculative="prompt_lookup")
    engine.step()  # prefill both: each samples its first token
    for rid in (weak, strong):  # make the last token continue the pattern the test wants
        seq = engine._seqs[rid]
        seq.token_ids[-1] = 9 if rid == weak else 4
    spec.propose(engine.scheduler.running)
    assert engine._seqs[weak].spec_token_ids == []
    assert engine._seqs[strong].spec_token_ids == [5, 6, 7, 8, 1, 2, 3, 4]
    assert spec.totals["prompt_lookup"].declined == 1


def test_a_model_drafter_starts_only_where_its_catch_up_pays_back(family_models: Any) -> None:
    """A drafter that has not seen a sequence must first run its prompt: worth it for a long answer, not for a
    three-token one."""
    model, config = family_models["mixtral"]
    engine = _engine(model, config, draft_model=model, max_num_batched_tokens=64)
    spec = engine.speculator
    spec.costs = _measured(1.0, {1: 1.2, 2: 1.3, 4: 1.5}, draft_token=0.2)
    spec.costs.record_catch_up("draft", 22.0, 22)  # a prompt token costs the drafter a plain step
    spec.totals["draft"] = SpecTotals(verifies=100)
    for _ in range(40):
        spec._acceptance("draft", 0).record(4, 2)  # two tokens hold, the third never
    short = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4), speculative="draft")
    long = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=300), speculative="draft")
    engine.step()  # prefill both
    spec.propose(engine.scheduler.running)
    assert engine._seqs[short].spec_token_ids == [] and not engine._seqs[short].spec.active(2)
    assert len(engine._seqs[long].spec_token_ids) == 2
    assert spec.drafters["draft"].lag(long, engine._seqs[long].token_ids) == 1  # it caught up


def test_a_drafter_that_caught_up_records_a_bound_on_its_drafting_cost(family_models: Any) -> None:
    """A sequence's first proposal runs the drafter over the prompt before drafting: that call bounds the
    drafting's cost per token (it cannot be read as free); the next proposal, keeping up, measures it."""
    model, config = family_models["mixtral"]
    engine = _engine(model, config, draft_model=model, max_num_batched_tokens=64)
    spec = engine.speculator
    spec.costs = _measured(1.0, {1: 1.2, 2: 1.3, 4: 1.5})  # no drafting measured yet
    rid = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=300), speculative="draft")
    engine.step()  # prefill
    spec.propose(engine.scheduler.running)  # behind by the prompt: caught up, then drafted
    drafted = len(engine._seqs[rid].spec_token_ids)
    assert drafted > 0 and "draft" not in spec.costs.draft_token
    bound = spec.costs.draft_token_bound["draft"]
    assert bound > 0 and spec.costs.draft_token_cost("draft") == bound
    engine.step()  # verify
    spec.propose(engine.scheduler.running)  # keeping up now: drafting measured alone
    assert engine._seqs[rid].spec_token_ids  # still learning: it drafts at its heuristic length
    assert 0 < spec.costs.draft_token_cost("draft") == spec.costs.draft_token["draft"] < bound


def test_verify_and_drafting_steps_take_the_decode_fast_path(family_models: Any) -> None:
    """On the native backend a verify step (the last token and its drafts as decode rows of one sequence) and
    a drafter's steps run through the one-call decode step: `forward` runs only the prefills, and the greedy
    check reads the step's argmax."""
    model, config = family_models["mixtral"]
    engine = _engine(model, config, draft_model=model, speculative=SpecConfig(probe_verifies=10_000))
    if engine.runner.backend.name != "native":
        pytest.skip("the native kernels are not built here")
    plain = _run(_engine(model, config), None)
    for mode in ("prompt_lookup", "self", "draft"):
        decode_rows: list[bool] = []  # per forward: whether it ran one-token rows (what the fast path covers)
        backends = {id(b): b for b in [engine.runner.backend, engine.speculator.drafter(mode).backend]}
        for backend in backends.values():
            real = backend.forward

            def counting(input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any, *args: Any, _real: Any = real,
                         _seen: list[bool] = decode_rows, **kw: Any) -> torch.Tensor:
                _seen.append(not ctx.is_prefill)
                return _real(input_ids, positions, ctx, *args, **kw)

            backend.forward = counting  # type: ignore[method-assign]
        assert _run(engine, mode) == plain
        assert engine.speculator.totals[mode].drafted > 0
        for backend in backends.values():
            del backend.forward
        assert decode_rows and not any(decode_rows), mode  # prefills only


def _logprobs(engine: LLMEngine, params: SamplingParams, mode: str | None) -> list[list[Any]]:
    ids = [engine.add_request(p, params, speculative=mode) for p in PROMPTS]
    got: dict[str, list[Any]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].extend(o.new_logprobs)
    return [got[i] for i in ids]


def test_greedy_logprobs_under_speculation_equal_plain_decoding(family_models: Any) -> None:
    """The greedy check reads the step's argmax, yet asked-for logprobs still come from the verify rows' logits."""
    model, config = family_models["mixtral"]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=True, top_logprobs=2)
    plain = _logprobs(_engine(model, config), params, None)
    spec = _engine(model, config, speculative=SpecConfig(probe_verifies=10_000))
    got = _logprobs(spec, params, "prompt_lookup")
    assert spec.speculator.totals["prompt_lookup"].accepted > 0
    for a, b in zip(plain, got, strict=True):
        assert len(a) == len(b) == 16
        for x, y in zip(a, b, strict=True):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
