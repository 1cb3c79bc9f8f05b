"""Features: Chinese, very long prompts, multi-turn context, stable hashing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from classifier import FEATURE_VERSION, N_FEATURES, extract, split_conversation
from classifier.features import DENSE_NAMES, N_DENSE


def _dense(messages: list[dict[str, object]]) -> dict[str, float]:
    f = extract(messages)
    return {DENSE_NAMES[i]: v for i, v in zip(f.indices, f.values, strict=True) if i < N_DENSE}


def _median_time(fn: Callable[[], object], n: int = 15) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2]


def test_chinese_prompt_gets_character_ngrams() -> None:
    a = extract([{"role": "user", "content": "请证明对于所有正整数n，1+2+…+n = n(n+1)/2。"}])
    b = extract([{"role": "user", "content": "今天北京的天气怎么样？"}])
    assert a.feature_version == FEATURE_VERSION
    hashed_a = {i for i in a.indices if i >= N_DENSE}
    hashed_b = {i for i in b.indices if i >= N_DENSE}
    assert len(hashed_a) > 20 and len(hashed_b) > 10  # one token per character plus bigrams
    assert hashed_a != hashed_b
    assert _dense([{"role": "user", "content": "今天北京的天气怎么样？"}])["cjk_share"] > 0.7
    assert all(0 <= i < N_FEATURES for i in a.indices)


def test_hundred_thousand_character_prompt_costs_like_a_capped_one() -> None:
    sentence = "Prove that the series converges for every n and give the bound. "
    long_msgs = [{"role": "user", "content": (sentence * 2000)[:100_000]}]
    capped_msgs = [{"role": "user", "content": (sentence * 100)[:5_000]}]  # just past the n-gram cap
    f_long = extract(long_msgs)
    assert _dense(long_msgs)["truncated"] == 1.0
    assert _dense(long_msgs)["log_chars"] > _dense(capped_msgs)["log_chars"]  # length still seen in full
    ratio = _median_time(lambda: extract(long_msgs)) / _median_time(lambda: extract(capped_msgs))
    assert ratio < 8, f"100k-char prompt took {ratio:.1f}x a 5k-char one: the cap is not bounding the work"
    assert len(f_long.indices) < 2_000


def test_multi_turn_uses_last_user_turn_and_context_signals() -> None:
    convo = [{"role": "system", "content": "You are a terse assistant."},
             {"role": "user", "content": "Tell me a joke."},
             {"role": "assistant", "content": "Why did the chicken cross the road?"},
             {"role": "user", "content": [{"type": "text", "text": "Now prove Fermat's little theorem."}]}]
    prompt, system, context, prior, assistants = split_conversation(convo)
    assert prompt == "Now prove Fermat's little theorem."
    assert system == "You are a terse assistant." and context == "Tell me a joke."
    assert (prior, assistants) == (1, 1)
    d = _dense(convo)
    assert d["system_present"] == 1.0 and d["prior_user_turns"] > 0 and d["assistant_turns"] > 0
    single = _dense([{"role": "user", "content": "Now prove Fermat's little theorem."}])
    assert single["system_present"] == 0.0 and single["prior_user_turns"] == 0.0


def test_odd_inputs_do_not_crash() -> None:
    for messages in ([], [{"role": "user", "content": None}], [{"role": "system", "content": "only system"}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "user", "content": "\x00\ud7ff 😀 ∑∫√"}]):
        f = extract(messages)
        assert len(f.indices) == len(f.values) >= N_DENSE


@pytest.mark.process
def test_hashing_is_stable_across_processes() -> None:
    prompt = [{"role": "user", "content": "Compute 17 * 23 and explain 你好"}]
    code = ("import json, sys; from classifier import extract; "
            "f = extract(json.loads(sys.argv[1])); print(json.dumps([f.indices, f.values]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(prompt)], capture_output=True, text=True,
                         env=env, check=True).stdout
    here = extract(prompt)
    there = json.loads(out)
    assert there[0] == list(here.indices)
    assert there[1] == list(here.values)


def test_money_is_not_latex_and_question_marks_are_not_tokens() -> None:
    money = _dense([{"role": "user", "content": "A pen costs $3 and a book $12.50. How much for both?"}])
    maths = _dense([{"role": "user", "content": r"Find $x$ such that $x^2 = 2$."}])
    assert money["latex"] == 0.0 and money["latex_density"] == 0.0 and money["currency"] > 0
    assert maths["latex"] > 0 and maths["currency"] == 0.0
    plain = extract([{"role": "user", "content": "Prove that there are infinitely many primes"}])
    asked = extract([{"role": "user", "content": "Prove that there are infinitely many primes?"}])
    assert {i for i in plain.indices if i >= N_DENSE} == {i for i in asked.indices if i >= N_DENSE}  # no "?" n-gram


def test_reasoning_cues_see_state_tracking_counting_and_style() -> None:
    tracking = _dense([{"role": "user", "content": "Alice, Bob and Claire swap books. First, Alice and Bob swap. "
                                                   "Then, Bob and Claire swap. Finally, Alice and Claire swap. "
                                                   "Which book does Bob have at the end?"}])
    counting = _dense([{"role": "user", "content": "I have a piano, two flutes and four lamps. How many musical "
                                                   "instruments do I have?"}])
    style = _dense([{"role": "user", "content": "Rewrite this sentence in a more polite tone."}])
    assert tracking["state_changes"] > 1 and tracking["sequence_markers"] > 1 and tracking["entity_names"] > 1
    assert counting["count_question"] > 0 and counting["number_words"] > 0
    assert style["style_taste"] > 0 and style["language_form"] > 0 and style["state_changes"] == 0.0
