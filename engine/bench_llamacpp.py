"""Part (e) of `tiergate bench engine`, llama.cpp side by side: the engine's batch-1 decode and prefill
tokens/s against llama.cpp's ``llama-bench`` (tg / pp) on the same weights and thread count, for fp32, bf16,
q8_0 and q4_0.

Same weights: the HF checkpoint the engine's other rows use is converted with llama.cpp's own
``convert_hf_to_gguf.py`` (``--outtype f32 / bf16 / q8_0``; q4_0 by ``llama-quantize --pure
--output-tensor-type q8_0`` from the f32 file: every matrix Q4_0 but the output matrix at Q8_0, as the
engine's own q4_0 keeps its LM head), and both sides run those GGUF files: the engine loads each one
(`engine.gguf`: F32/BF16 as fp32 parameters, Q8_0/Q4_0 blocks as they are). The engine's fp32 row packs
fp32 panels (``TIERGATE_ENGINE_PANELS=fp32``; weights exact in bf16 would otherwise stream as bf16 panels).
The converter hashes a BPE tokenizer's pre-tokenizer and refuses one it does not know (the demo's); the
wrapper below then names ``qwen2``, whose split regex is the demo tokenizer's (the random MoE gets a minimal
byte-level tokenizer: the converter needs a vocabulary, the speed rows never tokenize).

Measures: decode is ``decode_tokens`` steps after a 16-token prompt (llama-bench: ``-n decode_tokens`` from
an empty context), prefill is one ``prefill_tokens`` prompt to its first token (``-p prefill_tokens``); the
thread count is torch's (the native kernels use it) and ``-t``. Rounds interleave (each scheme: engine
decode, engine prefill, one ``llama-bench -r 1`` process) and the table prints the medians.

The build: ``TIERGATE_LLAMA_CPP`` names a llama.cpp folder (binaries in it, ``bin/`` or ``build/bin/``), else
the folder `make bench-llama-cpp` builds (``.bench/llama.cpp`` beside this package), else ``llama-bench`` on
PATH; the converter is looked up beside the binaries and up to three folders above, and runs on
``TIERGATE_LLAMA_CPP_PYTHON``, else ``.venv-llama-cpp`` (the same target), else this Python. Nothing is
downloaded here.

Imports torch and the engine; nothing web/db.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.bench import BenchSizes, Log, _prompts, build_random_moe, engine_decode_tokens_per_s
from engine.bench_quant import _engine, engine_prefill_tokens_per_s
from engine.engine import LLMEngine
from engine.gguf import load_gguf_model

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / ".bench" / "llama.cpp"
DEFAULT_PYTHON = ROOT / ".venv-llama-cpp" / "bin" / "python"
SCHEMES = ("fp32", "bf16", "q8_0", "q4_0")
OUTTYPE = {"fp32": "f32", "bf16": "bf16", "q8_0": "q8_0"}
CONVERTER = "convert_hf_to_gguf.py"
DECODE_PROMPT = 16

# Runs convert_hf_to_gguf.py (argv: script, pre-tokenizer, converter arguments) with one change: a BPE
# pre-tokenizer whose hash it does not know gets the named one instead of an error.
CONVERT = """
import runpy, sys
from pathlib import Path
script, pre = Path(sys.argv[1]), sys.argv[2]
sys.argv = [str(script), *sys.argv[3:]]
sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print(f"pre-tokenizer not recognised by the converter: {pre}", file=sys.stderr)
        return pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(str(script), run_name="__main__")
"""


class LlamaCppError(RuntimeError):
    """A llama.cpp tool failed or printed what this module cannot read."""


@dataclass(frozen=True)
class LlamaCpp:
    """The llama.cpp build the comparison runs."""

    bench: Path
    quantize: Path | None
    simple: Path | None
    converter: Path | None
    python: Path


@dataclass(frozen=True)
class LlamaBenchRun:
    """One ``llama-bench -o json`` run of a pp and a tg test."""

    prefill: float  # tokens/s of the pp test
    decode: float  # tokens/s of the tg test
    threads: int
    settings: str  # what llama-bench ran with beyond the model and threads (its defaults)


@dataclass(frozen=True)
class ComparisonRow:
    model: str
    scheme: str
    threads: int
    engine_format: str
    decode: tuple[float, float] | None  # (tiergate, llama.cpp) medians, tokens/s
    prefill: tuple[float, float] | None
    note: str = ""
    decode_spread: tuple[float, float] | None = None  # quartiles of the per-round ratios (rounds are paired)
    prefill_spread: tuple[float, float] | None = None


def ratio_quartiles(ours: Sequence[float], theirs: Sequence[float]) -> tuple[float, float] | None:
    """First and third quartile of the per-round ratios ``ours[i] / theirs[i]`` (None under 4 rounds)."""
    if len(ours) != len(theirs) or len(ours) < 4:
        return None
    q1, _, q3 = statistics.quantiles([a / b for a, b in zip(ours, theirs, strict=True)], n=4)
    return q1, q3


def _tools_in(folder: Path) -> Path | None:
    for place in (folder / "build" / "bin", folder / "bin", folder):
        if (place / "llama-bench").is_file():
            return place
    return None


def _converter_near(place: Path) -> Path | None:
    for folder in [place, *list(place.parents)[:3]]:
        if (folder / CONVERTER).is_file():
            return folder / CONVERTER
    return None


def find_llama_cpp(environ: Mapping[str, str] = os.environ, default: Path = DEFAULT_DIR,
                   default_python: Path = DEFAULT_PYTHON) -> LlamaCpp | str:
    """The build to compare with, or why there is none (the skip note)."""
    named = environ.get("TIERGATE_LLAMA_CPP")
    if named:
        bins = _tools_in(Path(named))
        if bins is None:
            return f"TIERGATE_LLAMA_CPP={named} holds no llama-bench (in it, bin/ or build/bin/)"
    else:
        bins = _tools_in(default)
        if bins is None:
            found = shutil.which("llama-bench", path=environ.get("PATH", ""))
            if found is None:
                return (f"no llama.cpp build: TIERGATE_LLAMA_CPP is not set, {default} has none (`make "
                        f"bench-llama-cpp` builds it) and llama-bench is not on PATH")
            bins = Path(found).resolve().parent
    python = environ.get("TIERGATE_LLAMA_CPP_PYTHON") or (
        str(default_python) if default_python.is_file() else sys.executable)

    def tool(name: str) -> Path | None:
        return bins / name if (bins / name).is_file() else None

    return LlamaCpp(bins / "llama-bench", tool("llama-quantize"), tool("llama-simple"), _converter_near(bins),
                    Path(python))


def parse_llama_bench_json(text: str) -> LlamaBenchRun:
    """The pp and tg tokens/s (``avg_ts``) of one ``llama-bench -p P -n N -o json`` run."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as err:
        raise LlamaCppError(f"llama-bench printed no JSON: {err}") from None
    if not isinstance(tests, list) or not tests:
        raise LlamaCppError("llama-bench printed no tests")
    rates: dict[str, float] = {}
    for test in tests:
        kind = "pp" if test["n_prompt"] > 0 and test["n_gen"] == 0 else "tg" if test["n_gen"] > 0 and \
            test["n_prompt"] == 0 else None
        if kind is not None:
            rates[kind] = float(test["avg_ts"])
    if set(rates) != {"pp", "tg"}:
        raise LlamaCppError(f"llama-bench printed tests {sorted(rates)}, expected a pp and a tg test")
    first = tests[0]
    settings = (f"KV cache {first.get('type_k', '?')}/{first.get('type_v', '?')}, flash_attn "
                f"{ {-1: 'auto', 0: 'off', 1: 'on'}.get(first.get('flash_attn'), first.get('flash_attn'))}, "
                f"repack {first.get('repack', '?')}, n_ubatch {first.get('n_ubatch', '?')}")
    return LlamaBenchRun(rates["pp"], rates["tg"], int(first["n_threads"]), settings)


def _run(cmd: Sequence[str | Path | int], timeout: float = 900, name: str | None = None) -> str:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise LlamaCppError(f"{name or Path(str(cmd[0])).name} exited {done.returncode}: {' | '.join(tail)}")
    return done.stdout


def llama_bench(cpp: LlamaCpp, gguf: Path, threads: int, prefill_tokens: int, decode_tokens: int) -> LlamaBenchRun:
    return parse_llama_bench_json(_run([cpp.bench, "-m", gguf, "-t", threads, "-p", prefill_tokens,
                                        "-n", decode_tokens, "-r", 1, "-o", "json"]))


def convert(cpp: LlamaCpp, hf_dir: Path, out_dir: Path, scheme: str, pre_tokenizer: str = "qwen2") -> Path:
    """``hf_dir`` as a GGUF file of ``scheme`` in ``out_dir`` (made once)."""
    out = out_dir / f"{hf_dir.name}-{scheme}.gguf"
    if out.is_file():
        return out
    if scheme == "q4_0":
        if cpp.quantize is None:
            raise LlamaCppError("no llama-quantize beside llama-bench")
        source = convert(cpp, hf_dir, out_dir, "fp32", pre_tokenizer)
        _run([cpp.quantize, "--pure", "--output-tensor-type", "q8_0", source, out, "Q4_0"])
    else:
        if cpp.converter is None:
            raise LlamaCppError(f"no {CONVERTER} beside the llama.cpp binaries")
        _run([cpp.python, "-c", CONVERT, cpp.converter, pre_tokenizer, hf_dir, "--outtype", OUTTYPE[scheme],
              "--outfile", out], name=CONVERTER)
    return out


@contextmanager
def _panels(scheme: str) -> Iterator[None]:
    """fp32 panels for the fp32 row, whatever the weights (see `engine.native.packing`)."""
    before = os.environ.get("TIERGATE_ENGINE_PANELS")
    os.environ["TIERGATE_ENGINE_PANELS"] = "fp32" if scheme == "fp32" else "auto"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TIERGATE_ENGINE_PANELS", None)
        else:
            os.environ["TIERGATE_ENGINE_PANELS"] = before


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# engine.native.threads.ThreadChoice's exploration: its first 4 steps on one thread and 4 on the team (a literal:
# only the runner may import the native backend)
WARM_PREFILLS = 8


def _gguf_engine(gguf: Path, scheme: str, prefill_tokens: int, decode_tokens: int) -> LLMEngine:
    model, config = load_gguf_model(gguf)
    with _panels(scheme):
        return _engine(model, config, prefill_tokens, decode_tokens)


def compare_model(cpp: LlamaCpp, hf_dir: Path, label: str, vocab: int, log: Log, *, threads: Sequence[int],
                  rounds: int, prefill_tokens: int, decode_tokens: int,
                  work_dir: Path) -> list[ComparisonRow]:
    """Every scheme at every thread count on the checkpoint in ``hf_dir``: medians of interleaved rounds."""
    rows: list[ComparisonRow] = []
    ready: dict[str, tuple[Path, LLMEngine]] = {}
    for scheme in SCHEMES:
        try:
            gguf = convert(cpp, hf_dir, work_dir, scheme)
            ready[scheme] = gguf, _gguf_engine(gguf, scheme, prefill_tokens, decode_tokens + 1)
        except (LlamaCppError, subprocess.TimeoutExpired) as err:
            rows += [ComparisonRow(label, scheme, t, "-", None, None, f"skipped: {err}") for t in threads]
    short = _prompts(1, DECODE_PROMPT, vocab, 1)[0]
    long = _prompts(1, prefill_tokens, vocab, 2)[0]
    settings = ""
    for t in threads:
        samples: dict[str, dict[str, list[float]]] = {s: {k: [] for k in ("ed", "ep", "ld", "lp")} for s in ready}
        failed: dict[str, str] = {}
        with _torch_threads(t):
            for engine in (e for _, e in ready.values()):  # warm-up at this thread count
                engine_decode_tokens_per_s(engine, [short], 4)
                # the native backend times its first steps of each batch size on one thread and on the team, in
                # turn, before it picks one (engine.native.threads): a timed prefill of the same length every round
                # would otherwise run on one thread in about half of the first eight rounds
                for _ in range(WARM_PREFILLS):
                    engine_prefill_tokens_per_s(engine, long)
            for _ in range(rounds):
                for scheme, (gguf, engine) in ready.items():
                    got = samples[scheme]
                    got["ed"].append(engine_decode_tokens_per_s(engine, [short], decode_tokens + 1))
                    got["ep"].append(engine_prefill_tokens_per_s(engine, long))
                    if scheme in failed:
                        continue
                    try:
                        run = llama_bench(cpp, gguf, t, prefill_tokens, decode_tokens)
                    except (LlamaCppError, subprocess.TimeoutExpired) as err:
                        failed[scheme] = str(err)
                        continue
                    got["ld"].append(run.decode)
                    got["lp"].append(run.prefill)
                    settings = run.settings
        for scheme, (_, engine) in ready.items():
            got = samples[scheme]
            med = {k: statistics.median(v) for k, v in got.items() if v}
            both = scheme not in failed
            rows.append(ComparisonRow(label, scheme, t, engine.runner.backend.weight_format,
                                      (med["ed"], med["ld"]) if both else None,
                                      (med["ep"], med["lp"]) if both else None,
                                      f"llama-bench failed: {failed[scheme]}" if not both else "",
                                      ratio_quartiles(got["ed"], got["ld"]) if both else None,
                                      ratio_quartiles(got["ep"], got["lp"]) if both else None))
    log(f"    {label}: decode {decode_tokens} tokens, prefill {prefill_tokens}" +
        (f"; llama-bench ran with {settings}" if settings else ""))
    for backend in dict.fromkeys(e.runner.backend.describe() for _, e in ready.values()):
        log(f"    {label}: engine {backend}")  # per weight format, with the prefetch chosen on this machine
    order = {s: i for i, s in enumerate(SCHEMES)}
    return sorted(rows, key=lambda r: (r.threads, order[r.scheme]))


def _pair(pair: tuple[float, float] | None, spread: tuple[float, float] | None, digits: int) -> str:
    if pair is None:
        return f"{'-':>8} · {'-':>8} · {'-':>5} {'':>11}"
    ours, theirs = pair
    quartiles = f"[{spread[0]:.2f}-{spread[1]:.2f}]" if spread else ""
    return f"{ours:8.{digits}f} · {theirs:8.{digits}f} · {ours / theirs:4.2f}x {quartiles:>11}"


def format_table(rows: Sequence[ComparisonRow]) -> list[str]:
    """One line per model x scheme x threads: decode and prefill tok/s, tiergate · llama.cpp · ratio, and the
    ratio's spread over the rounds (first-third quartile of the per-round ratios)."""
    width = max([len(f"{r.model} · {r.scheme} ({r.engine_format})") for r in rows] + [len("model · scheme")])
    lines = [f"{'model · scheme (engine format)':<{width}} | threads | decode tok/s tiergate · llama.cpp · ratio"
             f" [q1-q3] | prefill tok/s tiergate · llama.cpp · ratio [q1-q3]"]
    for r in rows:
        name = f"{r.model} · {r.scheme} ({r.engine_format})"
        line = (f"{name:<{width}} | {r.threads:>7} | {_pair(r.decode, r.decode_spread, 1):>49} | "
                f"{_pair(r.prefill, r.prefill_spread, 0):>50}")
        lines.append(line + (f"  {r.note}" if r.note else ""))
    return lines


def write_byte_tokenizer(out: Path, vocab: int) -> None:
    """A minimal byte-level BPE tokenizer (the 256 byte symbols and one merge; ids past them are padding): the
    converter needs a vocabulary (llama.cpp: with merges), and the random MoE has none (the speed rows never
    tokenize)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "\u0120t"]  # "Ġt": a space and t, merged
    if vocab < len(symbols):
        raise ValueError(f"a vocabulary of {vocab} is smaller than the {len(symbols)} byte-level tokens")
    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[("\u0120", "t")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def _random_checkpoint(sizes: BenchSizes, out: Path) -> None:
    """The random bench MoE rounded to bf16 (as the engine's quantization rows use it), with a byte tokenizer."""
    hf = build_random_moe(sizes, out)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    hf.save_pretrained(out)
    write_byte_tokenizer(out, sizes.vocab)


def run_llama_cpp_bench(sizes: BenchSizes, demo_dir: Path | None, log: Log, *, threads: Sequence[int] = (1, 2),
                        rounds: int = 5, prefill_tokens: int = 256, models: Sequence[str] = ("random", "demo"),
                        greedy_tokens: int = 24, environ: Mapping[str, str] = os.environ) -> list[ComparisonRow]:
    """The side-by-side table (or the note saying why it was skipped) and the greedy-token check."""
    cpp = find_llama_cpp(environ)
    if isinstance(cpp, str):
        log(f"    llama.cpp side by side: skipped ({cpp})")
        return []
    has_demo = demo_dir is not None and (demo_dir / "config.json").is_file()
    stamps = sorted(p.name.removeprefix(".tiergate-built-") for folder in cpp.bench.parents[:3]
                    for p in folder.glob(".tiergate-built-*"))
    built = f"llama-cpp-python {stamps[0]}'s llama.cpp, " if stamps else ""
    log(f"    llama.cpp side by side ({built}{cpp.bench.parent}): batch-1 decode and prefill tok/s on the same "
        f"GGUF files; medians of {rounds} interleaved rounds; ratio = "
        f"tiergate / llama.cpp (target >= 1.0x)")
    rows: list[ComparisonRow] = []
    with tempfile.TemporaryDirectory(prefix="tiergate-llamacpp-") as tmp:
        work = Path(tmp)
        if "random" in models:
            hf_dir = work / "random-moe"
            _random_checkpoint(sizes, hf_dir)
            rows += compare_model(cpp, hf_dir, "random MoE", sizes.vocab, log, threads=threads, rounds=rounds,
                                  prefill_tokens=prefill_tokens, decode_tokens=sizes.decode_tokens, work_dir=work)
        if "demo" in models and has_demo:
            from engine.config import ModelConfig

            assert demo_dir is not None
            vocab = ModelConfig.from_dir(demo_dir).vocab_size
            rows += compare_model(cpp, demo_dir, "demo-moe", vocab, log, threads=threads, rounds=rounds,
                                  prefill_tokens=prefill_tokens, decode_tokens=sizes.decode_tokens * 2, work_dir=work)
        for line in format_table(rows) if rows else []:
            log(f"    {line}")
        if "demo" in models and has_demo and greedy_tokens:
            assert demo_dir is not None
            greedy_check(cpp, convert(cpp, demo_dir, work, "fp32"), greedy_tokens, log)
    return rows


def greedy_check(cpp: LlamaCpp, gguf: Path, n: int, log: Log, run: Callable[..., str] = _run) -> None:
    """Greedy text of llama.cpp's ``llama-simple`` vs the engine on the same f32 GGUF and chat prompts."""
    from engine.bench_spec import FREE_ASKS
    from engine.sampling_params import SamplingParams

    if cpp.simple is None:
        log("    greedy tokens vs llama.cpp: skipped (no llama-simple beside llama-bench)")
        return
    engine = LLMEngine.from_dir(gguf, enable_prefix_caching=False)
    same, notes = 0, []
    for ask in FREE_ASKS:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)
        out = engine.generate([engine.tokenizer.encode(text, add_special_tokens=False)],
                              SamplingParams(temperature=0, max_tokens=n))[0]
        ids = [t for t in out.output_token_ids if t not in engine.eos_token_ids]  # llama-simple stops before it
        ours = engine.tokenizer.decode(ids, skip_special_tokens=False)
        printed = run([cpp.simple, "-m", gguf, "-n", n, text]).removesuffix("\n")
        theirs = printed.removeprefix(text) if printed.startswith(text) else None
        if theirs == ours:
            same += 1
        else:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs or "", strict=False)) if a != b),
                      min(len(ours), len(theirs or "")))
            notes.append(f"{ask!r}: first difference at character {at}" if theirs is not None else
                         f"{ask!r}: llama-simple did not echo the prompt as given")
    log(f"    greedy text vs llama.cpp (llama-simple, demo-moe f32 GGUF, {n} tokens, {len(FREE_ASKS)} chat prompts): "
        f"identical on {same}/{len(FREE_ASKS)}" + (f" ({'; '.join(notes)})" if notes else ""))
