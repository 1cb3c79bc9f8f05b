"""The gain head (classifier/gain.py) and the structure cues it reads (classifier/structure.py):
it learns which *kind* of prompt a stronger arm pays on from outcome sets, carries that to groups it
never saw, and folds into the score without changing a decision's cost."""

from __future__ import annotations

import random

import numpy as np
import pytest

from classifier import OutcomeItem, TrainConfig, extract, train, user_prompt
from classifier.evaluate import metrics
from classifier.features import DENSE_NAMES, N_DENSE
from classifier.gain import combine_scale, fit_gain_head, fold_gain
from classifier.heads import featurize_messages
from classifier.payoff import group_folds, grouped_outcome_scores, outcome_rows
from classifier.structure import STRUCTURE_NAMES, structure_cues
from classifier.train import outcome_cross_validate, source_rows
from tests.classifier.synthetic import tiny_dataset

NAMES = ["Alice", "Bob", "Claire", "Dave", "Eve", "Fred", "Gwen"]
THINGS = ["ball", "hat", "book", "cup", "ring", "lamp"]
PROSE = ["the old harbour town was famous for its painted doors and quiet evenings by the sea",
         "a committee of local historians argued for years about the meaning of the carved stone",
         "critics praised the novel for its warmth although some readers found the ending abrupt",
         "the museum reopened after a long renovation with a new wing devoted to modern sculpture"]


def _tracking(r: random.Random, k: int) -> str:
    """A state and a chain of swaps: many short sentences, the same names again and again."""
    people = r.sample(NAMES, k)
    lines = [f"{p} has a {t}." for p, t in zip(people, r.sample(THINGS, k), strict=False)]
    for _ in range(k + 2):
        a, b = r.sample(people, 2)
        lines.append(f"Then {a} and {b} swap items.")
    lines.append(f"What does {people[0]} have at the end?")
    return " ".join(lines)


def _judgement(r: random.Random) -> str:
    """One long sentence of ordinary prose and a question of taste."""
    return f"Consider this: {r.choice(PROSE)}, and {r.choice(PROSE)}. Is the tone of the passage sarcastic?"


def _outcome_set(seed: int = 0, per_group: int = 40) -> list[OutcomeItem]:
    """Six groups: three tracking tasks (thinking pays: the strong arm is right, the cheap one mostly
    not) and three judgement tasks (thinking does not pay)."""
    r = random.Random(seed)
    items = []
    for g in range(6):
        tracking = g % 2 == 0
        for _ in range(per_group):
            text = _tracking(r, 3 + g // 2) if tracking else _judgement(r)
            cheap = float(r.random() < (0.3 if tracking else 0.7))
            strong = float(r.random() < (0.9 if tracking else 0.7))
            items.append(OutcomeItem(user_prompt(text), {"low": cheap, "high": strong}, group=f"task{g}"))
    return items


def test_structure_cues_tell_a_chain_of_steps_from_prose() -> None:
    r = random.Random(3)
    chain = dict(zip(STRUCTURE_NAMES, structure_cues(_tracking(r, 5)), strict=True))
    prose = dict(zip(STRUCTURE_NAMES, structure_cues(_judgement(r)), strict=True))
    assert chain["short_sentence_share"] > prose["short_sentence_share"]
    assert chain["repeated_names"] > prose["repeated_names"]
    assert chain["sentence_overlap"] > prose["sentence_overlap"] or chain["parallel_sentences"] > 0.5
    assert chain["distinct_word_share"] < prose["distinct_word_share"]
    assert structure_cues("") == [0.0] * len(STRUCTURE_NAMES)
    assert set(STRUCTURE_NAMES) <= set(DENSE_NAMES)  # they are features of the model


@pytest.mark.slow
def test_the_head_carries_to_groups_it_never_saw() -> None:
    items = _outcome_set()
    X = featurize_messages([it.messages for it in items])
    cheap = np.asarray([it.outcomes["low"] for it in items])
    strong = np.asarray([it.outcomes["high"] for it in items])
    groups = np.asarray([it.group for it in items], dtype=object)
    held = np.zeros(len(items))
    for test in group_folds(groups, None):
        head = fit_gain_head(X[~test], cheap[~test], strong[~test], groups[~test])
        held[test] = head.predict(X[test])
        assert head.inner_apgr and head.alpha in head.inner_apgr  # chosen inside the training groups
    assert metrics(held, cheap, strong).apgr > 0.65  # random 0.5; the task-aware oracle is about 0.8
    tracking = np.isin(groups, ["task0", "task2", "task4"])
    assert held[tracking].mean() > held[~tracking].mean()


def test_the_head_folds_into_the_score_coefficients() -> None:
    items = _outcome_set(seed=1)
    X = featurize_messages([it.messages for it in items])
    head = fit_gain_head(X, np.asarray([it.outcomes["low"] for it in items]),
                         np.asarray([it.outcomes["high"] for it in items]), [it.group for it in items])
    rng = np.random.default_rng(0)
    coef = rng.normal(size=X.shape[1]).astype(np.float32) * 0.01
    scale = combine_scale(np.asarray(X @ coef).ravel(), head.predict(X), 1.0)
    assert scale > 0
    folded, b = fold_gain(coef, 0.2, head, scale)
    assert np.array_equal(folded[N_DENSE:], coef[N_DENSE:])  # never the hashed n-grams
    np.testing.assert_allclose(np.asarray(X @ folded).ravel() + b,
                               np.asarray(X @ coef).ravel() + 0.2 + scale * head.predict(X), rtol=1e-4, atol=1e-4)
    assert combine_scale(np.ones(3), np.ones(3), 1.0) == 0.0  # a constant gain adds nothing
    assert combine_scale(np.arange(3.0), np.arange(3.0), 0.0) == 0.0  # weight 0 turns it off


@pytest.fixture(scope="module")
def examples() -> list:
    return tiny_dataset(per_kind=20)


@pytest.mark.slow
def test_training_adds_the_head_and_held_out_groups_never_train_it(examples: list) -> None:
    sets = {"toy": _outcome_set(seed=2, per_group=25)}
    cfg = TrainConfig(cv_folds=3)
    with_head = train(examples, cfg, cv=False, outcomes=sets)
    without = train(examples, TrainConfig(cv_folds=3, gain_weight=0.0), cv=False, outcomes=sets)
    assert with_head.gain is not None and with_head.gain["groups"] == 6 and without.gain is None
    r = random.Random(9)
    chain, prose = user_prompt(_tracking(r, 4)), user_prompt(_judgement(r))
    lift = ((with_head.model.decide(chain).score - with_head.model.decide(prose).score)
            - (without.model.decide(chain).score - without.model.decide(prose).score))
    assert lift > 0  # the outcomes moved the chain of steps up against the prose
    # Held-out scores: a fold's score is the same function as a model trained without that fold.
    source = source_rows(examples)
    rows = outcome_rows(sets, cfg)
    folds = group_folds(rows.groups, None)
    held = grouped_outcome_scores(source, rows, cfg, len(set(source.y.tolist())), folds)
    alone = train(examples, cfg, cv=False, outcomes={"toy": [it for it in sets["toy"] if it.group != "task0"]})
    first = np.flatnonzero(folds[0])[:5]
    for i in first:
        assert held[i] == pytest.approx(alone.model.score_features(extract(sets["toy"][i].messages)), abs=1e-4)
    report = outcome_cross_validate(examples, sets, cfg, folds=None)["toy"]
    np.testing.assert_allclose(report.scores, held, atol=1e-9)  # the reported figure is of these scores
    assert len(report.pgr_at_shares) == 11 and report.pgr_at_shares[0] == 0.0 and report.pgr_at_shares[-1] == 1.0
    assert list(report.pgr_at_shares) == sorted(report.pgr_at_shares)
