"""A local model's ``engine.quantization``: the provider loads the weights quantized (one engine per
weights and quantization) and answers as the engine quantized the same way does."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from engine import LLMEngine, SamplingParams
from gateway.providers.local import LocalEngineProvider
from gateway.settings import ModelSettings
from tests.gateway.tiny_local_model import write_tiny_model

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("localq") / "tiny-moe")


@pytest.mark.slow  # writes a tiny HF model (transformers) and loads it three times
async def test_quantization_is_applied_per_model(model_dir: Path) -> None:
    provider = LocalEngineProvider(base_dir=model_dir.parent)
    try:
        plain = ModelSettings(provider="local", model=model_dir.name, context_window=128)
        q8 = ModelSettings(provider="local", model=model_dir.name, context_window=128,
                           engine={"quantization": "q8_0"})
        engine_q8 = await provider.engine_for(q8)
        engine_plain = await provider.engine_for(plain)
        assert engine_q8 is not engine_plain and engine_q8 is await provider.engine_for(q8)
        assert "q8_0" in engine_q8.engine.runner.backend.weight_format
        assert "q8_0" not in engine_plain.engine.runner.backend.weight_format
        body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 8}
        resp = await provider.complete(q8, body)
        direct = LLMEngine.from_dir(model_dir, quantization="q8_0")
        prompt = direct.tokenizer.encode_chat(MESSAGES)
        want = direct.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].text
        assert resp["choices"][0]["message"]["content"] == want
    finally:
        await provider.aclose()


def test_unknown_quantization_is_a_config_error() -> None:
    with pytest.raises(ValidationError, match="q8_0"):
        ModelSettings(provider="local", model="m", engine={"quantization": "int3"})
