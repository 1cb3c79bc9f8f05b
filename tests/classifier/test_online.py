"""Online learning: starts as the base model, learns from revealed outcomes, and the
prequential evaluation (route first, then learn) improves on a drifted distribution."""

from __future__ import annotations

import random

import numpy as np
import pytest

from classifier import (
    OnlineRouter,
    TrainConfig,
    extract,
    metrics,
    outcome_target,
    prequential,
    train,
    user_prompt,
)
from classifier.model import EffortModel
from tests.classifier.synthetic import prompts_of, tiny_dataset


@pytest.fixture(scope="module")
def model() -> EffortModel:
    return train(tiny_dataset(), TrainConfig(), cv=False).model


def test_starts_with_the_base_ranking(model: EffortModel) -> None:
    router = OnlineRouter(model)
    convs = [user_prompt(p) for k in range(4) for p in prompts_of(k, 5)]
    base = [model.decide(c).score for c in convs]
    online = [router.score(c) for c in convs]
    assert np.argsort(base, kind="stable").tolist() == np.argsort(online, kind="stable").tolist()


def test_learning_moves_similar_prompts(model: EffortModel) -> None:
    router = OnlineRouter(model, learning_rate=0.2)
    fresh = [user_prompt(p) for p in prompts_of(1, 10, seed=99)]
    before = [router.score(c) for c in fresh]
    for p in prompts_of(1, 40, seed=5):
        router.learn(user_prompt(p), 1.0)  # arithmetic turned out to need the strong model
    after = [router.score(c) for c in fresh]
    assert min(a - b for a, b in zip(after, before, strict=True)) > 0.1
    assert router.seen == 40
    assert outcome_target(0, 1) == 1.0 and outcome_target(1, 0) == 0.0 and outcome_target(1, 1) == 0.5


def test_prequential_adapts_where_the_base_model_is_wrong(model: EffortModel) -> None:
    # A drifted world: the cheap model fails the trivia and passes the olympiad prompts.
    r = random.Random(0)
    rows = [(p, 0.0, 1.0) for p in prompts_of(0, 60, seed=3)] + [(p, 1.0, 1.0) for p in prompts_of(3, 60, seed=4)]
    r.shuffle(rows)
    feats = [extract(user_prompt(p)) for p, _, _ in rows]
    cheap = np.asarray([c for _, c, _ in rows])
    strong = np.asarray([s for _, _, s in rows])
    static = metrics([model.decide_features(f).score for f in feats], cheap, strong).apgr
    router = OnlineRouter(model, learning_rate=0.2)
    scores = prequential(lambda i: router.score_features(feats[i]),
                         lambda i: router.learn_features(feats[i], outcome_target(cheap[i], strong[i])), len(feats))
    adaptive = metrics(scores, cheap, strong).apgr
    assert static < 0.3  # the base model routes exactly the wrong prompts
    assert adaptive > static + 0.3
