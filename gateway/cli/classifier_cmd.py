"""`tiergate classifier`: train, cross-validate, evaluate as a router, explain, bench and
update the effort classifier. Thin: every computation lives in the classifier library (or,
for feedback rows, gateway.learning.perceive; for the benches, gateway.bench); this module parses
options and prints.
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
    from gateway.learning.perceive import artifact_candidates

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


def _load_artifact(settings: Any, artifact: Path | None) -> Any:
    import classifier
    from gateway.learning.perceive import artifact_candidates

    paths = [artifact] if artifact is not None else artifact_candidates(settings)
    for p in paths:
        if p.exists():
            try:
                return classifier.load_artifact(p)
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
    if report.augmented_apgr:
        lines.append("proxy APGR of the synthetic conversations, pooled (held-out scores): " + ", ".join(
            f"{k} {v:.3f}" for k, v in report.augmented_apgr.items()))
    if report.within_source:
        lines.append("within-source Spearman(held-out score, difficulty): " + ", ".join(
            f"{k} {v:.3f}" for k, v in report.within_source.items()))
    return "\n".join(lines)


def _train_and_save(examples: list[Any], out: Path, target_mix: dict[str, float], folds: int, cv: bool,
                    extra: dict[str, Any], temperature: float | None = None,
                    ordinal: Any = None, outcomes: dict[str, list[Any]] | None = None,
                    outcome_cv: bool = False) -> Any:
    import classifier

    data_hash = classifier.dataset_hash(examples)
    cfg = classifier.TrainConfig(cv_folds=folds, target_mix=target_mix)
    result = classifier.train(examples, cfg, cv=cv, version=classifier.new_version(data_hash),
                              temperature=temperature, ordinal=ordinal, outcomes=outcomes, outcome_cv=outcome_cv)
    metrics = {"cv": result.cv.to_json() if result.cv else None, "n_examples": result.n_examples,
               "n_outcome_rows": result.n_outcome_rows, "train_seconds": round(result.seconds, 1),
               "outcome_cv": {k: v.to_json() for k, v in result.outcome_cv.items()}, "gain_head": result.gain}
    sets = {name: {"items": len(items), "sha256": classifier.outcome_set_hash(items)}
            for name, items in (outcomes or {}).items()}
    curve = classifier.quality_curve(result.outcome_cv)
    classifier.save_artifact(result.model, out, data_hash=data_hash, metrics=metrics,
                             extra={"target_mix": target_mix, "outcome_sets": sets,
                                    **({"quality_curve": curve} if curve else {}), **extra})
    return result


def _outcome_table(result: Any) -> str:
    lines = []
    for name, o in result.outcome_cv.items():
        lines.append(f"outcome set {name}: {o.n_items} prompts, {o.n_groups} groups, {o.folds} grouped folds "
                     f"(held-out groups never seen): APGR {o.apgr:.3f} (prompt length {o.length_apgr:.3f}, "
                     f"random 0.5), CPT(50%) {o.cpt50:.3f}, CPT(80%) {o.cpt80:.3f}")
    return "\n".join(lines)


@app.command()
def train(config: Path | None = ConfigOption, data: Path | None = DataOption,
          out: Path | None = typer.Option(None, "--out", "-o", help="Artifact path (default: classifier.artifact)."),
          folds: int = typer.Option(5, help="Grouped CV folds (calibration + reported metrics)."),
          cv: bool = typer.Option(True, "--cv/--no-cv", help="Cross-validate (needed for calibration)."),
          outcomes: bool = typer.Option(True, "--outcomes/--no-outcomes",
                                        help="Train with the outcome sets in <data>/outcomes too."),
          outcome_cv: bool = typer.Option(True, "--outcome-cv/--no-outcome-cv",
                                          help="Report each outcome set with whole groups held out.")) -> None:
    """Build the labelled set from the shared data, train, calibrate and write the artifact."""
    import classifier

    settings = _settings(config)
    data_dir = _data_dir(settings, data)
    examples = classifier.build_dataset(data_dir)
    sets = classifier.load_outcome_sets(data_dir) if outcomes else {}
    target = out or settings.resolve_path(settings.classifier.artifact)
    result = _train_and_save(examples, target, dict(settings.classifier.target_mix), folds, cv,
                             {"excluded_sources": list(classifier.EXCLUDED_SOURCES)}, outcomes=sets,
                             outcome_cv=outcome_cv)
    if result.cv:
        typer.echo(_cv_table(result.cv))
    if result.outcome_cv:
        typer.echo(_outcome_table(result))
    typer.echo(f"wrote {target} ({result.model.version}; {result.n_examples} examples + {result.n_outcome_rows} "
               f"outcome rows; thresholds {[round(t, 4) for t in result.model.thresholds]}; {result.seconds:.0f}s)")


@app.command()
def cv(config: Path | None = ConfigOption, data: Path | None = DataOption,
       folds: int = typer.Option(5, help="Number of GroupKFold folds."),
       outcomes: bool = typer.Option(True, "--outcomes/--no-outcomes",
                                     help="Train each fold with the outcome sets too (as the shipped artifact)."),
       as_json: bool = typer.Option(False, "--json")) -> None:
    """Grouped-by-source cross-validation table: per-tier precision/recall, AUROC, calibration error."""
    import classifier
    from classifier.payoff import outcome_rows
    from classifier.train import outcome_training_rows, source_rows

    settings = _settings(config)
    data_dir = _data_dir(settings, data)
    examples = classifier.build_dataset(data_dir)
    X = classifier.featurize(examples)
    cfg = classifier.TrainConfig(cv_folds=folds)
    sets = classifier.load_outcome_sets(data_dir) if outcomes else {}
    extra = outcome_training_rows(sets, cfg, float(source_rows(examples, X).w.sum()))
    report, _ = classifier.cross_validate(examples, X, cfg, extra, outcome_rows(sets, cfg) if sets else None)
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


@app.command("bench-routing")
def bench_routing(outcomes: Path = typer.Option(..., "--outcomes", help="Outcomes file (JSONL/CSV; see "
                                                "classifier.outcomes for the formats, e.g. bbh_direct_vs_cot.jsonl)."),
                  config: Path | None = ConfigOption, data: Path | None = DataOption,
                  artifact: Path | None = ArtifactOption,
                  holdout_groups: bool = typer.Option(False, "--holdout-groups",
                                                      help="Also retrain with whole groups (tasks) held out."),
                  folds: int = typer.Option(5, help="Grouped folds for --holdout-groups (0 = one fold per group)."),
                  prequential: bool = typer.Option(True, "--prequential/--no-prequential",
                                                   help="Partial-feedback replay of the learning loop."),
                  epsilon: float = typer.Option(0.1, help="Exploration share in the replay."),
                  strong_share: float = typer.Option(0.5, help="Greedy strong-arm share in the replay."),
                  seed: int = typer.Option(0, help="Shuffle / exploration / bootstrap seed."),
                  n_boot: int = typer.Option(200, "--bootstrap", help="Bootstrap resamples (0 = none)."),
                  as_json: bool = typer.Option(False, "--json")) -> None:
    """Routing benchmark on an outcomes file: quality-vs-cost curve, APGR / CPT(50%) / CPT(80%) of the
    router (score and tier) vs prompt length, random and oracle; leave-groups-out retraining; and the
    partial-feedback prequential replay of the learning loop vs the frozen router."""
    import classifier
    from gateway.bench import routing

    settings = _settings(config)
    loaded = _load_artifact(settings, artifact)
    data_dir = _data_dir(settings, data)

    def say(msg: str) -> None:
        if not as_json:
            typer.echo(msg, err=True)

    try:
        report = routing.run(loaded, outcomes, data_dir=data_dir, holdout_groups=holdout_groups,
                             folds=folds or None, prequential=prequential, epsilon=epsilon,
                             strong_share=strong_share, seed=seed, n_boot=n_boot, progress=say)
    except classifier.ClassifierError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(routing.report_json(report), indent=2))
        return
    typer.echo(routing.report_text(loaded, report))


@app.command()
def learn(records: Path = typer.Option(..., "--records", help="Logged decisions (JSONL: arm, outcome, propensity, "
                                       "prompt/messages/features, cost, timestamp, tenant)."),
          config: Path | None = ConfigOption, artifact: Path | None = ArtifactOption,
          state: Path | None = typer.Option(None, help="Learner state (.npz) to continue from and save to "
                                            "(default: <feedback_dir>/learner.npz)."),
          holdback: float = typer.Option(0.2, help="Latest share of the records held back for the promotion guard."),
          tolerance: float = typer.Option(0.0, help="How much worse (mean outcome) a candidate may be."),
          min_effective: float = typer.Option(30.0, help="Least effective sample size behind the guard's verdict."),
          tenants: bool = typer.Option(False, "--tenants/--no-tenants", help="Learn per-tenant corrections too."),
          publish: bool = typer.Option(True, "--publish/--dry-run", help="Publish an accepted update.")) -> None:
    """Update the router from logged outcomes (off-policy, incremental), check the update against the
    current model on held-back traffic, and publish it for running gateways if it is not worse."""
    import time

    import classifier

    settings = _settings(config)
    loaded = _load_artifact(settings, artifact)  # what gateways serve now (the guard's baseline)
    current = loaded.model
    # The learner always builds on the shipped artifact (its updates are published as children of it).
    base = loaded if artifact is not None else _load_artifact(settings, settings.resolve_path(
        settings.classifier.artifact))
    out_dir = settings.resolve_path(settings.classifier.feedback_dir)
    state_path = state or out_dir / "learner.npz"
    try:
        rows = classifier.load_outcome_records(records)
        arms = tuple(t for t in classifier.TIERS if t in {r.arm for r in rows}) or classifier.TIERS
        cfg = classifier.LearnerConfig(arms=arms if len(arms) >= 2 else classifier.TIERS,
                                       tenant_weight=0.05 if tenants else 0.0)
        learner = classifier.load_learner(state_path, base.model, cfg) if state_path.exists() else \
            classifier.OffPolicyLearner(base.model, cfg)
        version = f"{base.model.version}+u{int(time.time())}"
        t0 = time.perf_counter()
        result = classifier.learn_and_guard(current, learner, rows, version=version, holdback=holdback,
                                            mix=dict(settings.classifier.target_mix), tolerance=tolerance,
                                            min_effective=min_effective)
        seconds = time.perf_counter() - t0
    except classifier.ClassifierError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    v = result.verdict
    typer.echo(f"learned from {result.learned} records in {seconds:.2f}s; held back {result.held_back}; "
               f"off-policy mean outcome: current {v.current.value:.4f}, candidate {v.candidate.value:.4f} "
               f"(effective sample {v.candidate.effective:.0f})")
    typer.echo(("accepted: " if v.accepted else "refused: ") + v.reason)
    if not v.accepted or not publish:
        raise typer.Exit(0 if v.accepted else 3)
    state_path.parent.mkdir(parents=True, exist_ok=True)
    classifier.save_learner(learner, state_path)
    versioned, live = classifier.publish_artifact(
        result.candidate, out_dir, data_hash=str(base.metadata.get("training_data_hash", "")),
        metrics={"promotion": {"current": v.current.value, "candidate": v.candidate.value,
                               "effective": v.candidate.effective, "held_back": result.held_back}},
        extra={"learned_records": learner.seen, "target_mix": base.metadata.get("target_mix"),
               "outcome_sets": base.metadata.get("outcome_sets")})
    typer.echo(f"published {versioned} as {live} ({result.candidate.version}, parent {base.model.version}; "
               f"replaces {current.version})")


@app.command()
def bench(config: Path | None = ConfigOption, data: Path | None = DataOption, artifact: Path | None = ArtifactOption,
          n: int = typer.Option(2000, help="Prompts to time (sampled from the shared data)."),
          repeat: int = typer.Option(3, help="Timed passes over the prompts.")) -> None:
    """p50/p99 per-prompt latency of one decision (single prompts, one thread), with the
    cost of JSON-decoding the same request body measured in the same run as the baseline."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from gateway.bench import classifier_latency

    settings = _settings(config)
    model = _load_model(settings, artifact)
    for line in classifier_latency.run(model, _data_dir(settings, data), n, repeat):
        typer.echo(line)


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
               cv: bool = False, outcomes: dict[str, list[Any]] | None = None) -> UpdateOutcome | None:
    """Refit on ``base_examples`` + the feedback rows; publish the new artifact where running
    Perceivers look first. None when there is no usable feedback."""
    import classifier
    from gateway.learning.perceive import CURRENT_ARTIFACT_NAME, artifact_candidates, feedback_examples

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
                             ordinal=parent_meta.get("ordinal"), outcomes=outcomes)
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
    sets = classifier.load_outcome_sets(_data_dir(settings, data)) if base else {}
    engine = engine_from_settings(settings)
    try:
        outcome = run_update(settings, make_session_factory(engine), base_examples, weight=weight, cv=cv,
                             outcomes=sets)
    finally:
        engine.dispose()
    if outcome is None:
        typer.echo("no usable feedback rows; nothing to do")
        raise typer.Exit(1)
    typer.echo(f"wrote {outcome.versioned_path} and {outcome.live_path} ({outcome.version}; parent "
               f"{outcome.parent}; {outcome.feedback_examples} feedback examples, {outcome.skipped} skipped; "
               f"{outcome.n_examples} examples in all)")
