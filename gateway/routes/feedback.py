"""``POST /v1/feedback``: a client says how much effort a past request really needed.

Body: ``request_id`` (one of the caller's own requests) and either ``label_tier`` (the tier
that should have answered) or ``rating`` (``good``: the tier used was right; ``bad``: it
needed one tier more), optionally ``score`` in [0, 1] and the conversation (``messages`` or
``prompt``) so that the example can be learned from. The prompt text is stored only when
the tenant allows prompt storage; otherwise only its hashed feature vector is kept.
`tiergate classifier update` refits the classifier from these rows.

Imports settings, errors, deps, identifiers, request_body, db models and gateway.perceive; no
pipeline, no providers.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from gateway.auth import Principal as PrincipalLike
from gateway.deps import get_runtime, principal
from gateway.errors import InvalidRequest, NotFound
from gateway.identifiers import Identifier
from gateway.perceive import TIER_SCORES, feedback_fields, record_verdict
from gateway.request_body import read_model
from gateway.runtime import Runtime
from gateway.settings import TIER_NAMES, Tier

router = APIRouter()
MAX_FEEDBACK_BYTES = 1024 * 1024


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    request_id: Identifier
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


def _label(body: FeedbackBody, used: str | None) -> str:
    if body.label_tier is not None:
        return body.label_tier
    if body.rating is None:
        raise InvalidRequest("Give 'label_tier' or 'rating'.", param="label_tier")
    if used not in TIER_NAMES:
        raise InvalidRequest("That request did not run on a tier; give 'label_tier'.", param="label_tier")
    i = TIER_NAMES.index(used)  # type: ignore[arg-type]
    return used if body.rating == "good" else TIER_NAMES[min(i + 1, len(TIER_NAMES) - 1)]  # type: ignore[return-value]


@router.post("/v1/feedback")
async def post_feedback(request: Request, state: Runtime = Depends(get_runtime),
                        who: PrincipalLike = Depends(principal)) -> Response:
    body = await read_model(request, state.settings.server, FeedbackBody, max_bytes=MAX_FEEDBACK_BYTES)
    tenant_id = str(who.tenant_id)
    used = await _find_request(state, body.request_id, tenant_id)
    label = _label(body, used)
    messages = body.messages if body.messages else (
        [{"role": "user", "content": body.prompt}] if body.prompt else None)
    allow_text = bool(getattr(who, "allow_prompt_storage", False)) or state.settings.classifier.store_prompt_text
    text, features = feedback_fields(messages, allow_text) if messages else (None, None)
    score = body.score if body.score is not None else TIER_SCORES[label]
    fid = await run_in_threadpool(record_verdict, state.session_factory, body.request_id, tenant_id, label,
                                  score, text, features, source="user")
    stored = "text" if text is not None else ("features" if features is not None else "label")
    out = {"id": fid, "object": "feedback", "request_id": body.request_id, "label_tier": label,
           "score": score, "stored": stored}
    return Response(orjson.dumps(out), media_type="application/json")
