"""The off-policy learner: from partial feedback with exploration it recovers a hidden property
that the base model knows nothing about, its pseudo-outcomes are unbiased only with the right
propensities, per-tenant corrections separate tenants, and its state and exported model round-trip."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from classifier import (
    LearnerConfig,
    OffPolicyLearner,
    OutcomeRecord,
    TrainConfig,
    epsilon_greedy,
    extract_arrays,
    load_artifact,
    load_learner,
    save_artifact,
    save_learner,
    train,
    user_prompt,
)
from classifier.model import EffortModel
from tests.classifier.synthetic import tiny_dataset

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]
ITEMS = ["pencils", "tickets", "melons", "bolts", "stickers", "candles", "buttons", "plates"]
HIDDEN = ["ledger", "invoice", "payroll"]  # the strong arm only helps when one of these appears
PLAIN = ["garden", "picnic", "festival"]
ARMS = ("low", "high")


def prompt(r: random.Random, hidden: bool) -> str:
    topic = r.choice(HIDDEN if hidden else PLAIN)
    return (f"{r.choice(NAMES)} keeps the {topic} for the {r.choice(ITEMS)} and asks {r.choice(NAMES)} "
            f"to check {r.randint(2, 99)} of them before the end of the week.")


def success(r: random.Random, hidden: bool, arm: str) -> float:
    p = 0.9 if arm == "high" else (0.2 if hidden else 0.8)
    return float(r.random() < p)


@pytest.fixture(scope="module")
def base() -> EffortModel:
    return train(tiny_dataset(), TrainConfig(), cv=False, version="base").model


def log_decisions(base: EffortModel, n: int, *, epsilon: float, seed: int, adversarial: bool = False,
                  tenant_flip: bool = False) -> list[tuple[OutcomeRecord, bool]]:
    """Records a logging policy would produce: its greedy arm from the base model's score (or, when
    ``adversarial``, exactly the wrong arm), epsilon-explored; only the chosen arm's outcome is seen."""
    r = random.Random(seed)
    out = []
    median = np.median([base.decide(user_prompt(prompt(r, r.random() < 0.5))).score for _ in range(50)])
    for i in range(n):
        hidden = r.random() < 0.5
        tenant = ("b" if i % 2 else "a") if tenant_flip else None
        helps = hidden != (tenant == "b")  # for tenant b the strong arm helps on the *other* prompts
        text = prompt(r, hidden)
        if adversarial:
            greedy = "low" if helps else "high"
        else:
            greedy = "high" if base.decide(user_prompt(text)).score > median else "low"
        arm, p, _ = epsilon_greedy(greedy, ARMS, epsilon, r)
        out.append((OutcomeRecord(arm=arm, outcome=success(r, helps, arm), messages=user_prompt(text), propensity=p,
                                  tenant=tenant), hidden))
    return out


def ranking_accuracy(score: list[float], hidden: list[bool]) -> float:
    """Share of prompts on the right side of the median score (hidden → above)."""
    cut = float(np.median(score))
    return float(np.mean([(s > cut) == h for s, h in zip(score, hidden, strict=True)]))


def fresh(n: int = 200, seed: int = 99) -> tuple[list[list[dict[str, object]]], list[bool]]:
    r = random.Random(seed)
    hidden = [i % 2 == 0 for i in range(n)]
    return [user_prompt(prompt(r, h)) for h in hidden], hidden


@pytest.mark.slow
@pytest.mark.parametrize("adversarial", [False, True])
def test_recovers_a_hidden_property_from_partial_feedback(base: EffortModel, adversarial: bool) -> None:
    convs, hidden = fresh()
    before = [base.decide(c).score for c in convs]
    assert ranking_accuracy(before, hidden) < 0.75  # the base model does not know the property
    learner = OffPolicyLearner(base, LearnerConfig(arms=ARMS))
    learner.update_many([rec for rec, _ in log_decisions(base, 3000, epsilon=0.2, seed=1, adversarial=adversarial)])
    after = [learner.score(*extract_arrays(c)) for c in convs]
    assert ranking_accuracy(after, hidden) > 0.9  # hidden-property prompts → strong arm, others → weak
    model = learner.to_model("base+u1")
    exported = [model.decide(c).score for c in convs]
    assert exported == pytest.approx(after, abs=1e-4)  # the artifact decides exactly what the learner learned
    assert model.parent_version == "base"


@pytest.mark.slow
def test_pseudo_outcomes_are_unbiased_only_with_the_logged_propensities(base: EffortModel) -> None:
    # A fresh learner's outcome model knows nothing (mu = 0.5 everywhere), so the doubly-robust
    # contrast rests on the importance weights: right propensities give the true gain (0.7 on
    # hidden-property prompts, 0.1 elsewhere), ignoring them does not.
    learner = OffPolicyLearner(base, LearnerConfig(arms=ARMS))
    logged = log_decisions(base, 6000, epsilon=0.3, seed=2, adversarial=True)
    for hidden, true_gain in ((True, 0.7), (False, 0.1)):
        rows = [rec for rec, h in logged if h == hidden]
        right = np.mean([learner.pseudo_outcome(rec, *extract_arrays(rec.messages or [])) for rec in rows])
        wrong = np.mean([learner.pseudo_outcome(OutcomeRecord(rec.arm, rec.outcome, rec.messages),
                                                *extract_arrays(rec.messages or [])) for rec in rows])
        assert right == pytest.approx(true_gain, abs=0.12)
        assert abs(wrong - true_gain) > 0.15  # (analytically 0.39 and 0.20 here)


@pytest.mark.slow
def test_tenant_corrections_learn_what_differs_between_tenants(base: EffortModel) -> None:
    learner = OffPolicyLearner(base, LearnerConfig(arms=ARMS, tenant_weight=0.1, tenant_min_records=50))
    learner.update_many([rec for rec, _ in log_decisions(base, 4000, epsilon=0.3, seed=3, tenant_flip=True)])
    convs, hidden = fresh()

    def separation(tenant: str) -> float:
        s = np.asarray([learner.score(*extract_arrays(c), tenant) for c in convs])
        h = np.asarray(hidden)
        return float(s[h].mean() - s[~h].mean())

    assert separation("a") > 0 > separation("b")
    model = learner.to_model("base+t")
    assert set(model.tenants) == {"a", "b"}
    got = [model.decide(c, tenant="b").score for c in convs[:20]]
    assert got == pytest.approx([learner.score(*extract_arrays(c), "b") for c in convs[:20]], abs=1e-4)


def test_state_and_exported_artifact_round_trip(base: EffortModel, tmp_path: Path) -> None:
    learner = OffPolicyLearner(base, LearnerConfig(arms=ARMS, tenant_weight=0.1, tenant_min_records=1))
    learner.update_many([rec for rec, _ in log_decisions(base, 300, epsilon=0.2, seed=4, tenant_flip=True)])
    save_learner(learner, tmp_path / "learner.npz")
    again = load_learner(tmp_path / "learner.npz", base)
    convs, _ = fresh(20)
    for c in convs:
        arrays = extract_arrays(c)
        assert again.score(*arrays, "a") == pytest.approx(learner.score(*arrays, "a"), abs=1e-12)
    assert again.seen == learner.seen == 300
    model = learner.to_model("base+u2")
    save_artifact(model, tmp_path / "u.skops", data_hash="x")
    loaded = load_artifact(tmp_path / "u.skops").model
    assert loaded.parent_version == "base" and set(loaded.tenants) == {"a", "b"}
    assert [loaded.decide(c, "a").score for c in convs] == pytest.approx([model.decide(c, "a").score for c in convs])
    other = train(tiny_dataset(per_kind=10), TrainConfig(), cv=False, version="other").model
    with pytest.raises(Exception, match="learned on base"):
        load_learner(tmp_path / "learner.npz", other)
