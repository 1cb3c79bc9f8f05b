"""The perceive layer in the gateway: the classifier artifact, hot-reloaded, plus feedback storage.

``Perceiver`` wraps the classifier's public API. It loads the newest artifact among its
candidate paths (by default the one `tiergate classifier update` writes under
``classifier.feedback_dir``, then the shipped ``classifier.artifact``), and at most every
``reload_interval_s`` checks whether that file changed; a changed artifact is loaded on a
background thread and swapped in atomically, so the gateway picks up a new classifier
without a restart and no request waits on a load. A broken or tampered new artifact is
refused (logged) and the current one stays.

``record_verdict`` stores one labelled example in the ``feedback`` table: prompt text only
where the tenant allows it, otherwise only the hashed feature vector (enough to retrain).

Imports the classifier's public API, settings and db models only; no web framework.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import classifier
from classifier import EffortDecision, EffortModel
from gateway.log_safety import describe
from gateway.routing import NO_PREFS, RoutingPrefs
from gateway.settings import CLASSIFIER_CURRENT_NAME, TIER_NAMES, Settings

log = logging.getLogger("tiergate.perceive")

CURRENT_ARTIFACT_NAME = CLASSIFIER_CURRENT_NAME
TIER_SCORES: dict[str, float] = {"none": 0.05, "minimal": 0.15, "low": 0.25, "medium": 0.5, "high": 0.75,
                                 "xhigh": 0.95}

__all__ = ["TIER_SCORES", "EffortDecision", "FeedbackRecorder", "Perceiver", "artifact_candidates", "build_perceiver",
           "conversation_json", "feedback_examples", "record_verdict"]


def artifact_candidates(settings: Settings) -> list[Path]:
    """Where the gateway looks for the classifier, most preferred first."""
    return [settings.resolve_path(settings.classifier.feedback_dir) / CURRENT_ARTIFACT_NAME,
            *settings.classifier_artifact_paths()]


@dataclass(frozen=True)
class RoutingVerdict:
    """The classifier's routing of one ``auto`` request (``gateway.routing.EffortVerdict``): the
    tier to run, its propensity (< 1 when exploration may have changed it), the greedy tier, and
    the prompt's hashed features, logged so the outcome can be learned from off-policy."""

    tier: str
    score: float
    version: str
    propensity: float
    explored: bool
    greedy_tier: str
    features: classifier.SparseFeatures


@dataclass(frozen=True)
class _Loaded:
    model: EffortModel
    path: Path
    stamp: tuple[int, int]  # (mtime_ns, size) of the .skops file when loaded
    quality_curve: tuple[np.ndarray, np.ndarray] | None = None  # (strong share, PGR) measured on outcomes
    variants: dict[tuple[float | None, float | None], EffortModel | None] = field(default_factory=dict)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class Perceiver:
    """``decide(messages) -> EffortDecision`` over the current artifact, reloaded when it changes."""

    def __init__(self, paths: Sequence[str | Path], *, reload_interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, background: bool = True,
                 target_mix: Mapping[str, float] | None = None, exploration: float = 0.0,
                 rng: random.Random | None = None) -> None:
        self.paths = [Path(p) for p in paths]
        self.exploration = exploration
        self.target_quality: float | None = None
        self.target_cost: float | None = None
        self.tier_costs: dict[str, float] | None = None  # per tier, relative (for cost targets)
        self._rng = rng or random.Random()
        self.target_mix = dict(target_mix) if target_mix else None
        self.reload_interval_s = reload_interval_s
        self.clock = clock
        self.background = background
        self._lock = threading.Lock()
        self._loading = False
        self._refused: tuple[Path, tuple[int, int]] | None = None
        self._loaded = self._load(self._pick())
        self._last_check = clock()

    @classmethod
    def from_settings(cls, settings: Settings, **kw: Any) -> Perceiver:
        """Candidates from the config; the config's ``target_mix`` re-derives the thresholds, its
        quality or cost target (if any) sets their strong share."""
        perceiver = cls(artifact_candidates(settings), reload_interval_s=settings.classifier.reload_interval_s,
                        target_mix=settings.classifier.target_mix, exploration=settings.routing.exploration, **kw)
        perceiver.target_quality, perceiver.target_cost = settings.routing.target_quality, settings.routing.target_cost
        perceiver.tier_costs = {t: (settings.tier_price(t).input + settings.tier_price(t).output) / 2
                                for t in TIER_NAMES}
        return perceiver

    def _pick(self) -> Path:
        for p in self.paths:
            if p.exists():
                return p
        raise classifier.ArtifactError("no classifier artifact at " + ", ".join(str(p) for p in self.paths)
                                       + " (train one with `tiergate classifier train`)")

    def _load(self, path: Path) -> _Loaded:
        stamp = _stamp(path)
        # A fresh window per version: thresholds come from this model's own scores on the traffic
        # (until it is warm, from the quantiles it was published with: the learner computes them on
        # the latest logged decisions).
        loaded = classifier.load_artifact(path, traffic=False)
        model = loaded.model.with_traffic(classifier.ScoreWindow())
        if self.target_mix and model.score_quantiles:
            model = model.with_target_mix(self.target_mix)
        elif self.target_mix:
            log.warning("classifier %s stores no score quantiles: using its own thresholds, not "
                        "classifier.target_mix", model.version)
        curve = loaded.metadata.get("quality_curve")
        quality_curve = (np.asarray(curve["shares"], dtype=float), np.asarray(curve["pgr"], dtype=float)) \
            if isinstance(curve, dict) else None
        return _Loaded(model, path, stamp or (0, 0), quality_curve)

    @property
    def model(self) -> EffortModel:
        return self._loaded.model

    @property
    def version(self) -> str:
        return self._loaded.model.version

    def _model_for(self, prefs: RoutingPrefs) -> EffortModel:
        """The live model aiming at the tenant's (or the configured) quality or cost target: the
        strong share of the thresholds from the artifact's quality curve, or from the tiers'
        costs; the target mix when there is no target (or no curve to meet a quality target)."""
        loaded = self._loaded
        quality = prefs.target_quality if prefs.target_quality is not None else self.target_quality
        cost = prefs.target_cost if prefs.target_cost is not None else self.target_cost
        if quality is None and cost is None:
            return loaded.model
        key = (quality, cost)
        if key not in loaded.variants:
            target = classifier.RoutingTarget(self.target_mix or classifier.DEFAULT_TIER_MIX, quality=quality,
                                              quality_curve=loaded.quality_curve, cost_budget=cost,
                                              tier_costs=self.tier_costs)
            try:
                loaded.variants[key] = loaded.model.with_shares(target.shares())
            except classifier.ClassifierError as err:
                log.warning("routing target %s not applied to %s: %s", key, loaded.model.version, err)
                loaded.variants[key] = None
        return loaded.variants[key] or loaded.model

    def decide(self, messages: Sequence[dict[str, Any]], tenant: str | None = None,
               prefs: RoutingPrefs = NO_PREFS) -> RoutingVerdict:
        """The tier for a conversation: the model's (through its traffic-calibrated thresholds aimed
        at the tenant's target, and the tenant's correction, when it has them) or, with
        probability of the tenant's (else the configured) exploration share, a uniformly random
        tier — with the propensity of the one chosen."""
        self.maybe_reload()
        idx, val = classifier.extract_arrays(messages)
        decision = self._model_for(prefs).decide_arrays(idx, val, tenant)
        epsilon = self.exploration if prefs.exploration is None else prefs.exploration
        tier, propensity, explored = classifier.epsilon_greedy(decision.tier, classifier.TIERS, epsilon, self._rng)
        return RoutingVerdict(tier=tier, score=decision.score, version=decision.version, propensity=propensity,
                              explored=explored, greedy_tier=decision.tier,
                              features=classifier.SparseFeatures(tuple(idx.tolist()), tuple(val.tolist()),
                                                                 classifier.FEATURE_VERSION))

    def _changed(self) -> Path | None:
        """The artifact to load if it differs from the current one, else None."""
        for p in self.paths:
            stamp = _stamp(p)
            if stamp is None:
                continue
            if (p, stamp) == (self._loaded.path, self._loaded.stamp) or self._refused == (p, stamp):
                return None
            return p
        return None

    def maybe_reload(self) -> None:
        """Cheap: at most one stat per candidate every ``reload_interval_s``."""
        now = self.clock()
        if now - self._last_check < self.reload_interval_s:
            return
        self._last_check = now
        path = self._changed()
        if path is None:
            return
        if not self.background:
            self.reload_now()
            return
        with self._lock:
            if self._loading:
                return
            self._loading = True
        threading.Thread(target=self._reload_in_background, name="tiergate-perceiver-reload", daemon=True).start()

    def _reload_in_background(self) -> None:
        try:
            self.reload_now()
        finally:
            with self._lock:
                self._loading = False

    def reload_now(self) -> bool:
        """Load the preferred artifact if it changed; True if a new one was swapped in."""
        path = self._changed()
        if path is None:
            return False
        stamp = _stamp(path)
        try:
            loaded = self._load(path)
        except classifier.ArtifactError as err:
            # Refused, e.g. a half-written or tampered file: keep serving the current model.
            log.warning("classifier artifact %s refused, keeping %s: %s", path, self.version, err)
            self._refused = (path, stamp) if stamp else None
            return False
        previous = self.version
        self._loaded = loaded
        log.info("classifier reloaded: %s -> %s (%s)", previous, loaded.model.version, path)
        return True


def build_perceiver(settings: Settings) -> Perceiver | None:
    """The gateway's Perceiver, or None when no artifact exists yet (``auto`` then falls back
    to the default tier). An artifact that exists but fails verification raises."""
    if not any(p.exists() for p in artifact_candidates(settings)):
        log.warning("no classifier artifact at %s: model 'auto' uses the default tier",
                    ", ".join(str(p) for p in artifact_candidates(settings)))
        return None
    return Perceiver.from_settings(settings)


def conversation_json(messages: Sequence[Mapping[str, Any]]) -> str:
    """How a conversation is stored as ``feedback.prompt_text``: OpenAI messages as JSON."""
    return json.dumps([{"role": m.get("role"), "content": m.get("content")} for m in messages],
                      ensure_ascii=False)


def record_verdict(session_factory: Any, request_id: str, tenant_id: str, label_tier: str,
                   score: float | None, prompt_text: str | None, features: dict[str, Any] | None, *,
                   source: str = "review") -> str:
    """Insert one labelled example into ``feedback``; returns its id.

    ``prompt_text`` must already be None unless the tenant allows prompt storage.
    """
    from gateway.db.models import Feedback

    if label_tier not in TIER_NAMES:
        raise ValueError(f"unknown tier {label_tier!r}")
    if score is not None and not 0.0 <= score <= 1.0:
        raise ValueError("score must be in [0, 1]")
    fid = "fb_" + uuid.uuid4().hex
    with session_factory() as session, session.begin():
        session.add(Feedback(id=fid, request_id=request_id, tenant_id=tenant_id, source=source,
                             label_tier=label_tier, score=score, prompt_text=prompt_text, features=features))
    return fid


def feedback_fields(messages: Sequence[dict[str, Any]], allow_text: bool) -> tuple[str | None, dict[str, Any]]:
    """(prompt text or None, hashed features) for a conversation, honouring the tenant's choice."""
    features = classifier.extract(messages).to_json()
    return (conversation_json(messages) if allow_text else None), features


class FeedbackRecorder:
    """The pipeline's feedback sink: stores review verdicts on one worker thread, off the
    event loop, in arrival order.

    Training feedback is not on the money path: a failed insert is logged, never raised
    into the request that produced the verdict.
    """

    def __init__(self, session_factory: Any, settings: Settings) -> None:
        self.session_factory = session_factory
        self.store_text_default = settings.classifier.store_prompt_text
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiergate-feedback")

    def __call__(self, verdict: Any) -> None:
        allow = bool(getattr(verdict, "allow_prompt_storage", False)) or self.store_text_default
        messages = list(getattr(verdict, "messages", ()) or ())
        text, features = feedback_fields(messages, allow) if messages else (None, None)
        args = (self.session_factory, verdict.request_id, verdict.tenant_id, verdict.label_tier,
                TIER_SCORES.get(verdict.label_tier), text, features)
        self._pool.submit(self._write, *args)
        # The outcome of the arm that ran: the reviewer accepted the first answer, or sent it back.
        self._pool.submit(self._write_outcome, verdict.request_id, verdict.tenant_id,
                          1.0 if getattr(verdict, "verdict", None) == "accept" else 0.0, messages, allow)

    def close(self) -> None:
        """Wait for queued verdicts to be written."""
        self._pool.shutdown(wait=True)

    def _write_outcome(self, request_id: str, tenant_id: str, outcome: float,
                       messages: Sequence[dict[str, Any]], allow_text: bool) -> None:
        from gateway.learning.outcomes import record_outcome

        try:
            record_outcome(self.session_factory, request_id=request_id, tenant_id=tenant_id, outcome=outcome,
                           source="review", messages=messages or None, allow_prompt_storage=allow_text)
        except Exception as err:
            log.error("could not store a review verdict as a routing outcome: %s", describe(err))

    @staticmethod
    def _write(*args: Any) -> None:
        try:
            record_verdict(*args, source="review")
        except Exception as err:
            log.error("could not store a review verdict as classifier feedback: %s", describe(err))


def _messages_from_text(text: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, list) and all(isinstance(m, dict) for m in data):
        return data
    return [{"role": "user", "content": text}]


def feedback_examples(session_factory: Any, *, weight: float = 5.0) -> tuple[list[classifier.LabelledExample], int]:
    """Every usable feedback row as a labelled example (source ``feedback``), and how many
    rows were skipped (no text and no features, or features of another version)."""
    import sqlalchemy as sa

    from gateway.db.models import Feedback

    out: list[classifier.LabelledExample] = []
    skipped = 0
    with session_factory() as session:
        rows = session.execute(sa.select(Feedback).order_by(Feedback.created_at, Feedback.id)).scalars().all()
        for row in rows:
            score = row.score if row.score is not None else TIER_SCORES.get(row.label_tier, 0.5)
            if row.prompt_text:
                out.append(classifier.LabelledExample(tier=row.label_tier, score=score, source="feedback",
                                                      messages=_messages_from_text(row.prompt_text),
                                                      weight=weight))
                continue
            feats = classifier.SparseFeatures.from_json(row.features) if row.features else None
            if feats is None or feats.feature_version != classifier.FEATURE_VERSION:
                skipped += 1
                continue
            out.append(classifier.LabelledExample(tier=row.label_tier, score=score, source="feedback",
                                                  features=feats, weight=weight))
    return out, skipped
