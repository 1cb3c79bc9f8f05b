"""The llama.cpp side by side of `tiergate bench engine` (e) without a llama.cpp build: reading llama-bench's
JSON (a sample captured from a real run), finding a build or saying why there is none, the conversion
commands (the converter and llama-quantize are stand-in scripts that record what they were given), and the
ratio table."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from engine.bench import BenchSizes
from engine.bench_llamacpp import (
    ComparisonRow,
    LlamaCpp,
    LlamaCppError,
    convert,
    find_llama_cpp,
    format_table,
    parse_llama_bench_json,
    ratio_quartiles,
    run_llama_cpp_bench,
)

SAMPLE = Path(__file__).resolve().parent / "data" / "llama_bench_demo_q8_0.json"


def test_parse_reads_pp_and_tg_from_a_real_run() -> None:
    run = parse_llama_bench_json(SAMPLE.read_text())
    tests = json.loads(SAMPLE.read_text())
    pp = next(t for t in tests if t["n_gen"] == 0)
    tg = next(t for t in tests if t["n_prompt"] == 0)
    assert (run.prefill, run.decode) == (pp["avg_ts"], tg["avg_ts"])
    assert run.prefill != run.decode and run.threads == tg["n_threads"]
    assert run.settings == "KV cache f16/f16, flash_attn auto, repack True, n_ubatch 512"


@pytest.mark.parametrize("text, why", [
    ("main: error: failed to load model", "printed no JSON"),
    ("[]", "printed no tests"),
])
def test_parse_refuses_what_is_not_a_run(text: str, why: str) -> None:
    with pytest.raises(LlamaCppError, match=why):
        parse_llama_bench_json(text)


def test_parse_needs_both_tests() -> None:
    tg_only = [t for t in json.loads(SAMPLE.read_text()) if t["n_gen"] > 0]
    with pytest.raises(LlamaCppError, match=r"tests \['tg'\], expected a pp and a tg test"):
        parse_llama_bench_json(json.dumps(tg_only))


def _tool(path: Path, body: str = "exit 0") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_no_build_is_a_skip_note(tmp_path: Path) -> None:
    empty = tmp_path / "none"
    empty.mkdir()
    note = find_llama_cpp({"PATH": str(empty)}, default=tmp_path / "absent")
    assert isinstance(note, str) and "TIERGATE_LLAMA_CPP is not set" in note and "make bench-llama-cpp" in note
    named = find_llama_cpp({"TIERGATE_LLAMA_CPP": str(empty), "PATH": str(empty)})
    assert named == f"TIERGATE_LLAMA_CPP={empty} holds no llama-bench (in it, bin/ or build/bin/)"
    lines: list[str] = []
    rows = run_llama_cpp_bench(BenchSizes(), None, lines.append, environ={"TIERGATE_LLAMA_CPP": str(empty)})
    assert rows == [] and lines == [f"    llama.cpp side by side: skipped ({named})"]


def test_a_build_folder_is_found_with_its_converter(tmp_path: Path) -> None:
    root = tmp_path / "llama.cpp"
    bench = _tool(root / "build" / "bin" / "llama-bench")
    _tool(root / "build" / "bin" / "llama-quantize")
    (root / "convert_hf_to_gguf.py").write_text("")
    python = _tool(tmp_path / "venv" / "bin" / "python")
    found = find_llama_cpp({"PATH": ""}, default=root, default_python=python)
    assert found == LlamaCpp(bench, root / "build" / "bin" / "llama-quantize", None, root / "convert_hf_to_gguf.py",
                             python)
    on_path = _tool(tmp_path / "elsewhere" / "llama-bench")
    found = find_llama_cpp({"PATH": str(on_path.parent)}, default=tmp_path / "absent", default_python=python)
    assert isinstance(found, LlamaCpp) and found.bench == on_path and found.converter is None
    assert found.python == python
    found = find_llama_cpp({"TIERGATE_LLAMA_CPP": str(root), "TIERGATE_LLAMA_CPP_PYTHON": "/x/python"})
    assert isinstance(found, LlamaCpp) and found.bench == bench and found.python == Path("/x/python")


# A stand-in converter: a BPE model whose pre-tokenizer hash it does not know, as the real one refuses it.
FAKE_BASE = """
class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")
"""
FAKE_CONVERTER = """
import sys
from conversion.base import TextModel
args = sys.argv[1:]
out = args[args.index("--outfile") + 1]
open(out, "w").write(" ".join([TextModel().get_vocab_base_pre(None), *args]))
"""


@pytest.mark.process  # the stand-in converter and llama-quantize run as processes
def test_convert_names_a_pre_tokenizer_the_converter_does_not_know_and_quantizes_q4_0(tmp_path: Path) -> None:
    root = tmp_path / "llama.cpp"
    (root / "conversion").mkdir(parents=True)
    (root / "conversion" / "__init__.py").write_text("")
    (root / "conversion" / "base.py").write_text(FAKE_BASE)
    (root / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    quantize = _tool(root / "llama-quantize", 'echo "$@" > "$5.args"; cp "$4" "$5"')
    cpp = LlamaCpp(root / "llama-bench", quantize, None, root / "convert_hf_to_gguf.py", Path(sys.executable))
    hf, out = tmp_path / "demo", tmp_path / "out"
    out.mkdir()
    bf16 = convert(cpp, hf, out, "bf16")
    assert bf16.read_text() == f"qwen2 {hf} --outtype bf16 --outfile {bf16}"
    q4 = convert(cpp, hf, out, "q4_0")
    f32 = out / "demo-fp32.gguf"
    assert f32.read_text() == f"qwen2 {hf} --outtype f32 --outfile {f32}"
    assert Path(f"{q4}.args").read_text().split() == ["--pure", "--output-tensor-type", "q8_0", str(f32), str(q4),
                                                      "Q4_0"]
    f32.write_text("kept")
    assert convert(cpp, hf, out, "fp32").read_text() == "kept"  # made once
    (root / "convert_hf_to_gguf.py").write_text("import sys\nsys.exit('no model here')\n")
    with pytest.raises(LlamaCppError, match=r"convert_hf_to_gguf\.py exited 1: no model here"):
        convert(cpp, tmp_path / "other", out, "q8_0")
    assert not (out / "other-q8_0.gguf").exists()


def test_ratio_quartiles_pair_the_rounds() -> None:
    ours, theirs = [10.0, 20.0, 30.0, 40.0, 50.0], [10.0, 10.0, 10.0, 10.0, 10.0]
    assert ratio_quartiles(ours, theirs) == (1.5, 4.5)
    assert ratio_quartiles(ours, theirs[::-1]) == (1.5, 4.5)  # still round by round
    assert ratio_quartiles(ours, [10.0, 20.0, 30.0, 40.0, 50.0]) == (1.0, 1.0)
    assert ratio_quartiles(ours[:3], theirs[:3]) is None


def test_the_table_prints_tiergate_over_llama_cpp() -> None:
    rows = [ComparisonRow("random MoE", "fp32", 1, "fp32 panels", (12.0, 10.0), (300.0, 400.0),
                          decode_spread=(1.1, 1.25), prefill_spread=(0.7, 0.8)),
            ComparisonRow("random MoE", "q4_0", 2, "q4_0 + q8_0 blocks", (30.5, 61.0), (900.0, 450.0)),
            ComparisonRow("demo-moe", "bf16", 1, "-", None, None, "skipped: no llama-quantize")]
    header, fp32, q4, skipped = format_table(rows)
    assert header.split(" | ") == ["model · scheme (engine format)".ljust(len("random MoE · q4_0 (q4_0 + q8_0 "
                                                                              "blocks)")),
                                   "threads", "decode tok/s tiergate · llama.cpp · ratio [q1-q3]",
                                   "prefill tok/s tiergate · llama.cpp · ratio [q1-q3]"]
    assert [c.strip() for c in fp32.split(" | ")] == ["random MoE · fp32 (fp32 panels)", "1",
                                                       "12.0 ·     10.0 · 1.20x [1.10-1.25]",
                                                       "300 ·      400 · 0.75x [0.70-0.80]"]
    assert [c.strip() for c in q4.split(" | ")][2:] == ["30.5 ·     61.0 · 0.50x", "900 ·      450 · 2.00x"]
    assert skipped.endswith("  skipped: no llama-quantize") and skipped.count("- ·") == 4
    assert len({len(line.split(" | ")[0]) for line in (header, fp32, q4, skipped)}) == 1  # aligned


@pytest.mark.slow
@pytest.mark.process
def test_side_by_side_on_a_real_build() -> None:
    """Where `make bench-llama-cpp` has built llama.cpp: every scheme of both models gets a row with both
    sides' figures, the engine ran each GGUF in its own format, and the greedy check ran."""
    import re

    import torch

    found = find_llama_cpp()
    if isinstance(found, str):
        pytest.skip(found)
    demo = Path(__file__).resolve().parents[2] / "engine" / "models" / "demo-moe"
    sizes = BenchSizes(hidden=64, layers=2, heads=4, kv_heads=2, experts=4, top_k=2, expert_intermediate=64,
                       vocab=512, decode_tokens=4)
    lines: list[str] = []
    torch.set_num_threads(1)
    rows = run_llama_cpp_bench(sizes, demo, lines.append, threads=(1,), rounds=1, prefill_tokens=32,
                               greedy_tokens=8)
    out = "\n".join(lines)
    formats = {"fp32": "fp32 panels", "bf16": "bf16 panels", "q8_0": "q8_0 blocks", "q4_0": "q4_0 + q8_0 blocks"}
    assert [(r.model, r.scheme) for r in rows] == [(m, s) for m in ("random MoE", "demo-moe") for s in formats], out
    for row in rows:
        assert row.engine_format == formats[row.scheme] and not row.note, out
        assert row.decode is not None and row.prefill is not None and min(*row.decode, *row.prefill) > 0
    assert re.search(r"greedy text vs llama.cpp \(llama-simple, demo-moe f32 GGUF, 8 tokens, 3 chat prompts\): "
                     r"identical on \d/3", out), out


def test_the_prefill_warm_up_covers_the_thread_choice_s_exploration() -> None:
    """Part (e) times one prefill per round: its warm-up must outlast the native backend's first steps on each
    arm (one thread, the team), or some timed rounds prefill on one thread while the backend explores."""
    from engine import bench_llamacpp
    from engine.native.threads import ThreadChoice

    choice = ThreadChoice()
    assert 2 * choice.first <= bench_llamacpp.WARM_PREFILLS
    for _ in range(bench_llamacpp.WARM_PREFILLS):  # each warm-up prefill: a pick, then its time recorded
        used = choice.pick(256, 2)
        choice.record(256, 2, used, 0.010 if used == 2 else 0.015)
    assert choice.pick(256, 2) == 2 and choice.faster(256, 2) == 2  # decided: the timed rounds run on the team
