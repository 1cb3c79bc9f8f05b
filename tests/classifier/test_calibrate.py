"""Calibration of the tier probabilities: temperature, ECE (thresholds: test_thresholds.py)."""

from __future__ import annotations

import numpy as np
import pytest

from classifier import expected_calibration_error, fit_temperature


def test_temperature_recovers_a_known_temperature() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (4000, 4))
    true_t = 2.5
    p = np.exp(logits / true_t)
    p /= p.sum(axis=1, keepdims=True)
    y = np.asarray([rng.choice(4, p=row) for row in p])
    assert fit_temperature(logits, y) == pytest.approx(true_t, rel=0.1)


def test_ece_zero_when_confidence_matches_accuracy() -> None:
    probs = np.asarray([[0.75, 0.25]] * 4)
    assert expected_calibration_error(probs, np.asarray([0, 0, 0, 1])) == pytest.approx(0.0)
    assert expected_calibration_error(probs, np.asarray([1, 1, 1, 1])) == pytest.approx(0.75)
