"""`engine.ppl` and ``tiergate engine eval-ppl --quantization``: perplexity on the engine's own backend, per
weight quantization, against the plain model's perplexity."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.model import load_model
from engine.ppl import engine_perplexity
from engine.tokenizer import Tokenizer
from engine.train.loop import perplexity

DEMO = Path(__file__).resolve().parents[2] / "engine" / "models" / "demo-moe"
TEXT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Natalia sold 48/2 = 24 clips in May. "
    "Natalia sold 48+24 = 72 clips altogether in April and May. #### 72\n"
    "Write a function to find the shared elements from the given two lists.\n"
    "def similar_elements(test_tup1, test_tup2):\n    res = tuple(set(test_tup1) & set(test_tup2))\n    return res\n"
    "KING RICHARD: Now is the winter of our discontent made glorious summer by this sun of York.\n"
)


@pytest.mark.slow  # three loads of the demo model and a few prefills (~5 s on a busy machine)
def test_quantized_perplexity_on_the_engine(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    ids = torch.tensor(Tokenizer.from_dir(DEMO).encode(TEXT, add_special_tokens=False))
    results = {r.scheme: r for r in engine_perplexity(DEMO, ids, ["none", "q8_0", "q4_0"], [None], window=64)}
    plain, _ = load_model(DEMO)
    expected = perplexity(plain, ids, 64)
    assert results["none"].perplexity == pytest.approx(expected, rel=1e-4)  # the backend is the model
    assert results["none"].weight_bytes == 0 and results["q4_0"].weight_bytes < results["q8_0"].weight_bytes
    assert results["q8_0"].perplexity == pytest.approx(expected, rel=0.02)
    assert results["q4_0"].perplexity != results["q8_0"].perplexity
    assert results["q4_0"].perplexity == pytest.approx(expected, rel=0.15)

    from gateway.cli.engine_cmd import app

    text = tmp_path / "held_out.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = CliRunner().invoke(app, ["eval-ppl", "--model", str(DEMO), "--text", str(text), "-q", "q8_0"])
    assert out.exit_code == 0, out.output
    lines = [line for line in out.output.splitlines() if line.startswith("k=")]
    assert [line.split()[1] for line in lines] == ["quantization=none", "quantization=q8_0"]
    assert "change=+0.00%" in lines[0] and "q8_0 blocks" in lines[1]
    bad = CliRunner().invoke(app, ["eval-ppl", "--model", str(DEMO), "--text", str(text), "-q", "q2"])
    assert bad.exit_code != 0
