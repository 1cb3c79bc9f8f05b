"""Routing evaluation on an outcomes file, in one run (``tiergate classifier bench-routing``):

1. the quality-vs-cost curve and APGR / CPT(50%) / CPT(80%) with bootstrap intervals of the
   router's score, of the tier it routes on (thresholds calibrated on the replayed traffic), of
   prompt length, random and the oracle;
2. with held-out groups (``holdout``): the router retrained with whole groups (tasks) held out —
   leave-groups-out cross-validation, the source data always in training;
3. the partial-feedback prequential replay: prompts arrive in an honest order (their timestamps,
   else shuffled with a seed); the learning router routes each with exploration, only the
   chosen arm's outcome is revealed, and the off-policy learner updates; its scores before each
   update, by window of the stream, against the frozen router's.

Must not import torch, the gateway or the engine.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from classifier.evaluate import (
    Interval,
    RoutingCurve,
    RoutingMetrics,
    bootstrap,
    metrics,
    oracle_scores,
    routing_curve,
)
from classifier.features import extract_arrays
from classifier.model import EffortModel
from classifier.online import LearnerConfig, OffPolicyLearner
from classifier.outcomes import (
    CHEAP_ARM,
    STRONG_ARM,
    OutcomeItem,
    OutcomeRecord,
    load_outcome_items,
    outcome_set_hash,
)
from classifier.policy import epsilon_greedy
from classifier.thresholds import ScoreWindow
from classifier.types import TIER_INDEX, ClassifierError

SHARES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass(frozen=True)
class RouterResult:
    name: str
    metrics: RoutingMetrics
    intervals: dict[str, Interval]
    curve: RoutingCurve


@dataclass(frozen=True)
class ReplayResult:
    """The prequential partial-feedback replay."""

    epsilon: float
    strong_share: float
    order: str
    windows: list[tuple[int, int]]  # (start, end) of each window of the stream
    learner_apgr: list[float]  # per window
    frozen_apgr: list[float]
    learner_overall: float
    frozen_overall: float
    last_window: dict[str, Interval]  # learner's APGR / CPT on the last window, bootstrapped
    learner_reward: float  # mean revealed outcome of the arms the learning router ran
    frozen_reward: float  # the same for the frozen router (its own exploration)
    learner_strong_share: float
    frozen_strong_share: float
    updates_per_second: float


@dataclass(frozen=True)
class BenchReport:
    n_items: int
    cheap: str
    strong: str
    routers: list[RouterResult]
    holdout: list[RouterResult] = field(default_factory=list)
    holdout_note: str = ""
    replay: ReplayResult | None = None
    notes: list[str] = field(default_factory=list)


def stream_order(items: Sequence[OutcomeItem], seed: int) -> tuple[np.ndarray, str]:
    """The items' time order if every item has a timestamp, else a seeded shuffle."""
    if items and all(it.timestamp is not None for it in items):
        return np.argsort(np.asarray([it.timestamp for it in items], dtype=float), kind="stable"), "timestamps"
    return np.random.default_rng(seed).permutation(len(items)), f"shuffled (seed {seed})"


def evaluate_scores(name: str, scores: np.ndarray, cheap: np.ndarray, strong: np.ndarray, n_boot: int,
                    seed: int) -> RouterResult:
    return RouterResult(name, metrics(scores, cheap, strong),
                        bootstrap(scores, cheap, strong, n_boot=n_boot, seed=seed) if n_boot > 0 else {},
                        routing_curve(scores, cheap, strong))


def traffic_tiers(model: EffortModel, arrays: Sequence[tuple[np.ndarray, np.ndarray]], order: np.ndarray,
                  window: ScoreWindow | None) -> np.ndarray:
    """Tier index of each item when the items arrive in ``order`` through ``model`` whose thresholds
    are calibrated on ``window`` (None: the stored thresholds only)."""
    live = model.with_traffic(window)
    tiers = np.zeros(len(arrays))
    for i in order:
        idx, val = arrays[i]
        tiers[i] = TIER_INDEX[live.decide_arrays(idx, val, None).tier]
    return tiers


def replay(model: EffortModel, items: Sequence[OutcomeItem], arrays: Sequence[tuple[np.ndarray, np.ndarray]],
           order: np.ndarray, order_name: str, *, cheap: str, strong: str, epsilon: float, strong_share: float,
           seed: int, n_windows: int = 5, n_boot: int = 200, config: LearnerConfig | None = None) -> ReplayResult:
    """The prequential partial-feedback replay of the learning loop against the frozen model."""
    import time

    arms = (cheap, strong)
    learner = OffPolicyLearner(model, config or LearnerConfig(arms=arms))
    c = np.asarray([it.outcomes[cheap] for it in items])
    g = np.asarray([it.outcomes[strong] for it in items])
    frozen_scores = np.asarray([model.raw_score(i, v) for i, v in arrays])
    rng_l, rng_f = random.Random(seed), random.Random(seed + 1)
    win_l, win_f = ScoreWindow(2048, min_count=2, refresh=16), ScoreWindow(2048, min_count=2, refresh=16)
    shares = (1.0 - strong_share, strong_share)
    pre = np.zeros(len(items))
    reward_l, reward_f, strong_l, strong_f = [], [], 0, 0
    t_update = 0.0

    def greedy(score: float, window: ScoreWindow) -> str:
        cuts = window.thresholds(shares) if len(window) >= 2 else None
        return strong if cuts is None or score >= cuts[0] else cheap

    for i in order:
        idx, val = arrays[i]
        s = learner.gain(idx, val)
        pre[i] = s
        arm, p, _ = epsilon_greedy(greedy(s, win_l), arms, epsilon, rng_l)
        win_l.add(s)
        r = items[i].outcomes[arm]
        reward_l.append(r)
        strong_l += arm == strong
        t0 = time.perf_counter()
        learner.update(OutcomeRecord(arm=arm, outcome=r, messages=items[i].messages, propensity=p),
                       arrays=(idx, val))
        t_update += time.perf_counter() - t0
        arm_f, _, _ = epsilon_greedy(greedy(frozen_scores[i], win_f), arms, epsilon, rng_f)
        win_f.add(frozen_scores[i])
        reward_f.append(items[i].outcomes[arm_f])
        strong_f += arm_f == strong
    bounds = np.linspace(0, len(order), n_windows + 1).astype(int)
    windows = [(int(a), int(b)) for a, b in itertools.pairwise(bounds)]
    learner_apgr, frozen_apgr = [], []
    for a, b in windows:
        sel = order[a:b]
        learner_apgr.append(metrics(pre[sel], c[sel], g[sel]).apgr)
        frozen_apgr.append(metrics(frozen_scores[sel], c[sel], g[sel]).apgr)
    last = order[windows[-1][0]:windows[-1][1]]
    return ReplayResult(
        epsilon=epsilon, strong_share=strong_share, order=order_name, windows=windows, learner_apgr=learner_apgr,
        frozen_apgr=frozen_apgr, learner_overall=metrics(pre, c, g).apgr,
        frozen_overall=metrics(frozen_scores, c, g).apgr,
        last_window=bootstrap(pre[last], c[last], g[last], n_boot=n_boot, seed=seed) if n_boot > 0 else {},
        learner_reward=float(np.mean(reward_l)), frozen_reward=float(np.mean(reward_f)),
        learner_strong_share=strong_l / len(order), frozen_strong_share=strong_f / len(order),
        updates_per_second=len(order) / max(t_update, 1e-9))


def routing_bench(model: EffortModel, items: Sequence[OutcomeItem], *, cheap: str = CHEAP_ARM,
                  strong: str = STRONG_ARM, n_boot: int = 200, seed: int = 0,
                  holdout_scores: Callable[[Sequence[OutcomeItem]], tuple[np.ndarray, str]] | None = None,
                  prequential: bool = True, start_model: EffortModel | None = None, epsilon: float = 0.1,
                  strong_share: float = 0.5, n_windows: int = 5, in_sample: bool = False) -> BenchReport:
    """Everything of the module docstring for the items that have both arms. ``holdout_scores``
    returns held-out-group scores (and a description); ``start_model`` is where the replay starts
    (default ``model``; pass one that has not seen this file when ``model`` has)."""
    usable = [it for it in items if it.has(cheap, strong)]
    if len(usable) < 10:
        raise ClassifierError(f"need at least 10 prompts with both the {cheap!r} and {strong!r} arm, "
                              f"found {len(usable)}")
    c = np.asarray([it.outcomes[cheap] for it in usable])
    g = np.asarray([it.outcomes[strong] for it in usable])
    arrays = [extract_arrays(it.messages) for it in usable]
    order, order_name = stream_order(usable, seed)
    scores = np.asarray([model.raw_score(i, v) for i, v in arrays])
    window = ScoreWindow(size=4096, min_count=min(256, max(len(usable) // 10, 2)))
    tag = " (trained on this file)" if in_sample else ""
    length = np.asarray([float(sum(len(str(m.get("content") or "")) for m in it.messages)) for it in usable])
    routers = [
        evaluate_scores(f"router score{tag}", scores, c, g, n_boot, seed),
        evaluate_scores(f"router tier, traffic thresholds{tag}",
                        traffic_tiers(model, arrays, order, window), c, g, n_boot, seed),
        evaluate_scores(f"router tier, stored thresholds{tag}", traffic_tiers(model, arrays, order, None),
                        c, g, n_boot, seed),
        evaluate_scores("prompt length", length, c, g, n_boot, seed),
        evaluate_scores("random", np.zeros(len(usable)), c, g, n_boot, seed),
        evaluate_scores("oracle", oracle_scores(c, g), c, g, n_boot, seed),
    ]
    report_notes = [f"{len(usable)} prompts with both arms ({cheap} = cheap, {strong} = strong); "
                    f"cheap quality {c.mean():.3f}, strong {g.mean():.3f}; stream order {order_name}",
                    "tier rows: the six-tier index as the router score; target shares none..xhigh "
                    + "/".join(f"{x:.2f}" for x in model.tier_shares)]
    report_notes.append(f"Spearman of the router score with prompt length {_spearman(scores, length):.3f}, "
                        f"with the strong arm's gain {_spearman(scores, g - c):.3f}")
    holdout: list[RouterResult] = []
    holdout_note = ""
    if holdout_scores is not None:
        held, holdout_note = holdout_scores(usable)
        holdout_note += (f"; Spearman of the held-out score with prompt length {_spearman(held, length):.3f}, "
                         f"with the gain {_spearman(held, g - c):.3f}")
        holdout = [evaluate_scores("router score, groups held out", held, c, g, n_boot, seed),
                   evaluate_scores("prompt length", length, c, g, n_boot, seed),
                   evaluate_scores("random", np.zeros(len(usable)), c, g, n_boot, seed)]
    result = None
    if prequential:
        result = replay(start_model or model, usable, arrays, order, order_name, cheap=cheap, strong=strong,
                        epsilon=epsilon, strong_share=strong_share, seed=seed, n_windows=n_windows, n_boot=n_boot)
    return BenchReport(len(usable), cheap, strong, routers, holdout, holdout_note, result, report_notes)


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def _ci(r: RouterResult, key: str) -> str:
    iv = r.intervals.get(key)
    return f"[{iv.low:.3f}, {iv.high:.3f}]" if iv is not None else ""


def _table(results: Sequence[RouterResult]) -> list[str]:
    lines = [f"  {'router':44} {'APGR':>6} {'95% CI':>15} {'CPT(50%)':>9} {'CPT(80%)':>9}"]
    for r in results:
        m = r.metrics
        lines.append(f"  {r.name:44} {m.apgr:6.3f} {_ci(r, 'apgr'):>15} {m.cpt50:9.3f} {m.cpt80:9.3f}")
    return lines


def format_report(report: BenchReport) -> str:
    from classifier.routing_report import quality_at

    lines = list(report.notes)
    lines.append("routers (APGR: random 0.5; CPT = least strong-call share reaching 50% / 80% of the gap)")
    lines += _table(report.routers)
    lines.append("quality by strong-call share: " + " ".join(f"{s:.1f}" for s in SHARES))
    for r in report.routers:
        lines.append(f"  {r.name[:34]:34} " + " ".join(f"{quality_at(r.curve, s):.3f}" for s in SHARES))
    if report.holdout:
        lines.append(f"leave-groups-out ({report.holdout_note})")
        lines += _table(report.holdout)
    rp = report.replay
    if rp is not None:
        lines.append(f"prequential partial-feedback replay (epsilon {rp.epsilon}, greedy strong share "
                     f"{rp.strong_share}, {rp.order}; only the chosen arm's outcome revealed; "
                     f"{rp.updates_per_second:.0f} updates/s)")
        lines.append(f"  {'window':>13} {'learning':>9} {'frozen':>7}")
        for (a, b), la, fa in zip(rp.windows, rp.learner_apgr, rp.frozen_apgr, strict=True):
            lines.append(f"  {f'{a}-{b}':>13} {la:9.3f} {fa:7.3f}")
        lines.append(f"  {'all':>13} {rp.learner_overall:9.3f} {rp.frozen_overall:7.3f}")
        iv = rp.last_window.get("apgr")
        if iv is not None:
            lines.append(f"  last window, learning router: APGR {iv.estimate:.3f} [{iv.low:.3f}, {iv.high:.3f}]")
        lines.append(f"  mean revealed outcome: learning {rp.learner_reward:.3f} (strong share "
                     f"{rp.learner_strong_share:.2f}), frozen {rp.frozen_reward:.3f} (strong share "
                     f"{rp.frozen_strong_share:.2f})")
    return "\n".join(lines)


def bench_outcome_file(model: EffortModel, metadata: Mapping[str, Any], path: str | Path, *,
                       data_dir: str | Path | None = None, holdout_groups: bool = False, folds: int | None = 5,
                       prequential: bool = True, epsilon: float = 0.1, strong_share: float = 0.5, seed: int = 0,
                       n_boot: int = 200, cheap: str = CHEAP_ARM, strong: str = STRONG_ARM,
                       progress: Callable[[str], None] | None = None) -> BenchReport:
    """``routing_bench`` for an outcomes file and an artifact (its model and metadata). When the
    artifact was trained on this file (its metadata lists the file's hash), the replay starts from
    the score refitted without it, and ``holdout_groups`` refits with whole groups held out — both
    need the shared data folder (``data_dir``) for the source-derived training rows."""
    from classifier.data import build_dataset
    from classifier.heads import TrainConfig
    from classifier.payoff import group_folds, grouped_outcome_scores, load_outcome_sets, outcome_rows
    from classifier.train import fit_score_model, source_rows

    say = progress or (lambda _msg: None)
    items = load_outcome_items(path)
    usable = [it for it in items if it.has(cheap, strong)]
    digest = outcome_set_hash(items)
    trained_on = {name for name, info in dict(metadata.get("outcome_sets") or {}).items()
                  if isinstance(info, Mapping) and info.get("sha256") == digest}
    mix = metadata.get("target_mix")
    cfg = TrainConfig(target_mix=dict(mix)) if isinstance(mix, Mapping) else TrainConfig()
    need_data = holdout_groups or (prequential and bool(trained_on))
    examples: list[Any] = []
    others: dict[str, list[OutcomeItem]] = {}
    if need_data:
        if data_dir is None:
            raise ClassifierError("held-out groups (and a replay of a file the artifact was trained on) need the "
                                  "shared data folder")
        say("building the source-derived training rows")
        examples = build_dataset(data_dir)
        others = {k: v for k, v in load_outcome_sets(data_dir).items()
                  if k not in trained_on and outcome_set_hash(v) != digest}
    start = model
    if prequential and trained_on:
        say("refitting the score without this file for the replay's starting point")
        start = fit_score_model(examples, others, cfg, model, f"{model.version}-without-{'-'.join(sorted(trained_on))}")
    holdout: Callable[[Sequence[OutcomeItem]], tuple[np.ndarray, str]] | None = None
    if holdout_groups:
        if any(it.group is None for it in usable):
            raise ClassifierError(f"{path}: every prompt needs a group (task) to hold groups out")
        source = source_rows(examples)
        other_rows = outcome_rows(others, cfg) if others else None
        n_classes = len(set(source.y.tolist()))

        def held_out(chosen: Sequence[OutcomeItem]) -> tuple[np.ndarray, str]:
            rows = outcome_rows({"this": chosen}, cfg, cheap=cheap, strong=strong)
            test = group_folds(rows.groups, folds, seed)
            say(f"refitting the score {len(test)} times with groups held out")
            scores = grouped_outcome_scores(source, rows, cfg, n_classes, test, other=other_rows,
                                            progress=lambda k, n: say(f"  fold {k}/{n}"))
            n_groups = len(set(rows.groups.tolist()))
            kind = "one group per fold" if len(test) == n_groups else f"{len(test)} grouped folds"
            return scores, (f"{n_groups} groups, {kind}; each fold refits on the source-derived data + the "
                            f"other groups' outcomes{' + ' + ', '.join(sorted(others)) if others else ''}")

        holdout = held_out

    report = routing_bench(model, usable, cheap=cheap, strong=strong, n_boot=n_boot, seed=seed,
                           holdout_scores=holdout, prequential=prequential, start_model=start, epsilon=epsilon,
                           strong_share=strong_share, in_sample=bool(trained_on))
    if prequential:
        report.notes.append(f"replay starts from {start.version}" + (
            " (the artifact's score refitted without this file)" if start is not model else ""))
    return report
