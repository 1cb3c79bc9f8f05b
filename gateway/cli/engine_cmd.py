"""`tiergate engine`: the local MoE engine."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="The local MoE engine.", no_args_is_help=True)


# --- training the bundled demo models (engine/train) ---------------------------------------

_REPO_ROOT = Path(__file__).resolve().parents[2]


@app.command("train")
def train_cmd(
    out: Path = typer.Option(_REPO_ROOT / "engine" / "models", "--out",
                             help="parent folder; demo-moe/ and demo-draft/ are written inside"),
    data_dir: Path = typer.Option(_REPO_ROOT.parent / "shared" / "data", "--data-dir",
                                  help="the shared data folder (default ../shared/data from the repo root)"),
    moe_steps: int = typer.Option(1500, "--moe-steps", "--steps", help="optimiser steps for the MoE model"),
    draft_steps: int = typer.Option(1000, "--draft-steps", help="optimiser steps for the draft model"),
    minutes: float | None = typer.Option(None, "--minutes", "--moe-minutes",
                                         help="wall-clock cap for the MoE model (the LR schedule follows it)"),
    draft_minutes: float | None = typer.Option(None, "--draft-minutes", help="wall-clock cap for the draft"),
    which: str = typer.Option("both", "--which", help="moe, draft or both"),
    seed: int = typer.Option(1234, "--seed"),
    threads: int = typer.Option(1, "--threads", help="torch intra-op threads"),
) -> None:
    """Re-create the bundled demo MoE model and its draft model from the shared data folder."""
    from dataclasses import replace

    from engine.train import DRAFT_DIR, MOE_DIR, DemoRecipe, train_demo_models

    names = {"moe": (MOE_DIR,), "draft": (DRAFT_DIR,), "both": (MOE_DIR, DRAFT_DIR)}
    if which not in names:
        raise typer.BadParameter("--which must be moe, draft or both")
    base = DemoRecipe(data_dir=data_dir, out_dir=out, seed=seed, which=names[which])
    recipe = replace(
        base,
        moe=replace(base.moe, steps=moe_steps, max_minutes=minutes, threads=threads),
        draft=replace(base.draft, steps=draft_steps, max_minutes=draft_minutes, threads=threads),
    )
    train_demo_models(recipe, log=lambda line: typer.echo(line))


@app.command("eval-ppl")
def eval_ppl_cmd(
    model: Path = typer.Option(..., "--model", help="model directory (config.json, model.safetensors, tokenizer) "
                                                     "or .gguf file"),
    k: list[int] = typer.Option([], "--k", help="experts per token (repeatable); omit for the model's default"),
    quantization: list[str] = typer.Option([], "--quantization", "-q",
                                           help="none, q8_0 or q4_0 (repeatable): score the model as the engine "
                                                "serves it with its weights quantized so, and print the change "
                                                "against none"),
    text: Path | None = typer.Option(None, "--text", help="a plain-text file to score instead of the held-out "
                                                          "split of the training corpus"),
    data_dir: Path = typer.Option(_REPO_ROOT.parent / "shared" / "data", "--data-dir"),
    seed: int = typer.Option(1234, "--seed", help="the split seed the model was trained with"),
    validation_fraction: float = typer.Option(0.02, "--validation-fraction", help="as in training"),
    windows: int | None = typer.Option(None, "--windows", help="evaluate only the first N windows"),
    threads: int = typer.Option(1, "--threads"),
) -> None:
    """Perplexity of a model on held-out text: the validation split of the training corpus (or --text), per
    expert count and, with --quantization, per weight quantization on the engine's own kernels."""
    import torch

    torch.set_num_threads(threads)
    ks: list[int | None] = list(k) or [None]
    if not quantization and text is None:
        from engine.train import checkpoint_perplexity

        for kk, ppl in checkpoint_perplexity(model, data_dir, ks, seed=seed, validation_fraction=validation_fraction,
                                                 max_windows=windows).items():
            typer.echo(f"k={kk if kk is not None else 'default'} perplexity={ppl:.3f}")
        return
    from engine.config import ModelConfig
    from engine.ppl import engine_perplexity
    from engine.quant import SCHEMES
    from engine.tokenizer import Tokenizer

    schemes = list(dict.fromkeys(quantization or ["none"]))
    unknown = [q for q in schemes if q not in SCHEMES]
    if unknown:
        raise typer.BadParameter(f"--quantization takes {', '.join(SCHEMES)}, not {', '.join(unknown)}")
    if "none" not in schemes:
        schemes.insert(0, "none")  # the baseline the change is printed against
    tokenizer = Tokenizer.from_dir(model)
    if text is not None:
        ids = torch.tensor(tokenizer.encode(text.read_text(encoding="utf-8"), add_special_tokens=False))
        source = str(text)
    else:
        from engine.train.data import CorpusSplit, build_corpus

        corpus = build_corpus(data_dir, validation_fraction, seed)
        held_out = CorpusSplit(train=[], validation=corpus.validation)
        ids = torch.tensor([i for d in held_out.validation for i in tokenizer.encode(d.text, add_special_tokens=False)])
        source = f"held-out split of {data_dir} (seed {seed}, {validation_fraction:g})"
    if model.suffix == ".gguf":
        from engine.gguf import config_from_metadata
        from engine.gguf_vocab import fields, reader

        window = config_from_metadata(fields(reader(model))).max_position_embeddings
    else:
        window = ModelConfig.from_dir(model).max_position_embeddings
    results = engine_perplexity(model, ids, schemes, ks, window, windows)
    typer.echo(f"text: {source}; {results[0].tokens} tokens in windows of {window}; threads={threads}")
    base = {r.k: r.perplexity for r in results if r.scheme == "none"}
    for r in results:
        change = (r.perplexity / base[r.k] - 1) * 100
        size = f" blocks={r.weight_bytes / 2**20:.1f} MiB" if r.weight_bytes else ""
        typer.echo(f"k={r.k if r.k is not None else 'default'} quantization={r.scheme:<5} "
                   f"perplexity={r.perplexity:.3f} change={change:+.2f}% ({r.weight_format}){size}")


# --- serving one model as an OpenAI-compatible server (gateway/engine_server.py) --------------

@app.command("serve")
def serve_cmd(
    model: Path = typer.Option(..., "--model", help="model directory (config.json, safetensors, tokenizer.json)"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    name: str | None = typer.Option(None, "--name", help="model id clients use (default: the directory name)"),
    context_window: int = typer.Option(2048, "--context-window", help="longest prompt + output, in tokens"),
    experts_per_token: int | None = typer.Option(None, "--experts-per-token",
                                                 help="experts each token uses (default: the trained value)"),
    threads: int | None = typer.Option(None, "--threads", help="torch intra-op threads (default: all cores)"),
    quantization: str = typer.Option("none", "--quantization", help="none, q8_0 or q4_0: weights quantized at load"),
) -> None:
    """Serve one local model (a directory or a .gguf file): POST /v1/chat/completions (incl. streaming),
    GET /v1/models, /healthz."""
    import torch
    import uvicorn

    from gateway.engine_server import create_engine_app

    if threads:
        torch.set_num_threads(threads)
    if quantization not in ("none", "q8_0", "q4_0"):
        raise typer.BadParameter("--quantization must be none, q8_0 or q4_0")
    app = create_engine_app(model, model_name=name, context_window=context_window,
                            experts_per_token=experts_per_token, quantization=quantization)
    uvicorn.run(app, host=host, port=port, log_level="info")
