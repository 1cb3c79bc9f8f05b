"""Calibration: bands from the target mix, thresholds that hit it, temperature, ECE."""

from __future__ import annotations

import numpy as np
import pytest

from classifier import (
    ClassifierError,
    bands_from_mix,
    calibrate_thresholds,
    expected_calibration_error,
    fit_temperature,
)


def test_default_mix_bands() -> None:
    bands, shares = bands_from_mix({"low": 0.7, "medium": 0.2, "high": 0.1})
    assert bands == (("none", "minimal", "low"), ("medium",), ("high", "xhigh"))
    assert shares == pytest.approx((0.7, 0.2, 0.1))
    bands, shares = bands_from_mix({"none": 1, "xhigh": 1})
    assert bands == (("none",), ("minimal", "low", "medium", "high", "xhigh")) and shares == (0.5, 0.5)
    with pytest.raises(ClassifierError):
        bands_from_mix({"huge": 1.0})


def test_thresholds_hit_the_mix_even_with_ties() -> None:
    rng = np.random.default_rng(0)
    scores = np.round(rng.beta(2, 5, 5000), 2)  # many ties
    cuts = calibrate_thresholds(scores, (0.7, 0.2, 0.1))
    band = np.searchsorted(np.asarray(cuts), scores, side="right")
    mix = np.bincount(band, minlength=3) / len(scores)
    assert mix == pytest.approx([0.7, 0.2, 0.1], abs=0.02)


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
