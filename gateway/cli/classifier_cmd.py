"""`tiergate classifier`: train, cross-validate, evaluate as a router, explain, bench and
update the effort classifier. Thin: every computation lives in the classifier library (or,
for feedback rows, gateway.perceive); this module parses options and prints.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(help="The effort classifier.", no_args_is_help=True)

ConfigOption = typer.Option(None, "--config", "-c", envvar="TIERGATE_CONFIG", help="Path to config.yaml.")
DataOption = typer.Option(None, "--data", envvar="TIERGATE_DATA_DIR",
                          help="The shared data folder (default: ../shared/data next to the config).")
ArtifactOption = typer.Option(None, "--artifact", "-a", help="Artifact to use (default: what the gateway loads).")


def _settings(config: Path | None) -> Any:
    from gateway.settings import ConfigError, load_settings

    try:
        return load_settings(config)
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None


def _data_dir(settings: Any, data: Path | None) -> Path:
    return data if data is not None else Path(settings.base_dir).parent / "shared" / "data"


def _load_model(settings: Any, artifact: Path | None) -> Any:
    import classifier
    from gateway.perceive import artifact_candidates

    paths = [artifact] if artifact is not None else artifact_candidates(settings)
    for p in paths:
        if p.exists():
            try:
                return classifier.load_artifact(p).model
            except classifier.ArtifactError as err:
                typer.echo(f"error: {err}", err=True)
                raise typer.Exit(1) from None
    typer.echo("error: no classifier artifact at " + ", ".join(map(str, paths)), err=True)
    raise typer.Exit(1)


def _cv_table(report: Any) -> str:
    import numpy as np

    lines = [f"grouped-by-source cross-validation ({report.folds} folds, GroupKFold on source family)",
             f"{'tier':8} {'support':>8} {'precision':>10} {'recall':>8}"]
    lines += [f"{m.tier:8} {m.support:8d} {m.precision:10.3f} {m.recall:8.3f}" for m in report.per_tier]
    lines += [f"tier accuracy (argmax)          {report.accuracy:.3f}",
              f"AUROC of score, needs >= medium {report.auroc_needs_medium:.3f}",
              f"ECE tier head raw / temperature {report.ece_uncalibrated:.3f} / {report.ece_before:.3f} "
              f"(T = {report.temperature:.2f}); ECE {report.prob_model} {report.ece_after:.3f}"]
    lines.append(f"held-out log-loss: {report.prob_model} {report.log_loss:.3f}, temperature head "
                 f"{report.log_loss_temperature:.3f} (uniform {np.log(len(report.per_tier)):.3f})")
    if report.within_grid:
        lines.append("proxy APGR mean by within-family weight: " + ", ".join(
            f"{k} -> {v:.3f}" for k, v in report.within_grid.items()))
    if report.proxy_apgr:
        lines.append(f"proxy APGR, family held out (mean {report.proxy_apgr_mean:.3f}; random 0.5, oracle "
                     f"{report.proxy_oracle_mean:.3f}): " + ", ".join(
            f"{k} {v:.3f}" for k, v in report.proxy_apgr.items()))
    if report.within_source:
        lines.append("within-source Spearman(held-out score, difficulty): " + ", ".join(
            f"{k} {v:.3f}" for k, v in report.within_source.items()))
    return "\n".join(lines)


def _train_and_save(examples: list[Any], out: Path, target_mix: dict[str, float], folds: int, cv: bool,
                    extra: dict[str, Any], temperature: float | None = None,
                    ordinal: Any = None) -> Any:
    import classifier

    data_hash = classifier.dataset_hash(examples)
    cfg = classifier.TrainConfig(cv_folds=folds, target_mix=target_mix)
    result = classifier.train(examples, cfg, cv=cv, version=classifier.new_version(data_hash),
                              temperature=temperature, ordinal=ordinal)
    metrics = {"cv": result.cv.to_json() if result.cv else None, "n_examples": result.n_examples,
               "train_seconds": round(result.seconds, 1)}
    classifier.save_artifact(result.model, out, data_hash=data_hash, metrics=metrics,
                             extra={"target_mix": target_mix, **extra})
    return result


@app.command()
def train(config: Path | None = ConfigOption, data: Path | None = DataOption,
          out: Path | None = typer.Option(None, "--out", "-o", help="Artifact path (default: classifier.artifact)."),
          folds: int = typer.Option(5, help="Grouped CV folds (calibration + reported metrics)."),
          cv: bool = typer.Option(True, "--cv/--no-cv", help="Cross-validate (needed for calibration).")) -> None:
    """Build the labelled set from the shared data, train, calibrate and write the artifact."""
    import classifier

    settings = _settings(config)
    examples = classifier.build_dataset(_data_dir(settings, data))
    target = out or settings.resolve_path(settings.classifier.artifact)
    result = _train_and_save(examples, target, dict(settings.classifier.target_mix), folds, cv,
                             {"excluded_sources": list(classifier.EXCLUDED_SOURCES)})
    if result.cv:
        typer.echo(_cv_table(result.cv))
    typer.echo(f"wrote {target} ({result.model.version}; {result.n_examples} examples; "
               f"thresholds {[round(t, 4) for t in result.model.thresholds]}; {result.seconds:.0f}s)")


@app.command()
def cv(config: Path | None = ConfigOption, data: Path | None = DataOption,
       folds: int = typer.Option(5, help="Number of GroupKFold folds."),
       as_json: bool = typer.Option(False, "--json")) -> None:
    """Grouped-by-source cross-validation table: per-tier precision/recall, AUROC, calibration error."""
    import classifier

    settings = _settings(config)
    examples = classifier.build_dataset(_data_dir(settings, data))
    X = classifier.featurize(examples)
    report, _ = classifier.cross_validate(examples, X, classifier.TrainConfig(cv_folds=folds))
    typer.echo(json.dumps(report.to_json(), indent=2) if as_json else _cv_table(report))


@app.command()
def explain(prompt: str = typer.Argument(..., help="The prompt (or a JSON list of OpenAI messages)."),
            config: Path | None = ConfigOption, artifact: Path | None = ArtifactOption,
            top: int = typer.Option(10, help="How many features to show.")) -> None:
    """Tier, calibrated probabilities and the features that moved the score most."""
    import classifier

    try:
        parsed = json.loads(prompt)
    except json.JSONDecodeError:
        parsed = None
    messages = parsed if isinstance(parsed, list) else classifier.user_prompt(prompt)
    model = _load_model(_settings(config), artifact)
    decision, contribs = model.explain(messages, top=top)
    typer.echo(f"tier {decision.tier}   score {decision.score:.3f}   classifier {decision.version}")
    typer.echo("probabilities " + "  ".join(f"{t}={p:.2f}" for t, p in decision.probabilities.items()))
    typer.echo(f"bands {[list(b) for b in model.bands]} at score thresholds {[round(t, 3) for t in model.thresholds]}")
    typer.echo(f"{'feature':40} {'value':>7} {'weight':>8} {'contrib':>8}")
    for c in contribs:
        typer.echo(f"{c.name[:40]:40} {c.value:7.3f} {c.score_weight:8.3f} {c.contribution:+8.3f}")


@app.command("eval")
def eval_cmd(outcomes: Path = typer.Option(..., "--outcomes", help="CSV/JSONL: prompt, cheap, strong."),
             config: Path | None = ConfigOption, artifact: Path | None = ArtifactOption,
             prequential: bool = typer.Option(False, "--prequential", help="Also route-then-learn online."),
             n_boot: int = typer.Option(200, "--bootstrap", help="Bootstrap resamples (0 = none)."),
             seed: int = typer.Option(0), as_json: bool = typer.Option(False, "--json")) -> None:
    """Evaluate the classifier as a strong-vs-cheap router: curve, APGR, CPT(50%), CPT(80%)."""
    import classifier
    from classifier import evaluate_routers, quality_at

    try:
        rows = classifier.load_outcomes(outcomes)
    except classifier.ClassifierError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    model = _load_model(_settings(config), artifact)
    results = evaluate_routers(model, rows, n_boot=n_boot, seed=seed, with_prequential=prequential)
    shares = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    if as_json:
        typer.echo(json.dumps({r.name: {"apgr": r.metrics.apgr, "cpt50": r.metrics.cpt50, "cpt80": r.metrics.cpt80,
                                        "ci": {k: [v.low, v.high] for k, v in r.intervals.items()},
                                        "curve": {str(s): quality_at(r.curve, s) for s in shares}}
                               for r in results}, indent=2))
        return
    first = results[0].metrics
    typer.echo(f"{len(rows)} prompts; cheap quality {first.cheap_quality:.3f}, strong {first.strong_quality:.3f}; "
               f"classifier {model.version}")

    def ci(r: Any, k: str) -> str:
        iv = r.intervals.get(k)
        return f" [{iv.low:.3f}, {iv.high:.3f}]" if iv is not None else ""

    typer.echo(f"{'router':12} {'APGR':>22} {'CPT(50%)':>22} {'CPT(80%)':>22}")
    for r in results:
        m = r.metrics
        typer.echo(f"{r.name:12} {m.apgr:7.3f}{ci(r, 'apgr'):>15} {m.cpt50:7.3f}{ci(r, 'cpt50'):>15} "
                   f"{m.cpt80:7.3f}{ci(r, 'cpt80'):>15}")
    typer.echo("quality by strong-call share: " + " ".join(f"{s:.1f}" for s in shares))
    for r in results:
        typer.echo(f"  {r.name:12} " + " ".join(f"{quality_at(r.curve, s):.3f}" for s in shares))


@app.command()
def bench(config: Path | None = ConfigOption, data: Path | None = DataOption, artifact: Path | None = ArtifactOption,
          n: int = typer.Option(2000, help="Prompts to time (sampled from the shared data)."),
          repeat: int = typer.Option(3, help="Timed passes over the prompts.")) -> None:
    """p50/p99 per-prompt latency of one decision (single prompts, one thread), with the
    cost of JSON-decoding the same request body measured in the same run as the baseline."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import random
    import time

    from threadpoolctl import threadpool_limits

    import classifier

    settings = _settings(config)
    model = _load_model(settings, artifact)
    examples = classifier.build_dataset(_data_dir(settings, data))
    random.Random(0).shuffle(examples)
    convs = [list(ex.messages or []) for ex in examples[:n]]
    bodies = [json.dumps({"model": "auto", "messages": c}) for c in convs]
    long_conv = classifier.user_prompt(("Prove that the sequence converges. " * 3000)[:100_000])

    def timed(fn: Any, items: list[Any], clock: Any = time.perf_counter_ns) -> list[float]:
        out = []
        for _ in range(repeat):
            for it in items:
                t = clock()
                fn(it)
                out.append((clock() - t) / 1e6)
        return sorted(out)

    def pct(xs: list[float], q: float) -> float:
        return xs[min(int(q * len(xs)), len(xs) - 1)]

    with threadpool_limits(1):
        for c in convs[:200]:
            model.decide(c)  # warm-up
        rows = [("decide (features + model)", timed(model.decide, convs)),
                ("  same, thread CPU time", timed(model.decide, convs, time.thread_time_ns)),
                ("  features only", timed(classifier.extract, convs)),
                ("  100k-char prompt decide", timed(model.decide, [long_conv] * 20)),
                ("baseline: json.loads(body)", timed(json.loads, bodies))]
    typer.echo(f"{len(convs)} prompts x {repeat} passes, one thread; classifier {model.version}; "
               f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    typer.echo(f"{'':28} {'p50 ms':>8} {'p99 ms':>8}")
    for name, xs in rows:
        typer.echo(f"{name:28} {pct(xs, .5):8.3f} {pct(xs, .99):8.3f}")
    decide, base = rows[0][1], rows[-1][1]
    typer.echo(f"ratio decide / json.loads body: p50 {pct(decide, .5) / pct(base, .5):.1f}x, "
               f"p99 {pct(decide, .99) / pct(base, .99):.1f}x  (wall-clock p99 includes waiting for a CPU "
               "on a loaded machine; the thread-CPU row excludes it)")


@dataclass(frozen=True)
class UpdateOutcome:
    version: str
    parent: str | None
    versioned_path: Path
    live_path: Path
    feedback_examples: int
    skipped: int
    n_examples: int


def run_update(settings: Any, session_factory: Any, base_examples: list[Any], *, weight: float = 5.0,
               cv: bool = False) -> UpdateOutcome | None:
    """Refit on ``base_examples`` + the feedback rows; publish the new artifact where running
    Perceivers look first. None when there is no usable feedback."""
    import classifier
    from gateway.perceive import CURRENT_ARTIFACT_NAME, artifact_candidates, feedback_examples

    fb, skipped = feedback_examples(session_factory, weight=weight)
    if not fb:
        return None
    current = next((p for p in artifact_candidates(settings) if p.exists()), None)
    parent_meta = classifier.read_metadata(current) if current else {}
    parent = parent_meta.get("version")
    out_dir = settings.resolve_path(settings.classifier.feedback_dir)
    staged = out_dir / "versions" / "staging.skops"
    examples = [*base_examples, *fb]
    result = _train_and_save(examples, staged, dict(settings.classifier.target_mix), 5, cv,
                             {"parent_version": parent, "feedback_examples": len(fb), "feedback_weight": weight},
                             temperature=parent_meta.get("temperature"),  # kept unless CV recalibrates
                             ordinal=parent_meta.get("ordinal"))
    version = result.model.version
    final = out_dir / "versions" / f"{version}.skops"
    os.replace(staged, final)
    os.replace(classifier.metadata_path(staged), classifier.metadata_path(final))
    live = out_dir / CURRENT_ARTIFACT_NAME
    # The metadata first, then the .skops: a gateway that reloads between the two sees a hash
    # mismatch, keeps its current model and retries when the .skops changes.
    tmp = live.with_name(live.name + ".tmp")
    shutil.copyfile(classifier.metadata_path(final), tmp)
    os.replace(tmp, classifier.metadata_path(live))
    shutil.copyfile(final, tmp)
    os.replace(tmp, live)
    return UpdateOutcome(version, parent, final, live, len(fb), skipped, result.n_examples)


@app.command()
def update(config: Path | None = ConfigOption, data: Path | None = DataOption,
           weight: float = typer.Option(5.0, help="Weight of one feedback example relative to a base one."),
           cv: bool = typer.Option(False, "--cv/--no-cv", help="Re-run grouped CV (slow) for calibration."),
           base: bool = typer.Option(True, "--base/--no-base", help="Include the shared-data base set.")) -> None:
    """Refit with the stored feedback (weighted with the base data); write a new versioned
    artifact that running gateways pick up without a restart."""
    import classifier
    from gateway.db.session import engine_from_settings, make_session_factory

    settings = _settings(config)
    base_examples = classifier.build_dataset(_data_dir(settings, data)) if base else []
    engine = engine_from_settings(settings)
    try:
        outcome = run_update(settings, make_session_factory(engine), base_examples, weight=weight, cv=cv)
    finally:
        engine.dispose()
    if outcome is None:
        typer.echo("no usable feedback rows; nothing to do")
        raise typer.Exit(1)
    typer.echo(f"wrote {outcome.versioned_path} and {outcome.live_path} ({outcome.version}; parent "
               f"{outcome.parent}; {outcome.feedback_examples} feedback examples, {outcome.skipped} skipped; "
               f"{outcome.n_examples} examples in all)")
