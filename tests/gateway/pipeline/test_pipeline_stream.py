"""Streaming a pipeline request: progress as reasoning_content, then the answer as content,
then usage covering every stage."""

from __future__ import annotations

from gateway.pipeline import RequestContext
from tests.gateway.routing_support import plan_of
from tests.gateway.scripted_models import ScriptedProvider, harness, plan_json

CTX = RequestContext(request_id="chatcmpl-s", tenant_id="t1", key_id="k1")
ANSWER = "The final answer, long enough to need more than one content chunk: " + "x" * 80


async def test_chunk_order_and_usage_covering_every_stage() -> None:
    provider = ScriptedProvider(plans=[plan_json(("s1", "a", []), ("s2", "b", ["s1"]))],
                                reviews=[f"VERDICT: accept\nANSWER:\n{ANSWER}"])
    h = harness(provider)
    body = {"model": "auto", "reasoning_effort": "high", "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "q"}]}
    stream = h.pipeline.stream(CTX, body, plan_of(h.settings, body, None))
    chunks = [c async for c in stream]
    kinds = []
    for c in chunks:
        delta = c["choices"][0]["delta"] if c["choices"] else None
        kind = ("usage" if delta is None else "finish" if c["choices"][0]["finish_reason"] else
                "role" if "role" in delta else "reasoning" if "reasoning_content" in delta else "content")
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    assert kinds == ["role", "reasoning", "content", "finish", "usage"]
    assert all(c["id"] == "chatcmpl-s" and c["object"] == "chat.completion.chunk" for c in chunks)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    positions = [reasoning.index(tag) for tag in ("[perceive]", "[plan]", "[execute]", "[review]")]
    assert positions == sorted(positions)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == ANSWER and sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) > 1
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == sum(e.usage.prompt_tokens for e in h.entries)
    assert usage["completion_tokens"] == sum(e.usage.completion_tokens for e in h.entries)
    assert {e.stage for e in h.entries} == {"plan", "execute", "review"}
    finish = chunks[-2]
    assert finish["tiergate"]["verdict"] == "accept" and len(finish["tiergate"]["stages"]) == 4
    assert stream.result is not None and stream.result.answer == ANSWER


async def test_client_leaving_mid_stream_cancels_the_running_stage() -> None:
    provider = ScriptedProvider(step_delay_s=5.0)
    h = harness(provider)
    body = {"model": "auto", "reasoning_effort": "high", "messages": [{"role": "user", "content": "q"}]}
    stream = h.pipeline.stream(CTX, body, plan_of(h.settings, body, None))
    iterator = stream.__aiter__()
    seen = []
    async for chunk in iterator:
        seen.append(chunk)
        if any("[execute]" in (c["choices"][0]["delta"].get("reasoning_content") or "") for c in seen):
            break
    await iterator.aclose()  # type: ignore[attr-defined]  # client went away mid-step
    assert stream.result is None
    # the in-flight step was cancelled before it answered, and that attempt is still a ledger row
    assert [(e.stage, e.status) for e in h.entries] == [("plan", "ok"), ("execute", "cancelled")]
    assert not any(c["choices"] and "usage" in c for c in seen)
