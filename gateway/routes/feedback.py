"""``POST /v1/feedback``: a client says what came of a past request's answer.

Body: ``request_id`` (one of the caller's own requests) and its outcome — ``outcome`` in [0, 1]
(how well the answer served), or ``rating`` (``good`` = 1, ``bad`` = 0) — for the arm (tier)
that ran: an outcome row (gateway.learning.outcomes) carrying the routing decision's arm,
propensity and hashed features, which ``tiergate routing learn`` learns from off-policy. For a
request the classifier did not route, the conversation (``messages`` or ``prompt``) lets it be
learned from too. A legacy ``label_tier`` (the tier that should have answered) is still stored
for ``tiergate classifier update`` refits, and counts as outcome 1 when the tier that ran was at
least that tier. Prompt text is stored only when the tenant allows prompt storage.

Imports settings, errors, deps, identifiers, request_body, db models and gateway.learning; no
pipeline, no providers.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from gateway.auth import Principal as PrincipalLike
from gateway.errors import InvalidRequest, NotFound
from gateway.ids import Identifier
from gateway.learning.outcomes import record_outcome
from gateway.learning.perceive import TIER_SCORES, feedback_fields, record_verdict
from gateway.runtime import Runtime
from gateway.settings import TIER_NAMES, Tier
from gateway.web.deps import get_runtime, principal
from gateway.web.request_body import read_model

router = APIRouter()
MAX_FEEDBACK_BYTES = 1024 * 1024


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    request_id: Identifier
    outcome: float | None = Field(None, ge=0.0, le=1.0)  # how well the answer served (1: fully)
    label_tier: Tier | None = None
    rating: Literal["good", "bad"] | None = None
    score: float | None = Field(None, ge=0.0, le=1.0)
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None


_MISSING = "\x00missing"


def _request_tier(session_factory: Any, request_id: str, tenant_id: str) -> str | None:
    """The tier the request ran on (None for none recorded); _MISSING unless it is one of the
    tenant's requests."""
    import sqlalchemy as sa

    from gateway.db.models import Request as RequestRow

    with session_factory() as session:
        row = session.execute(sa.select(RequestRow.tier).where(
            RequestRow.id == request_id, RequestRow.tenant_id == tenant_id)).first()
    return _MISSING if row is None else row[0]


async def _find_request(state: Runtime, request_id: str, tenant_id: str) -> str | None:
    used = await run_in_threadpool(_request_tier, state.session_factory, request_id, tenant_id)
    if used == _MISSING:
        # The request row may still be in the ledger's journal (flushed every few ms): flush, retry.
        await state.ledger.aflush()
        used = await run_in_threadpool(_request_tier, state.session_factory, request_id, tenant_id)
    if used == _MISSING:
        raise NotFound(f"No request with id '{request_id}' for this API key's tenant.", param="request_id")
    return used


def _outcome(body: FeedbackBody, used: str | None) -> float:
    """What came of the arm that ran: ``outcome`` as given, ``rating`` good/bad as 1/0, or a legacy
    ``label_tier`` as 1 when the tier that ran was at least that tier (it was enough), else 0."""
    if body.outcome is not None:
        return body.outcome
    if body.rating is not None:
        return 1.0 if body.rating == "good" else 0.0
    if body.label_tier is None:
        raise InvalidRequest("Give 'outcome', 'rating' or 'label_tier'.", param="outcome")
    if used not in TIER_NAMES:
        return 0.5  # unused: a request on no tier records no outcome
    return 1.0 if TIER_NAMES.index(used) >= TIER_NAMES.index(body.label_tier) else 0.0  # type: ignore[arg-type]


@router.post("/v1/feedback")
async def post_feedback(request: Request, state: Runtime = Depends(get_runtime),
                        who: PrincipalLike = Depends(principal)) -> Response:
    body = await read_model(request, state.settings.server, FeedbackBody, max_bytes=MAX_FEEDBACK_BYTES)
    tenant_id = str(who.tenant_id)
    used = await _find_request(state, body.request_id, tenant_id)
    outcome = _outcome(body, used)
    messages = body.messages if body.messages else (
        [{"role": "user", "content": body.prompt}] if body.prompt else None)
    allow_text = bool(getattr(who, "allow_prompt_storage", False)) or state.settings.classifier.store_prompt_text
    record = functools.partial(
        record_outcome, state.session_factory, request_id=body.request_id, tenant_id=tenant_id, outcome=outcome,
        source="feedback", messages=messages, allow_prompt_storage=allow_text)
    oid = await run_in_threadpool(record)
    if oid is None and state.decisions is not None:  # its decision may still be on its way to the database
        await run_in_threadpool(state.decisions.flush)
        oid = await run_in_threadpool(record)
    out: dict[str, Any] = {"id": oid, "object": "feedback", "request_id": body.request_id, "arm": used,
                           "outcome": outcome, "learned": oid is not None}
    if body.label_tier is not None:  # the legacy label also feeds `tiergate classifier update` refits
        text, features = feedback_fields(messages, allow_text) if messages else (None, None)
        score = body.score if body.score is not None else TIER_SCORES[body.label_tier]
        fid = await run_in_threadpool(record_verdict, state.session_factory, body.request_id, tenant_id,
                                      body.label_tier, score, text, features, source="user")
        out.update(id=oid or fid, label_tier=body.label_tier, score=score,
                   stored="text" if text is not None else ("features" if features is not None else "label"))
    return Response(orjson.dumps(out), media_type="application/json")
