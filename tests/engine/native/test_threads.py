"""`ThreadChoice` (engine.native.threads) with made-up step times: the two thread counts alternate for the first
steps, then the faster one runs and the other is timed once every ``probe_every`` steps, so a change of load
(the team turning slower than one thread) flips the choice; one available thread is always one."""

from __future__ import annotations

from engine.native.threads import ThreadChoice


def _run(choice: ThreadChoice, steps: int, seconds: dict[int, float], batch: int = 1) -> list[int]:
    used = []
    for _ in range(steps):
        n = choice.pick(batch, 2)
        choice.record(batch, 2, n, seconds[n])
        used.append(n)
    return used


def test_the_first_steps_alternate_then_the_faster_runs_with_probes() -> None:
    choice = ThreadChoice(probe_every=8, first=2)
    assert choice.faster(1, 2) is None
    used = _run(choice, 36, {1: 3e-4, 2: 2e-4})
    assert used[:4] == [2, 1, 2, 1]
    assert choice.faster(1, 2) == 2
    # only the probes: after 8 steps, then twice as far off each time one thread is still the slower
    assert [i for i, n in enumerate(used) if n == 1 and i >= 4] == [12, 28]
    assert choice.faster(3, 2) is None  # each batch size is measured on its own


def test_a_team_turning_slow_is_left_within_a_few_probes_and_taken_back() -> None:
    choice = ThreadChoice(probe_every=4, first=2)
    _run(choice, 20, {1: 3e-4, 2: 2e-4})
    assert choice.faster(1, 2) == 2
    used = _run(choice, 40, {1: 3e-4, 2: 9e-4})  # another process now holds a core: the team waits on it
    assert choice.faster(1, 2) == 1 and used[-8:].count(2) <= 2
    _run(choice, 60, {1: 3e-4, 2: 2e-4})
    assert choice.faster(1, 2) == 2


def test_one_delayed_step_does_not_flip_the_choice() -> None:
    choice = ThreadChoice(probe_every=8, first=2)
    _run(choice, 20, {1: 3e-4, 2: 2e-4})
    choice.record(1, 2, 2, 5e-3)  # the scheduler took the team's core for a time slice, once
    used = _run(choice, 15, {1: 3e-4, 2: 2e-4})
    assert choice.faster(1, 2) == 2 and used.count(1) <= 2  # the probes only


def test_a_far_slower_arm_is_not_explored_further_and_new_batch_sizes_start_from_a_neighbour() -> None:
    choice = ThreadChoice(probe_every=8, first=4)
    used = _run(choice, 10, {1: 3e-4, 2: 9e-2}, batch=2)  # a team waiting out time slices: 300x slower
    assert used.count(2) == 1 and choice.faster(2, 2) == 1
    used = _run(choice, 7, {1: 4e-4, 2: 1e-1}, batch=3)  # decided from batch 2's times at once
    assert used.count(2) == 0 and choice.faster(3, 2) == 1
    assert choice.faster(1, 2) is None  # batch 1 (a team of one where the work is small) is its own


def test_one_available_thread_is_one() -> None:
    choice = ThreadChoice()
    assert {choice.pick(b, 1) for b in (1, 4)} == {1}
    choice.record(1, 1, 1, 1.0)
    assert choice.faster(1, 1) is None
