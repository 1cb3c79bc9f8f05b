"""The off-policy learner behind ``tiergate routing learn``: one incremental update of the router
from the outcomes logged since the last one, promoted only if it does not score worse.

``learn_once`` reads the ``routing_outcomes`` rows after its checkpoint (arrival order), and —
once there are ``routing.learn_min_records`` of them — updates a doubly-robust learner
(``classifier.OffPolicyLearner``, microseconds a record) on all but the latest
``routing.learn_holdback`` share, then scores the updated router against the live one on that
held-back slice (``classifier.learn_and_guard``: the value of each router's tier choices,
estimated off-policy from the logged propensities). An update that scores worse is refused: the
learner's state and the checkpoint stay where they were, and the same outcomes are reconsidered
with more data next time. An accepted one is published where every gateway replica hot-reloads
it within ``classifier.reload_interval_s`` (``classifier.feedback_dir``, shared by the replicas),
and the learner's state and checkpoint are saved beside it. Per-tenant corrections are learned
on top of the global router (``routing.tenant_adaptation``).

Imports the classifier's public API, settings and the outcome rows; no web framework.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import classifier
from gateway.db.models import RoutingDecision
from gateway.learning.outcomes import new_outcome_records
from gateway.learning.perceive import CURRENT_ARTIFACT_NAME, artifact_candidates
from gateway.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearnReport:
    status: str  # waiting | published | refused
    new_records: int
    learned: int = 0
    held_back: int = 0
    version: str | None = None
    current_value: float | None = None
    candidate_value: float | None = None
    seconds: float = 0.0
    reason: str = ""

    def line(self) -> str:
        if self.status == "waiting":
            return f"waiting: {self.new_records} new outcome(s), fewer than needed for an update"
        values = ("" if self.current_value is None else
                  f"; held-back value {self.current_value:.4f} (live) vs {self.candidate_value:.4f} (update)")
        return (f"{self.status}: learned {self.learned}, held back {self.held_back} in {self.seconds:.3f}s"
                f"{values}" + (f" -> {self.version}" if self.status == "published" else f" ({self.reason})"))


class LearnerStore:
    """The learner's files beside the published artifacts: its state and its checkpoint."""

    def __init__(self, settings: Settings) -> None:
        self.dir = settings.resolve_path(settings.classifier.feedback_dir) / "learner"
        self.state, self.checkpoint = self.dir / "state.npz", self.dir / "checkpoint.json"

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.checkpoint.read_text())  # type: ignore[no-any-return]
        except FileNotFoundError:
            return {"seq": 0, "base": None}

    def write(self, learner: classifier.OffPolicyLearner, checkpoint: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        classifier.save_learner(learner, self.state)
        tmp = self.checkpoint.with_suffix(".tmp")
        tmp.write_text(json.dumps(checkpoint))
        tmp.replace(self.checkpoint)


def _models(settings: Settings) -> tuple[classifier.EffortModel, Path, classifier.EffortModel]:
    """(the model the learner starts from — the shipped artifact or the last full refit —, where
    it lies for good, the live model). A learned version names its base in its metadata."""
    live_path = next((p for p in artifact_candidates(settings) if p.exists()), None)
    if live_path is None:
        raise classifier.ArtifactError("no classifier artifact to learn from (train one first)")
    live = classifier.load_artifact(live_path, traffic=False).model
    named = classifier.read_metadata(live_path).get("learner_base_path")
    if named:
        return classifier.load_artifact(Path(str(named)), traffic=False).model, Path(str(named)), live
    if live_path.name == CURRENT_ARTIFACT_NAME and live_path == artifact_candidates(settings)[0]:
        # a refit published live: its versioned copy is the one that stays
        return live, live_path.parent / "versions" / f"{live.version}.skops", live
    return live, live_path, live


def _learner(settings: Settings, base: classifier.EffortModel, store: LearnerStore,
             checkpoint: dict[str, Any]) -> classifier.OffPolicyLearner:
    config = classifier.LearnerConfig(tenant_weight=settings.routing.tenant_adaptation)
    if checkpoint.get("base") == base.version and store.state.exists():
        return classifier.load_learner(store.state, base, config)
    return classifier.OffPolicyLearner(base, config)


def _calibrated(candidate: classifier.EffortModel, session_factory: sessionmaker[Session],
                like: classifier.EffortModel, latest: int = 4096) -> classifier.EffortModel:
    """``candidate`` with its score quantiles (the thresholds a gateway uses until its traffic
    window is warm) taken from its own scores on the latest logged decisions — the traffic it
    will see — rather than the base model's training data."""
    with session_factory() as session:
        rows = session.execute(sa.select(RoutingDecision.features, RoutingDecision.tenant_id)
                               .order_by(RoutingDecision.created_at.desc()).limit(latest)).all()
    scores = []
    for features, tenant in rows:
        feats = classifier.SparseFeatures.from_json(features)
        if feats.feature_version == candidate.feature_version:
            scores.append(candidate.decide_features(feats, tenant).score)
    if len(scores) < 100 or len(like.score_quantiles) < 2:
        return candidate
    quantiles = tuple(float(q) for q in np.quantile(scores, np.linspace(0.0, 1.0, len(like.score_quantiles))))
    calibrated = dataclasses.replace(candidate, score_quantiles=quantiles)
    return dataclasses.replace(calibrated, thresholds=calibrated.reference_thresholds(calibrated.tier_shares))


def quality_curve(model: classifier.EffortModel, held: list[classifier.OutcomeRecord],
                  mix: dict[str, float]) -> dict[str, list[float]] | None:
    """(strong share → PGR) of ``model``'s routing on ``held``, estimated off-policy: what a quality
    target ("keep ≥ X of the all-strong quality") sets the thresholds' strong share from."""
    def arrays(r: classifier.OutcomeRecord) -> tuple[np.ndarray, np.ndarray]:
        if r.features is not None:
            return np.asarray(r.features.indices, dtype=np.int64), np.asarray(r.features.values, dtype=np.float64)
        return classifier.extract_arrays(r.messages or [])

    scores = np.asarray([model.raw_score(*arrays(r), r.tenant) for r in held])
    base = classifier.full_mix(mix)
    shares = np.linspace(0.0, 1.0, 11)
    values = [classifier.policy_value(scores, held, [classifier.mix_with_strong_share(base, float(q))]).value
              for q in shares]
    span = values[-1] - values[0]
    if not np.isfinite(span) or span <= 0:
        return None  # the strong tiers do not pay on this traffic: no curve to aim at
    pgr = np.maximum.accumulate(np.clip((np.asarray(values) - values[0]) / span, 0.0, 1.0))
    return {"shares": [float(q) for q in shares], "pgr": [float(p) for p in pgr]}


def learn_once(settings: Settings, session_factory: sessionmaker[Session]) -> LearnReport:
    """One update, if there are enough new outcomes (see the module docstring)."""
    store = LearnerStore(settings)
    checkpoint = store.read()
    after = int(checkpoint.get("seq") or 0)
    rows = new_outcome_records(session_factory, after)
    if len(rows) < settings.routing.learn_min_records:
        return LearnReport("waiting", len(rows))
    base, base_path, live = _models(settings)
    if checkpoint.get("base") not in (None, base.version):
        after = 0  # a new base (a full refit): learn every outcome again on top of it
        rows = new_outcome_records(session_factory, 0)
    learner = _learner(settings, base, store, checkpoint)
    started = time.perf_counter()
    version = f"{base.version}-online-{rows[-1][0]}"
    result = classifier.learn_and_guard(live, learner, [r for _, r in rows], version=version,
                                       holdback=settings.routing.learn_holdback,
                                       mix=dict(settings.classifier.target_mix))
    seconds = time.perf_counter() - started
    verdict = result.verdict
    report = LearnReport("published" if verdict.accepted else "refused", len(rows), result.learned,
                         result.held_back, version, verdict.current.value, verdict.candidate.value, seconds,
                         verdict.reason)
    if not verdict.accepted:
        log.warning("routing update refused: %s", report.line())
        return report
    candidate = _calibrated(result.candidate, session_factory, live)
    records = [r for _, r in rows]
    ordered = sorted(records, key=lambda r: r.timestamp or 0.0) if all(r.timestamp for r in records) else records
    curve = quality_curve(candidate, ordered[-result.held_back:], dict(settings.classifier.target_mix))
    classifier.publish_artifact(candidate, settings.resolve_path(settings.classifier.feedback_dir),
                                data_hash=f"outcomes:{after}-{rows[-1][0]}", live_name=CURRENT_ARTIFACT_NAME,
                                extra={"learner_base_path": str(base_path), "learned_records": result.learned,
                                       **({"quality_curve": curve} if curve else {})})
    store.write(learner, {"seq": rows[-1][0], "base": base.version, "published": version})
    log.info("routing update published: %s", report.line())
    return report
