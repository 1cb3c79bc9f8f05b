"""`tiergate bench routing` (= `tiergate classifier bench-routing`): the router on an outcomes file
against prompt length, random and oracle (quality-vs-cost curve, APGR / CPT(50%) / CPT(80%) with
bootstrap intervals), leave-groups-out retraining, and the partial-feedback prequential replay of
the learning loop vs the frozen router. The benchmark itself is classifier.bench_outcome_file;
this runs it on a loaded artifact and renders its report as text or JSON."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def run(loaded: Any, outcomes: Path, *, data_dir: Path, holdout_groups: bool, folds: int | None,
        prequential: bool, epsilon: float, strong_share: float, seed: int, n_boot: int,
        progress: Callable[[str], None]) -> Any:
    """The report for ``loaded`` (a classifier.LoadedArtifact) on ``outcomes``; raises
    classifier.ClassifierError on a bad outcomes file."""
    import classifier

    return classifier.bench_outcome_file(
        loaded.model, loaded.metadata, outcomes, data_dir=data_dir, holdout_groups=holdout_groups,
        folds=folds, prequential=prequential, epsilon=epsilon, strong_share=strong_share, seed=seed,
        n_boot=n_boot, progress=progress)


def report_text(loaded: Any, report: Any) -> str:
    import classifier

    return f"classifier {loaded.model.version}\n" + classifier.format_report(report)


def report_json(report: Any) -> dict[str, Any]:
    from classifier import quality_at
    from classifier.routing_bench import SHARES

    def rows(results: list[Any]) -> dict[str, Any]:
        return {r.name: {"apgr": r.metrics.apgr, "cpt50": r.metrics.cpt50, "cpt80": r.metrics.cpt80,
                         "ci": {k: [v.low, v.high] for k, v in r.intervals.items()},
                         "curve": {str(x): quality_at(r.curve, x) for x in SHARES}} for r in results}

    out: dict[str, Any] = {"items": report.n_items, "notes": report.notes, "routers": rows(report.routers)}
    if report.holdout:
        out["holdout"] = {"note": report.holdout_note, "routers": rows(report.holdout)}
    rp = report.replay
    if rp is not None:
        out["prequential"] = {"epsilon": rp.epsilon, "strong_share": rp.strong_share, "order": rp.order,
                              "windows": rp.windows, "learning": rp.learner_apgr, "frozen": rp.frozen_apgr,
                              "learning_all": rp.learner_overall, "frozen_all": rp.frozen_overall,
                              "last_window_ci": {k: [v.estimate, v.low, v.high] for k, v in rp.last_window.items()},
                              "reward": {"learning": rp.learner_reward, "frozen": rp.frozen_reward},
                              "updates_per_second": rp.updates_per_second}
    return out
