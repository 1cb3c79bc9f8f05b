"""xhigh multi-path execution: falling-confidence paths are cancelled mid-stream, billed and
shown; survivors are voted."""

from __future__ import annotations

from gateway.money import usd_to_nanos
from gateway.pipeline import RequestContext
from gateway.pipeline.prune import ConfidenceTracker, PathOutcome, PathPruner, vote
from tests.gateway.routing_support import plan_of
from tests.gateway.scripted_models import ScriptedProvider, harness, plan_json

CTX = RequestContext(request_id="chatcmpl-x", tenant_id="t1", key_id="k1")
BODY = {"model": "auto", "reasoning_effort": "xhigh", "messages": [{"role": "user", "content": "6*7?"}]}
WORDS = ["so", "the", "product", "of", "six", "and", "seven", "is", "clearly", "equal", "to", "forty", "two"]  # 13 words


def test_confidence_tracker_detects_a_falling_window() -> None:
    t = ConfidenceTracker(window=2)
    for lp in (-0.1, -0.1, -0.5, -0.5, -1.0, -1.0):
        t.add(lp)
    assert t.checkpoints == [-0.1, -0.5, -1.0] and t.falling(2)
    steady = ConfidenceTracker(window=2)
    for lp in (-0.1, -0.5, -0.3, -0.3, -0.2, -0.2):
        steady.add(lp)
    assert not steady.falling(2)


def test_pruner_never_cuts_the_last_survivor_nor_before_the_threshold() -> None:
    p = PathPruner(2, prune_after_tokens=8, window=2)
    for lp in (-0.1, -0.2, -0.3, -0.4, -0.5, -0.6):
        p.trackers[0].add(lp)
    assert not p.should_prune(0)  # only 6 tokens
    p.trackers[0].add(-0.7)
    p.trackers[0].add(-0.8)
    p.trackers[1].add(-0.1)
    assert p.should_prune(0) and p.pruned == [True, False]
    for lp in (-1.0,) * 4 + (-2.0,) * 4 + (-3.0,) * 4:
        p.trackers[1].add(lp)
    assert not p.should_prune(1)  # the only path left


def test_vote_takes_the_majority_then_the_more_confident() -> None:
    def o(i: int, text: str, mean: float, pruned: bool = False) -> PathOutcome:
        return PathOutcome(i, text, 5, mean, mean, pruned)
    assert vote([o(0, "x\n42", -1.0), o(1, "y\n43", -0.1), o(2, "z\n42.", -2.0)]).index == 0
    assert vote([o(0, "42", -1.0), o(1, "43", -0.1), o(2, "44", -0.01, pruned=True)]).index == 1


async def test_falling_path_is_cancelled_billed_and_shown() -> None:
    steady = [-0.1] * len(WORDS)
    falling = [-0.1 * (i // 4 + 1) for i in range(len(WORDS))]  # window means -0.1, -0.2, -0.3 ...
    provider = ScriptedProvider(
        plans=[plan_json(("s1", "multiply six by seven", []))],
        paths={0: (" ".join(WORDS), steady), 1: (" ".join([*WORDS[:-2], "forty", "three"]), falling),
               2: (" ".join(WORDS), [-0.2] * len(WORDS))},
        reviews=["VERDICT: accept\nANSWER:\n42"])
    h = harness(provider)
    ex = plan_of(h.settings, BODY, None)
    result = await h.pipeline.run(CTX, BODY, ex)
    streams = [c for c in provider.calls if c.role == "step"]
    assert len(streams) == 3 and all(c.model == "scripted/small" for c in streams)
    assert all(c.body["logprobs"] is True for c in streams)
    assert provider.closed_early == [1]  # the upstream stream was closed mid-generation
    execute = [e for e in h.entries if e.stage == "execute"]
    cancelled = [e for e in execute if e.status == "cancelled"]
    assert len(execute) == 3 and len(cancelled) == 1
    assert 8 <= cancelled[0].usage.completion_tokens < len(WORDS)  # billed for what it streamed
    assert cancelled[0].cost_nanos > 0
    info = result.tiergate_object()
    assert info["paths"] == 3 and info["pruned_paths"] == 1
    assert usd_to_nanos(info["pruned_cost_usd"]) == cancelled[0].cost_nanos
    assert [s["path"] for s in info["stages"] if s["status"] == "cancelled"] == [1]
    review_prompt = next(c for c in provider.calls if c.role == "review").user_text
    assert "forty two" in review_prompt and "forty three" not in review_prompt
