"""`tiergate bench obs-paired`' parts that run without servers: a pair's ratios, the report's
verdicts and noise floor, and refusing an unknown variant."""

from __future__ import annotations

import pytest

from gateway.bench.obs_paired import VARIANTS, Pair, PairedArgs, report, run


def test_a_pairs_ratios_are_cpu_per_request_and_rps_side_by_side() -> None:
    # the baseline spent 1.0 s on 1000 requests (1 ms each), the variant 1.1 s on 1000 (1.1 ms each)
    p = Pair(base_requests=1000, base_cpu_s=1.0, requests=1000, cpu_s=1.1, base_rps=250.0, rps=240.0)
    assert p.cpu_ratio == pytest.approx(1.0 / 1.1)
    assert p.rps_ratio == pytest.approx(0.96)
    # CPU per request, not CPU: the variant answering more requests for the same CPU is cheaper
    assert Pair(1000, 1.0, 1100, 1.0, 1.0, 1.0).cpu_ratio == pytest.approx(1.1)


def test_report_gives_each_variants_verdict_against_the_noise_floor() -> None:
    args = PairedArgs(rounds=3, variants=("no-metrics-b", "metrics", "metrics+otlp@0.1"))
    pairs = {
        "no-metrics-b": [Pair(1000, 1.0, 1000, c, 100, 100) for c in (0.99, 1.0, 1.02)],
        "metrics": [Pair(1000, 1.0, 1000, c, 100, 100) for c in (1.01, 1.02, 1.03)],
        "metrics+otlp@0.1": [Pair(1000, 1.0, 1000, c, 100, 100) for c in (1.06, 1.08, 1.07)],
    }
    text = "\n".join(report(pairs, args, {"requests": 3, "spans": 60, "bytes": 12_000}))
    assert "noise floor (A/A: two identical servers): CPU ratio median 1.000" in text
    assert "metrics: costs +2.0% of RPS (CPU per request) -> RPS target (<= 5%) met" in text
    assert "metrics+otlp@0.1: costs +6.5% of RPS (CPU per request) -> RPS target (<= 5%) NOT met" in text
    # three rounds are too few for a 95% interval of the median: their extremes, and what they cover
    assert "(median; 75% interval of it +1.0%..+2.9%: too few rounds for a 95% interval: not settled)" in text
    assert "OTLP receiver: 3 export requests, 60 spans" in text
    # over the control of the same round: 1 - (1/1.06)/(1/0.99), 1 - (1/1.08)/(1/1.0), 1 - (1/1.07)/(1/1.02)
    assert "  metrics+otlp@0.1 over the A/A pair of its own round: costs +6.6% of RPS (median; 75% interval +4.7%..+7.4%" in text
    assert "no-metrics-b: costs" not in text  # the control is the floor, not a variant with a verdict


def test_the_verdict_of_enough_rounds_comes_from_the_interval() -> None:
    args = PairedArgs(rounds=12, variants=("metrics", "traced"))
    # 12 rounds: the 3rd smallest and 3rd largest cost bound the median (96.1%)
    cheap = [1.00, 1.01, 1.01, 1.02, 1.02, 1.02, 1.03, 1.03, 1.03, 1.04, 1.04, 1.09]
    edge = [1.02, 1.03, 1.04, 1.04, 1.05, 1.05, 1.05, 1.06, 1.06, 1.07, 1.08, 1.10]
    pairs = {"metrics": [Pair(1000, 1.0, 1000, c, 100, 100) for c in cheap],
             "traced": [Pair(1000, 1.0, 1000, c, 100, 100) for c in edge]}
    text = "\n".join(report(pairs, args))
    assert "metrics: costs +2.4% of RPS" in text and "96% interval of it +1.0%..+3.8%: met)" in text
    assert "traced: costs +4.8% of RPS" in text and "interval of it +3.8%..+6.5%: not settled by these rounds: 5% lies inside the interval" in text


def test_dividing_by_the_same_rounds_control_cancels_the_start_order() -> None:
    # the variant costs 3% in truth; the server started first (every other round) costs 4% more
    args = PairedArgs(rounds=12, variants=("no-metrics-b", "metrics"))
    first = [1.04 if r % 2 else 1.0 for r in range(12)]
    pairs = {"no-metrics-b": [Pair(1000, 1.0, 1000, f, 100, 100) for f in first],
             "metrics": [Pair(1000, 1.0, 1000, 1.03 * f, 100, 100) for f in first]}
    text = "\n".join(report(pairs, args))
    assert "metrics: costs +4.8% of RPS" in text  # the plain median sits between the two orders
    assert "metrics over the A/A pair of its own round: costs +2.9% of RPS (median; 96% interval +2.9%..+2.9%: met)" in text


def test_every_variant_is_a_config_and_an_unknown_one_is_refused() -> None:
    assert all("metrics" in v for v in VARIANTS.values())
    assert VARIANTS["metrics+otlp@0.1"]["tracing"]["sample_ratio"] == 0.1
    with pytest.raises(ValueError, match="unknown variants"):
        run(PairedArgs(variants=("metrics", "nope")))


def test_the_quiet_after_a_window_outlasts_the_export_schedule() -> None:
    """Every span a window records is exported (encoded and sent: in the server's CPU) before the
    window's CPU is read: the quiet after it is longer than the span processor's schedule, which
    is the SDK's default (5 s, the batches a default server sends) unless asked otherwise."""
    default = PairedArgs()
    assert default.export_delay_ms == 5000 and default.quiet_s == 5.5
    assert PairedArgs(export_delay_ms=750).quiet_s == 1.5  # the settle time when it is longer
    assert PairedArgs(export_delay_ms=2000, settle_s=0.5).quiet_s == 2.5
    pairs = {"metrics": [Pair(1000, 1.0, 1000, 1.01, 100, 100)]}
    assert "spans exported every 5000 ms" in report(pairs, default)[0]


def test_the_report_says_how_the_servers_string_hashing_was_seeded() -> None:
    pairs = {"metrics": [Pair(1000, 1.0, 1000, 1.01, 100, 100)]}
    # by default a new PYTHONHASHSEED each round (a fixed one would make one layout's luck a bias)
    assert "PYTHONHASHSEED a new one each round" in report(pairs, PairedArgs(rounds=1, variants=("metrics",)))[0]
    assert "PYTHONHASHSEED 0)" in report(pairs, PairedArgs(rounds=1, variants=("metrics",), hash_seed=0))[0]


def test_the_report_splits_cpu_per_request_between_the_event_loop_and_the_other_threads() -> None:
    # per round: the baseline 1.0 s over 1000 requests, 0.8 s of it on the loop; the variant 1.1 s, 0.88 s
    pairs = {"metrics+otlp@0.1": [Pair(1000, 1.0, 1000, 1.1, 100, 100, 0.8, 0.88)] * 3}
    text = "\n".join(report(pairs, PairedArgs(rounds=3, variants=("metrics+otlp@0.1",))))
    assert ("metrics+otlp@0.1: us/req, baseline -> variant (medians; in parentheses the median of the rounds' "
            "differences): event-loop thread 800.0 -> 880.0 (+80.0), other threads 200.0 -> 220.0 (+20.0)") in text
    # rounds without the split (a thread's time unreadable): no line for them
    assert "us/req, baseline" not in "\n".join(report({"metrics": [Pair(1000, 1.0, 1000, 1.01, 100, 100)]},
                                                      PairedArgs(rounds=1, variants=("metrics",))))
