"""The verify rule of exact speculative decoding (greedy and rejection sampling, tested statistically) and
prompt lookup, as plain functions (through the engine: tests/engine/test_speculative.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from scipy.stats import chisquare

from engine.sampling import SamplingParams
from engine.speculative import NgramIndex, prompt_lookup, prompt_lookup_match, target_probs, verify


# -- the verify rule ------------------------------------------------------------------------------
def test_greedy_verify_accepts_the_matching_prefix_then_the_target_token() -> None:
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 4, 1, 5]):
        logits[row, best] = 3.0
    greedy = SamplingParams(temperature=0)
    assert verify(logits, [2, 4, 1], greedy) == [2, 4, 1, 5]  # all accepted + bonus
    assert verify(logits, [2, 3, 1], greedy) == [2, 4]  # first mismatch: the target's own token
    assert verify(logits, [0, 4, 1], greedy) == [2]
    assert verify(logits[:1], [], greedy) == [2]
    with pytest.raises(ValueError):
        verify(logits, [2], greedy)


def _first_tokens(trials: int, p_logits: torch.Tensor, q: torch.Tensor | None, draft_of: Any,
                  params: SamplingParams, position: int = 0, rule: Any = verify) -> list[int]:
    """Token emitted at ``position`` over many seeded verify calls (drafts drawn from q, or given)."""
    gen = torch.Generator().manual_seed(1234)
    seen = []
    for _ in range(trials):
        draft = draft_of(gen)
        out = rule(p_logits, draft, params, gen, q)
        if len(out) > position:
            seen.append(out[position])
    return seen


V = 5  # the verify tests' vocabulary
P_LOGITS = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0], [0.1, 1.2, 0.3, -1.0, 0.4], [0.0, 0.0, 0.9, 0.2, -0.3]])
SAMPLED = SamplingParams(temperature=0.9, top_p=1.0)


def _chi2(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=len(probs)).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def _always_accept(logits: torch.Tensor, draft: list[int], params: SamplingParams, gen: Any, q: Any) -> list[int]:
    return [*draft, int(torch.multinomial(target_probs(logits, params)[-1], 1, generator=gen))]


def test_rejection_sampling_preserves_the_target_distribution_with_a_model_draft() -> None:
    p = target_probs(P_LOGITS, SAMPLED)
    q = torch.softmax(torch.tensor([[0.0, 1.5, 0.0, -1.0, 1.0], [1.0, 0.0, 0.0, 0.5, -0.5]]), dim=-1)

    def draw(gen: torch.Generator) -> list[int]:
        return [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]

    first = _first_tokens(6000, P_LOGITS, q, draw, SAMPLED)
    assert len(first) == 6000
    assert _chi2(first, p[0]) > 1e-3
    # the rule is sharp enough to notice a wrong one: accepting every draft yields q, not p
    assert _chi2(_first_tokens(6000, P_LOGITS, q, draw, SAMPLED, rule=_always_accept), p[0]) < 1e-6


def test_rejection_sampling_is_exact_for_a_deterministic_draft_and_later_positions() -> None:
    """Prompt lookup's drafts are fixed tokens (one-hot q). The token at position 1 given that position 0
    accepted the draft must follow the target's row 1."""
    p = target_probs(P_LOGITS, SAMPLED)
    draft = [0, 1]  # row 0 likes token 0, row 1 likes token 1: both often accepted, not always
    first = _first_tokens(6000, P_LOGITS, None, lambda g: draft, SAMPLED)
    assert _chi2(first, p[0]) > 1e-3
    gen = torch.Generator().manual_seed(99)
    second = [out[1] for out in (verify(P_LOGITS, draft, SAMPLED, gen) for _ in range(8000)) if len(out) > 1]
    assert len(second) > 2000
    assert _chi2(second, p[1]) > 1e-3


def test_verify_respects_top_k_filters() -> None:
    params = SamplingParams(temperature=1.0, top_k=2)
    gen = torch.Generator().manual_seed(5)
    for _ in range(300):
        out = verify(P_LOGITS, [2, 4], params, gen)  # neither draft is in its row's top 2
        assert len(out) == 1 and out[0] in (0, 3)


# -- prompt lookup and the controller ---------------------------------------------------------------
def test_prompt_lookup_prefers_the_longest_then_latest_match() -> None:
    assert prompt_lookup([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2) == [9, 2]  # 3-gram [1,2,3] beats 2-gram at 4..5
    assert prompt_lookup([4, 5, 6, 4, 5, 8, 4, 5], 3) == [8, 4, 5]  # equal length: the latest
    assert prompt_lookup([1, 2, 3], 4) == []
    assert prompt_lookup([1, 2, 1], 4, ngram_min=2) == []
    assert prompt_lookup([7, 1, 2, 7], 5) == [1, 2, 7]
    assert prompt_lookup_match([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2) == ([9, 2], 3)
    assert prompt_lookup_match([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, ngram_max=2) == ([7, 1], 2)  # ties: the latest
    assert prompt_lookup_match([1, 2, 3], 4) == ([], 0)




@pytest.mark.parametrize("ngram_max", [1, 3, 4])
def test_the_ngram_index_answers_as_the_scan_does_while_a_sequence_grows(ngram_max: int) -> None:
    gen = torch.Generator().manual_seed(ngram_max)
    for trial in range(20):
        vocab = 3 + trial % 5  # small vocabularies: many repeats, long and tied matches
        tokens = torch.randint(0, vocab, (4,), generator=gen).tolist()
        index = NgramIndex(ngram_max, ngram_min=min(2, ngram_max))
        while len(tokens) < 60:
            for k in (1, 5):
                expected = prompt_lookup_match(tokens, k, ngram_max, min(2, ngram_max))
                assert index.lookup(tokens, k) == expected, (tokens, k)
            tokens += torch.randint(0, vocab, (1 + len(tokens) % 3,), generator=gen).tolist()
