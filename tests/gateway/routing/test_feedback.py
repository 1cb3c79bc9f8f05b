"""POST /v1/feedback through the real app, and the classifier deciding ``model: auto`` inside it
(lifespan builds the Perceiver from the artifact next to the config)."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from classifier import TrainConfig, save_artifact, train
from gateway.db.models import Feedback, RoutingOutcome, Tenant
from gateway.learning.perceive import artifact_candidates
from tests.classifier.synthetic import prompts_of, tiny_dataset
from tests.gateway.gateway_harness import Gateway, gateway
from tests.gateway.scripted_upstream import ScriptedUpstream

MSGS = [{"role": "user", "content": prompts_of(3, 1)[0]}]  # an olympiad-style prompt


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("art") / "effort.skops"
    result = train(tiny_dataset(), TrainConfig(), cv=False, version="effort-feedback-test")
    save_artifact(result.model, path, data_hash=result.data_hash)
    return path


async def _request(gw: Gateway, model: str = "low", **extra: object) -> str:
    r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                             json={"model": model, "messages": MSGS, **extra})
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def _rows(gw: Gateway) -> list[Feedback]:
    with gw.session_factory() as s:
        return list(s.scalars(sa.select(Feedback).order_by(Feedback.created_at)))


def _outcomes(gw: Gateway) -> list[RoutingOutcome]:
    with gw.session_factory() as s:
        return list(s.scalars(sa.select(RoutingOutcome).order_by(RoutingOutcome.seq)))


async def test_a_rating_is_the_outcome_of_the_arm_that_ran(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    """Not a guess at the tier that "was needed": a bad answer on low is outcome 0 *for low*."""
    async with gateway(tmp_path, upstream) as gw:
        rid = await _request(gw, "low")
        r = await gw.client.post("/v1/feedback", headers=gw.auth,
                                 json={"request_id": rid, "rating": "bad", "messages": MSGS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "feedback" and (body["arm"], body["outcome"], body["learned"]) == ("low", 0.0, True)
        (row,) = _outcomes(gw)
        assert (row.request_id, row.tenant_id, row.arm, row.outcome, row.source) == (rid, gw.tenant_id, "low", 0.0,
                                                                                    "feedback")
        assert row.propensity == 1.0 and row.prompt_text is None and row.features["v"]  # hashed features only
        assert _rows(gw) == []  # no label tier was invented
        r = await gw.client.post("/v1/feedback", headers=gw.auth, json={"request_id": rid, "outcome": 0.75})
        assert r.json()["learned"] is False  # no decision logged and no conversation given: nothing to learn from
        r = await gw.client.post("/v1/feedback", headers=gw.auth,
                                 json={"request_id": rid, "outcome": 0.75, "prompt": "again"})
        assert r.json()["learned"] is True and [o.outcome for o in _outcomes(gw)] == [0.0, 0.75]


async def test_feedback_stores_text_when_tenant_allows(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        with gw.session_factory() as s, s.begin():
            s.execute(sa.update(Tenant).where(Tenant.id == gw.tenant_id).values(allow_prompt_storage=True))
        gw.app.state.tiergate.keys.clear()  # drop the cached principal so the new flag is seen
        rid = await _request(gw, "low")
        r = await gw.client.post("/v1/feedback", headers=gw.auth,
                                 json={"request_id": rid, "label_tier": "xhigh", "score": 0.9, "prompt": "hard one"})
        assert r.status_code == 200, r.text
        assert r.json()["stored"] == "text" and r.json()["outcome"] == 0.0  # low ran; xhigh was needed
        (row,) = _rows(gw)
        assert "hard one" in row.prompt_text and row.score == 0.9 and row.label_tier == "xhigh"


async def test_feedback_errors(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        rid = await _request(gw)
        r = await gw.client.post("/v1/feedback", headers=gw.auth, json={"request_id": "chatcmpl-nope", "rating": "bad"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "request_id"
        r = await gw.client.post("/v1/feedback", headers=gw.auth, json={"request_id": rid})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await gw.client.post("/v1/feedback", headers=gw.auth, json={"request_id": rid, "label_tier": "huge"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "label_tier"
        r = await gw.client.post("/v1/feedback", headers=gw.auth, content=b"{not json")
        assert r.status_code == 400
        r = await gw.client.post("/v1/feedback", json={"request_id": rid, "rating": "bad"})
        assert r.status_code == 401
        assert _rows(gw) == []


@pytest.mark.slow
async def test_auto_is_decided_by_the_classifier_and_recorded(tmp_path: Path, upstream: ScriptedUpstream,
                                                             artifact: Path) -> None:
    live = tmp_path / "classifier" / "artifacts" / "effort.skops"
    live.parent.mkdir(parents=True)
    live.write_bytes(artifact.read_bytes())
    live.with_suffix(".json").write_bytes(artifact.with_suffix(".json").read_bytes())
    async with gateway(tmp_path, upstream) as gw:
        assert artifact_candidates(gw.settings)[1] == live
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={"model": "auto", "messages": MSGS})
        assert r.status_code == 200, r.text
        assert r.headers["x-tiergate-effort-source"] == "classifier"
        assert r.headers["x-tiergate-classifier-version"] == "effort-feedback-test"
        score = float(r.headers["x-tiergate-effort-score"])
        r2 = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                  json={"model": "auto", "messages": MSGS, "reasoning_effort": "minimal"})
        assert r2.headers["x-tiergate-tier"] == "minimal" and r2.headers["x-tiergate-effort-source"] == "client"
        assert "x-tiergate-classifier-version" not in r2.headers
        rows = {row.id: row for row in gw.request_rows()}
        row = rows[r.json()["id"]]
        assert (row.effort_source, row.classifier_version) == ("classifier", "effort-feedback-test")
        assert row.classifier_score == pytest.approx(score, abs=1e-4)
        assert row.tier in ("medium", "high", "xhigh")  # the olympiad prompt is not sent to the cheap tiers
        assert rows[r2.json()["id"]].effort_source == "client"
