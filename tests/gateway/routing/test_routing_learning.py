"""Routing learns from outcomes, through the product's own loop: ``auto`` requests routed by the
classifier with exploration (decisions logged with their propensities), a scripted upstream
whose answers are right only on the strong model when a hidden property is in the prompt, the
client's feedback on each answer, ``tiergate routing learn``'s update, and the gateway's hot
reload. Before, the router cannot tell those prompts apart; after, it sends them to the strong
tiers and the others to the weak ones. An update that would route worse on held-back traffic is
refused and nothing is published."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import classifier
from classifier import TrainConfig, save_artifact, train
from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.db.models import RoutingDecision, RoutingOutcome, Tenant
from gateway.learning.learner import learn_once
from gateway.learning.outcomes import features_json
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from gateway.settings import settings_from_dict
from tests.classifier.synthetic import tiny_dataset
from tests.gateway.gateway_harness import Gateway, asgi_client, make_database
from tests.gateway.scripted_upstream import Behaviour, ScriptedUpstream, config_for

pytestmark = pytest.mark.slow

MARKER = "zorblax"  # the hidden property: the base router has never seen this word
STRONG = ("high", "xhigh")
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]
THINGS = ["pencils", "tickets", "melons", "bolts", "stickers", "candles", "buttons", "plates"]


class GradedUpstream(ScriptedUpstream):
    """Answers "correct" unless the prompt has the hidden property and a weak model answers it."""

    @staticmethod
    def _content(body: dict[str, Any], n: int, b: Behaviour = Behaviour()) -> str:
        prompt = str(body["messages"][-1]["content"])
        strong = body["model"] == "upstream-strong"
        return "correct" if strong or MARKER not in prompt else "wrong"


def prompt(r: random.Random, hidden: bool) -> str:
    topic = MARKER if hidden else r.choice(["garden", "picnic", "market"])
    return (f"{r.choice(NAMES)} keeps the {topic} notes for the {r.choice(THINGS)} and asks {r.choice(NAMES)} "
            f"to check {r.randint(2, 99)} of them before the end of the week.")


@pytest.fixture(scope="module")
def base_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("artifact") / "effort.skops"
    result = train(tiny_dataset(), TrainConfig(), cv=False, version="base")
    save_artifact(result.model, path, data_hash=result.data_hash)
    return path


def _config(upstream: ScriptedUpstream, url: str, tmp_path: Path, base: Path) -> dict[str, Any]:
    cfg = config_for(upstream.base_url, db_url=url)
    model = dict(cfg["models"]["up-a"])
    cfg["models"] = {"weak": {**model, "model": "upstream-weak"}, "strong": {**model, "model": "upstream-strong"}}
    cfg["tiers"] = {t: {"model": "strong" if t in STRONG else "weak"} for t in
                    ("none", "minimal", "low", "medium", "high", "xhigh")}
    live = tmp_path / "classifier" / "artifacts" / "effort.skops"
    live.parent.mkdir(parents=True)
    live.write_bytes(base.read_bytes())
    live.with_suffix(".json").write_bytes(base.with_suffix(".json").read_bytes())
    cfg["classifier"] = {"reload_interval_s": 0.01}
    cfg["routing"] = {"exploration": 0.5, "learn_min_records": 100}
    return cfg


@asynccontextmanager
async def learning_gateway(tmp_path: Path, upstream: ScriptedUpstream, base: Path) -> AsyncIterator[Gateway]:
    url, sf, tenant_id, raw = make_database(tmp_path)
    settings = settings_from_dict(_config(upstream, url, tmp_path, base), base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf)))
    try:
        async with asgi_client(app) as client:
            yield Gateway(app, client, settings, upstream, ledger, sf, tenant_id, raw)
    finally:
        ledger.stop()


async def _ask(gw: Gateway, text: str) -> tuple[str, str, str]:
    r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={
        "model": "auto", "messages": [{"role": "user", "content": text}], "tiergate": {"pipeline": "off"}})
    assert r.status_code == 200, r.text
    return r.json()["id"], r.headers["x-tiergate-tier"], r.json()["choices"][0]["message"]["content"]


def _set_exploration(gw: Gateway, share: float) -> None:
    with gw.session_factory.begin() as s:
        s.execute(sa.update(Tenant).where(Tenant.id == gw.tenant_id).values(routing_exploration=share))
    gw.app.state.tiergate.keys.clear()


async def _routes(gw: Gateway, r: random.Random, n: int) -> dict[bool, list[str]]:
    tiers: dict[bool, list[str]] = {True: [], False: []}
    for i in range(n):
        hidden = i % 10 == 0  # a tenth of the traffic: the share the strong tiers get
        tiers[hidden].append((await _ask(gw, prompt(r, hidden)))[1])
    return tiers


def _strong_share(tiers: list[str]) -> float:
    return sum(t in STRONG for t in tiers) / len(tiers)


async def test_the_router_learns_a_hidden_property_from_logged_outcomes(tmp_path: Path, base_artifact: Path) -> None:
    r = random.Random(5)
    with GradedUpstream() as upstream:
        async with learning_gateway(tmp_path, upstream, base_artifact) as gw:
            _set_exploration(gw, 0.0)
            before = await _routes(gw, r, 300)
            assert _strong_share(before[True]) < 0.5  # the router cannot tell these prompts apart yet
            _set_exploration(gw, 0.5)
            for i in range(2400):  # traffic with exploration; the client grades every answer
                hidden = i % 4 == 0
                rid, _tier, answer = await _ask(gw, prompt(r, hidden))
                fb = await gw.client.post("/v1/feedback", headers=gw.auth,
                                          json={"request_id": rid, "outcome": 1.0 if answer == "correct" else 0.0})
                assert fb.status_code == 200 and fb.json()["learned"], fb.text
            with gw.session_factory() as s:
                decisions = list(s.scalars(sa.select(RoutingDecision)))
            assert len(decisions) >= 2700 and any(d.explored and d.propensity < 0.5 for d in decisions)
            assert all(abs(d.propensity - ((0.5 + 0.5 / 6) if not d.explored else 0.5 / 6)) < 1e-9
                       for d in decisions if d.request_id and d.propensity < 1)
            report = learn_once(gw.settings, gw.session_factory)
            assert report.status == "published", report.line()
            assert report.candidate_value is not None and report.current_value is not None
            assert report.candidate_value > report.current_value
            _set_exploration(gw, 0.0)
            version = None
            deadline = time.monotonic() + 30  # the gateway hot-reloads the published update (loaded off the loop)
            while time.monotonic() < deadline:
                r2 = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={
                    "model": "auto", "messages": [{"role": "user", "content": prompt(r, False)}]})
                version = r2.headers["x-tiergate-classifier-version"]
                if version == report.version:
                    break
                await asyncio.sleep(0.02)
            assert version == report.version
            await _routes(gw, r, 300)  # the traffic window warms up on this version's own scores
            after = await _routes(gw, r, 400)
    assert _strong_share(after[True]) >= 0.8, after[True]  # the property's prompts → the strong arm
    assert _strong_share(after[False]) <= 0.1, after[False]  # the others → the weak arm


def _outcome_rows(settings_base: Path, n: int, *, flipped_until: int, seed: int) -> list[RoutingOutcome]:
    """Logged outcomes of a uniformly exploring policy over weak and strong tiers; the first
    ``flipped_until`` have their outcomes inverted (a poisoned or broken feedback source)."""
    r = random.Random(seed)
    rows = []
    for i in range(n):
        hidden = r.random() < 0.5
        arm = r.choice(["low", "high"])
        good = arm == "high" or not hidden
        outcome = float(good != (i < flipped_until))
        feats = classifier.extract([{"role": "user", "content": prompt(r, hidden)}])
        rows.append(RoutingOutcome(id=uuid.uuid4().hex, request_id=None, tenant_id=None, source="import", arm=arm,
                                   outcome=outcome, propensity=0.5, features=features_json(feats)))
    return rows


async def test_an_update_that_routes_worse_on_held_back_traffic_is_refused(tmp_path: Path,
                                                                          base_artifact: Path) -> None:
    with GradedUpstream() as upstream:
        async with learning_gateway(tmp_path, upstream, base_artifact) as gw:
            with gw.session_factory.begin() as s:  # 80% inverted outcomes, the held-back 20% true
                s.add_all(_outcome_rows(base_artifact, 1000, flipped_until=800, seed=1))
            report = learn_once(gw.settings, gw.session_factory)
            assert report.status == "refused", report.line()
            assert report.candidate_value is not None and report.current_value is not None
            assert report.candidate_value < report.current_value
            live = tmp_path / "var" / "classifier" / "effort.skops"
            assert not live.exists()  # nothing was published
            checkpoint = tmp_path / "var" / "classifier" / "learner" / "checkpoint.json"
            assert not checkpoint.exists()  # the outcomes will be reconsidered with more data
