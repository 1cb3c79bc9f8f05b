"""Outcomes as the unit of learning: the decision log and the outcome rows.

- ``DecisionLog``: every request the classifier routed (``model: "auto"``) is logged, off the
  event loop, as a ``routing_decisions`` row — the arm (tier) that ran, the greedy arm, the
  propensity of the arm that ran, the score and classifier version, the prompt's hashed features
  (its text only when the tenant allows prompt storage).
- ``record_outcome``: what came of the arm that ran on a request (client feedback, a pipeline
  review), as a ``routing_outcomes`` row carrying the decision's arm, propensity and features —
  never a guess about what "would have been needed".
- ``import_outcomes``: an evaluation file (JSONL: ``prompt`` or ``messages`` and per-arm
  ``outcomes``, full or partial; see ``classifier.load_outcome_items``) as outcome rows, each arm's
  result a row with propensity 1 (the operator chose to run it).
- ``new_outcome_records``: rows after a checkpoint, as ``classifier.OutcomeRecord``s for the
  learner, in arrival order.

Learning data is not on the money path: the decision log logs and drops on a database error.
Imports the classifier's public API, settings and the db models; no web framework.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import classifier
from gateway.db.models import Request, RoutingDecision, RoutingOutcome
from gateway.learning.perceive import RoutingVerdict, conversation_json
from gateway.log_safety import describe
from gateway.settings import TIER_NAMES, Settings

log = logging.getLogger(__name__)
SOURCES = ("feedback", "review", "import")


def features_json(features: classifier.SparseFeatures) -> dict[str, Any]:
    return features.to_json()


class DecisionLog:
    """Writes decision rows on one worker thread, in arrival order (``log`` never blocks)."""

    def __init__(self, session_factory: sessionmaker[Session], settings: Settings) -> None:
        self.session_factory, self.mode = session_factory, settings.routing.decision_log
        self.store_text_default = settings.classifier.store_prompt_text
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiergate-decisions")

    def log(self, request_id: str, tenant_id: str, verdict: object, messages: Sequence[dict[str, Any]],
            allow_prompt_storage: bool) -> None:
        if not isinstance(verdict, RoutingVerdict) or self.mode == "none" or (
                self.mode == "explored" and not verdict.explored):
            return
        text = conversation_json(messages) if (allow_prompt_storage or self.store_text_default) else None
        row = RoutingDecision(request_id=request_id, tenant_id=tenant_id, arm=verdict.tier,
                              greedy_arm=verdict.greedy_tier, propensity=verdict.propensity,
                              explored=verdict.explored, score=verdict.score, classifier_version=verdict.version,
                              features=features_json(verdict.features), prompt_text=text)
        self._pool.submit(self._write, row)

    def _write(self, row: RoutingDecision) -> None:
        try:
            with self.session_factory.begin() as session:
                session.merge(row)
        except Exception as err:
            log.error("could not log a routing decision: %s", describe(err))

    def flush(self) -> None:
        """Wait until every decision logged so far is written (blocks: call off the event loop)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        """Wait for queued decisions to be written."""
        self._pool.shutdown(wait=True)


def _insert(session: Session, **fields: Any) -> str:
    oid = "out_" + uuid.uuid4().hex
    session.add(RoutingOutcome(id=oid, **fields))
    return oid


def record_outcome(session_factory: sessionmaker[Session], *, request_id: str, tenant_id: str, outcome: float,
                   source: str, messages: Sequence[dict[str, Any]] | None = None,
                   allow_prompt_storage: bool = False) -> str | None:
    """Record what came of the arm that ran on ``request_id`` (one of ``tenant_id``'s requests);
    returns the outcome's id, or None when there is nothing to learn from (the request is
    unknown, or ran on no tier). A request the classifier routed is recorded with its logged arm,
    propensity and features; any other with the tier it ran on (propensity 1) and the features of
    ``messages`` when they are given."""
    if not 0.0 <= outcome <= 1.0 or source not in SOURCES:
        raise ValueError("outcome must be in [0, 1] and source one of " + ", ".join(SOURCES))
    with session_factory.begin() as session:
        decision = session.get(RoutingDecision, request_id)
        if decision is not None and decision.tenant_id == tenant_id:
            return _insert(session, request_id=request_id, tenant_id=tenant_id, source=source, arm=decision.arm,
                           outcome=outcome, propensity=decision.propensity,
                           classifier_version=decision.classifier_version, features=decision.features,
                           prompt_text=decision.prompt_text)
        row = session.execute(sa.select(Request.tier, Request.classifier_version).where(
            Request.id == request_id, Request.tenant_id == tenant_id)).first()
        if row is None or row[0] not in TIER_NAMES or not messages:
            return None
        return _insert(session, request_id=request_id, tenant_id=tenant_id, source=source, arm=row[0],
                       outcome=outcome, propensity=1.0, classifier_version=row[1],
                       features=features_json(classifier.extract(list(messages))),
                       prompt_text=conversation_json(messages) if allow_prompt_storage else None)


def import_outcomes(session_factory: sessionmaker[Session], path: str | Path, *, tenant_id: str | None = None,
                    allow_prompt_text: bool = False) -> int:
    """Every (prompt, arm) outcome of an evaluation file as an outcome row; returns how many."""
    items = classifier.load_outcome_items(path)
    n = 0
    with session_factory.begin() as session:
        for item in items:
            messages = list(item.messages)
            feats = features_json(classifier.extract(messages))
            text = conversation_json(messages) if allow_prompt_text else None
            for arm, result in item.outcomes.items():
                if arm not in TIER_NAMES:
                    continue
                _insert(session, request_id=None, tenant_id=tenant_id or item.tenant, source="import", arm=arm,
                        outcome=float(result), propensity=1.0, features=feats, prompt_text=text)
                n += 1
    return n


def new_outcome_records(session_factory: sessionmaker[Session], after_seq: int, limit: int = 100_000,
                        ) -> list[tuple[int, classifier.OutcomeRecord]]:
    """Outcome rows after ``after_seq`` (arrival order) as the learner's records."""
    out: list[tuple[int, classifier.OutcomeRecord]] = []
    with session_factory() as session:
        rows = session.scalars(sa.select(RoutingOutcome).where(RoutingOutcome.seq > after_seq)
                               .order_by(RoutingOutcome.seq).limit(limit)).all()
        for r in rows:
            feats = classifier.SparseFeatures.from_json(r.features) if r.features else None
            if feats is not None and feats.feature_version != classifier.FEATURE_VERSION:
                feats = None
            messages = json.loads(r.prompt_text) if (feats is None and r.prompt_text) else None
            if feats is None and messages is None:
                continue
            out.append((r.seq, classifier.OutcomeRecord(
                arm=r.arm, outcome=r.outcome, messages=messages, features=feats, propensity=r.propensity,
                cost=None if r.cost_nanos is None else r.cost_nanos / 1e9, tenant=r.tenant_id,
                timestamp=r.created_at.timestamp() if r.created_at else None)))
    return out
