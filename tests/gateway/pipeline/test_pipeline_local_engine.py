"""The pipeline's execute stage on real tensors: the low tier is the in-process local MoE engine
(a tiny random Mixtral) behind the real registry and router, the high tier is scripted (as a
hosted frontier model would be). Steps run on the engine with the tier's experts per token; at
xhigh several paths stream real logprobs, and pruning decisions use them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.pipeline import RequestContext
from gateway.providers.base import CallOptions
from gateway.providers.local import LocalEngineProvider
from gateway.settings import ModelSettings, Settings, settings_from_dict
from tests.gateway.routing_support import plan_of
from tests.gateway.scripted_models import Harness, ScriptedProvider, harness, plan_json
from tests.gateway.tiny_local_model import write_tiny_model

CTX = RequestContext(request_id="chatcmpl-local", tenant_id="t1", key_id="k1")
MSGS = [{"role": "user", "content": "What is two plus two?"}]


class SplitProvider:
    """scripted/* models answer from the script; everything else runs on the local engine."""

    def __init__(self, scripted: ScriptedProvider, local: LocalEngineProvider) -> None:
        self.scripted, self.local = scripted, local
        self.local_calls: list[tuple[str, dict[str, Any], CallOptions]] = []

    def _pick(self, model: ModelSettings, body: dict[str, Any], options: CallOptions) -> Any:
        if model.model.startswith("scripted/"):
            return self.scripted
        self.local_calls.append((model.model, body, options))
        return self.local

    async def complete(self, model: ModelSettings, body: dict[str, Any],
                       options: CallOptions = CallOptions()) -> dict[str, Any]:
        return await self._pick(model, body, options).complete(model, body, options)

    def stream(self, model: ModelSettings, body: dict[str, Any],
               options: CallOptions = CallOptions()) -> AsyncIterator[dict[str, Any]]:
        return self._pick(model, body, options).stream(model, body, options)

    async def aclose(self) -> None:
        await self.local.aclose()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_model(tmp_path_factory.mktemp("pipeline-local") / "tiny-moe")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # RoPE: room for step prompts carrying the request
    (path / "config.json").write_text(json.dumps(config))
    return path


def settings_for(model_dir: Path) -> Settings:
    low = {"model": "tiny", "engine": {"experts_per_token": 1}, "max_output_tokens": 6}
    high = {"model": "big", "engine": {"experts_per_token": 2, "thinking_budget_tokens": 12},
            "max_output_tokens": 32}
    return settings_from_dict({
        "models": {"tiny": {"provider": "local", "model": str(model_dir), "context_window": 1024,
                            "price": {"input": 0.05, "output": 0.2}},
                   "big": {"provider": "local", "model": "scripted/big", "price": {"input": 2.5, "output": 10}}},
        "tiers": {"none": low, "minimal": low, "low": low, "medium": {**low, "engine": {"experts_per_token": 2}},
                  "high": high, "xhigh": high},
        "pipeline": {"max_review_rounds": 1, "xhigh_paths": 3, "prune_after_tokens": 2, "max_steps": 3}})


def split_harness(model_dir: Path, scripted: ScriptedProvider) -> tuple[Harness, SplitProvider]:
    settings = settings_for(model_dir)
    split = SplitProvider(scripted, LocalEngineProvider(settings))
    return harness(split, settings), split  # type: ignore[arg-type]


@pytest.mark.slow
async def test_steps_run_on_the_local_moe_engine(tiny_model: Path) -> None:
    scripted = ScriptedProvider(plans=[plan_json(("s1", "add two and two", []), ("s2", "say the sum", ["s1"]))])
    h, split = split_harness(tiny_model, scripted)
    try:
        result = await h.pipeline.run(CTX, {"messages": MSGS, "temperature": 0},
                                      plan_of(h.settings, {"messages": MSGS, "reasoning_effort": "high"},
                                                        None))
    finally:
        await split.aclose()
    assert [(e.stage, e.model) for e in h.entries] == [("plan", "big"), ("execute", "tiny"),
                                                       ("execute", "tiny"), ("review", "big")]
    assert [o.experts_per_token for _, _, o in split.local_calls] == [1, 1]
    for entry in h.entries[1:3]:  # real token counts from the engine
        assert entry.usage.prompt_tokens > 20 and 1 <= entry.usage.completion_tokens <= 6
    step1 = result.tiergate_object()["stages"][1]
    assert step1["step_id"] == "s1" and step1["cost_usd"] > 0
    # s2's prompt carried s1's real output
    s2_prompt = split.local_calls[1][1]["messages"][-1]["content"]
    assert "Result of step s1:" in s2_prompt
    assert result.verdict == "accept"


@pytest.mark.slow
async def test_xhigh_paths_stream_real_logprobs_from_the_engine(tiny_model: Path) -> None:
    scripted = ScriptedProvider(plans=[plan_json(("s1", "add two and two", []))])
    h, split = split_harness(tiny_model, scripted)
    body = {"messages": MSGS, "reasoning_effort": "xhigh"}
    try:
        result = await h.pipeline.run(CTX, body, plan_of(h.settings, body, None))
    finally:
        await split.aclose()
    paths = [c for c in split.local_calls if c[1].get("logprobs")]
    assert len(paths) == 3 and sorted(c[1]["seed"] for c in paths) == [0, 1, 2]
    execute = [e for e in h.entries if e.stage == "execute"]
    assert len(execute) == 3 and all(e.model == "tiny" for e in execute)
    assert all(e.usage.completion_tokens >= 1 for e in execute)  # billed, pruned or not
    info = result.tiergate_object()
    assert info["paths"] == 3 and info["pruned_paths"] == sum(e.status == "cancelled" for e in execute)
