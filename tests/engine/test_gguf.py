"""GGUF checkpoints: a tiny random HF model saved as safetensors and written to GGUF the way llama.cpp's
converter does (`tests.engine.gguf_tiny`) loads to the same logits, per family and tensor type, on the plain
model and on the native kernels; the tokenizer comes from the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine import quant
from engine.engine import LLMEngine
from engine.gguf import GGUFError, load_gguf_model
from engine.model import load_model
from engine.quant import QuantizedWeights
from engine.runner import pick_backend
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.engine.gguf_tiny import hf_to_gguf
from tests.engine.hf_tiny import PagedSequences, build_hf_model

pytestmark = pytest.mark.slow  # ~50 s in all on a busy 2-core machine (transformers models, GGUF writes)

DEMO = Path(__file__).resolve().parents[2] / "engine" / "models" / "demo-moe"
PROMPT = torch.tensor([5, 17, 42, 99, 3, 150, 8, 4000, 77])
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama", "qwen2")
_DEFAULT_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def _hf_dir(tmp_path: Path, family: str) -> Path:
    """The tiny HF model (the llama one has Llama 3 RoPE scaling: a rope_freqs tensor in its GGUF)."""
    overrides = dict(vocab_size=4096)
    model = build_hf_model(family, seed=3, **overrides)
    out = tmp_path / f"hf-{family}"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, out / name)
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(PROMPT, torch.arange(len(PROMPT)))


def _native_logits(model: torch.nn.Module) -> torch.Tensor:
    """Prefill then two decode steps through the runner's backend (native where the kernels are built)."""
    backend = pick_backend(model)
    caches = model.allocate_kv_cache(16, 4, torch.float32)  # type: ignore[operator]
    paged = PagedSequences(16, 4, seed=1)
    rows = []
    with torch.inference_mode():
        ctx, pos = paged.step({0: len(PROMPT) - 2})
        rows.append(backend.forward(PROMPT[:-2], pos, ctx, caches))
        for t in (len(PROMPT) - 2, len(PROMPT) - 1):
            ctx, pos = paged.step({0: 1})
            rows.append(backend.forward(PROMPT[t : t + 1], pos, ctx, caches))
    return torch.cat(rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_gives_the_safetensors_logits(tmp_path: Path, family: str) -> None:
    hf_dir = _hf_dir(tmp_path, family)
    path = hf_to_gguf(hf_dir, tmp_path / "model.gguf", "F32")
    ref, cfg = load_model(hf_dir)
    model, gcfg = load_gguf_model(path)
    assert gcfg.model_type == cfg.model_type and gcfg.num_experts == cfg.num_experts
    assert gcfg.norm_topk_prob == cfg.norm_topk_prob and gcfg.tie_word_embeddings == cfg.tie_word_embeddings
    assert model.quantized is None
    torch.testing.assert_close(_logits(model), _logits(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "llama"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_gguf_blocks_run_as_they_are(tmp_path: Path, family: str, qtype: str) -> None:
    """The file's blocks are the engine's own quantization of the same weights, byte for byte, so the logits
    are the safetensors model's quantized at load (plain and native); and within the format's error of fp32."""
    hf_dir = _hf_dir(tmp_path, family)
    path = hf_to_gguf(hf_dir, tmp_path / "model.gguf", qtype, output_qtype="Q8_0")
    scheme = qtype.lower()
    model, _ = load_gguf_model(path)
    ref, _ = load_model(hf_dir, quantization=scheme)
    assert isinstance(model.quantized, QuantizedWeights) and isinstance(ref.quantized, QuantizedWeights)
    ours = dict(model.named_parameters(remove_duplicate=False))
    for name, p in ref.named_parameters(remove_duplicate=False):
        want = ref.quantized.get(p)
        got = model.quantized.get(ours[name])
        assert (want is None) == (got is None), name
        if want is not None and got is not None:
            assert got.fmt == want.fmt and torch.equal(got.data, want.data), name
    logits = _logits(model)
    torch.testing.assert_close(logits, _logits(ref), rtol=1e-5, atol=1e-5)
    plain, _ = load_model(hf_dir)
    exact = _logits(plain)
    # the format's error on these random 2-layer models (measured: q8_0 2-3%, q4_0 27-41% of the logits' norm)
    assert 0 < (logits - exact).norm() / exact.norm() < (0.06 if qtype == "Q8_0" else 0.6)
    native = _native_logits(model)
    torch.testing.assert_close(native, _native_logits(ref), rtol=1e-5, atol=1e-5)
    # the kernels quantize activations to int8 too: a little further from the plain quantized model (on these
    # random MoEs a token's expert choice can flip; measured up to 11% with q4_0 weights)
    assert (native - logits).norm() / logits.norm() < (0.05 if qtype == "Q8_0" else 0.2)


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_half_precision_gguf(tmp_path: Path, qtype: str) -> None:
    hf_dir = _hf_dir(tmp_path, "qwen3_moe")
    model, _ = load_gguf_model(hf_to_gguf(hf_dir, tmp_path / "model.gguf", qtype))
    ref, _ = load_model(hf_dir)
    tol = 2e-3 if qtype == "F16" else 2e-2
    scale = _logits(ref).abs().max().item()
    torch.testing.assert_close(_logits(model), _logits(ref), rtol=0, atol=tol * scale)


def test_k_quant_tensors_are_dequantized_and_run_as_q8_0(tmp_path: Path) -> None:
    """A Q4_K tensor (no direct kernel): its values are the gguf package's dequantization, held as Q8_0 blocks."""
    import gguf
    import numpy as np

    hf_dir = tmp_path / "hf"
    build_hf_model("llama", seed=2, vocab_size=4096, hidden_size=256, intermediate_size=256,
                   **_DEFAULT_ROPE).save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, hf_dir / name)
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(256, 144), dtype=np.uint8)  # 256 rows x one 256-element Q4_K block
    blocks[:, 0:2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)  # d
    blocks[:, 2:4] = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)  # dmin
    path = hf_to_gguf(hf_dir, tmp_path / "model.gguf", "F32", raw={"blk.0.attn_output.weight": (blocks, "Q4_K")})
    model, _ = load_gguf_model(path)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).copy())
    o_proj: torch.Tensor = model.get_parameter("model.layers.0.self_attn.o_proj.weight")
    assert model.quantized is not None
    held = model.quantized.get(o_proj)
    assert held is not None and held.fmt == "q8_0"
    assert torch.equal(held.data, quant.quantize_q8_0(want))
    torch.testing.assert_close(o_proj, held.dequantize(), rtol=0, atol=0)
    assert float((o_proj.detach() - want).abs().max()) <= float(want.abs().max()) / 127  # Q8_0 of the Q4_K values
    plain = _logits(model)
    native = _native_logits(model)
    assert float((native - plain).norm() / plain.norm()) < 0.05


def test_gguf_tokenizer_and_engine_from_the_file(tmp_path: Path) -> None:
    hf_dir = _hf_dir(tmp_path, "mixtral")
    path = hf_to_gguf(hf_dir, tmp_path / "model.gguf", "Q8_0")
    text = "The king's 12 horses ran\n  to the   castle, didn't they? <|im_end|>"
    ours, theirs = Tokenizer.from_dir(path), Tokenizer.from_dir(DEMO)
    assert ours.encode(text) == theirs.encode(text)
    assert ours.eos_token_ids[0] == theirs.token_to_id("<|im_end|>")
    assert ours.chat_template == theirs.chat_template
    ids = theirs.encode(text)
    assert ours.decode(ids) == theirs.decode(ids)
    engine = LLMEngine.from_dir(path)
    ref = LLMEngine.from_dir(hf_dir, quantization="q8_0")
    prompt = theirs.encode("The king")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert engine.generate([prompt], params)[0].output_token_ids == ref.generate([prompt], params)[0].output_token_ids


def test_gguf_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError):
        load_gguf_model(bad)
    hf_dir = _hf_dir(tmp_path, "llama")
    path = hf_to_gguf(hf_dir, tmp_path / "model.gguf", "Q8_0")
    with pytest.raises(GGUFError, match="fp32"):
        load_gguf_model(path, dtype=torch.bfloat16)
