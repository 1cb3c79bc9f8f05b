"""Scheduler in plain Python: a toy "model" whose next token depends on every token it reads
back from a paged cache through the block table. Any allocation, sharing, preemption or
resumption mistake changes the tokens, so batched runs must equal each request run alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.blocks import BlockAllocator
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus

VOCAB = 97


def next_token(context: list[int]) -> int:
    h = 0
    for pos, tok in enumerate(context):
        h = (h * 31 + tok * (pos + 7)) % 1_000_003
    return h % VOCAB


def drive(sched: Scheduler, seqs: list[Sequence], max_new: int, steps_log: list | None = None) -> dict[str, list[int]]:
    """Run the scheduler to completion, reading every context back from the fake KV cache."""
    bs = sched.allocator.block_size
    cache: list[int | None] = [None] * (sched.allocator.num_blocks * bs)
    for q in seqs:
        sched.add(q)
    guard = 0
    while sched.has_unfinished():
        guard += 1
        assert guard < 10_000, "scheduler made no progress"
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        if steps_log is not None:
            steps_log.append([(s.seq.request_id, s.num_new_tokens) for s in out.scheduled])
        for s in out.scheduled:
            seq = s.seq
            assert len(seq.block_table) * bs >= s.start + s.num_new_tokens
            for p in range(s.start, s.start + s.num_new_tokens):
                cache[seq.block_table[p // bs] * bs + p % bs] = seq.token_ids[p]
        sampled = []
        for sch in out.scheduled:
            if sch.samples:
                seq = sch.seq
                ctx = [cache[seq.block_table[p // bs] * bs + p % bs] for p in range(seq.num_tokens)]
                assert None not in ctx
                sampled.append((seq, next_token(ctx)))  # type: ignore[arg-type]
        sched.advance(out)
        for seq, tok in sampled:
            seq.append_token(tok)
            if seq.num_output_tokens >= max_new:
                sched.finish(seq, "length")
    assert sched.allocator.num_free == sched.allocator.num_blocks
    return {q.request_id: q.output_token_ids for q in seqs}


def alone(prompt: list[int], max_new: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(max_new):
        ctx.append(next_token(ctx))
    return ctx[len(prompt):]


def make_seqs(prompts: list[list[int]]) -> list[Sequence]:
    return [Sequence(f"r{i}", p, SamplingParams(), arrival=i) for i, p in enumerate(prompts)]


PROMPTS = [[(i * 7 + j) % VOCAB for j in range(5 + 3 * i)] for i in range(6)]


def test_batched_equals_alone_with_plenty_of_blocks() -> None:
    sched = Scheduler(BlockAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    got = drive(sched, make_seqs(PROMPTS), max_new=12)
    assert got == {f"r{i}": alone(p, 12) for i, p in enumerate(PROMPTS)}
    assert sched.num_preemptions == 0


def test_prefill_and_decode_mix_under_token_budget_with_chunked_prefill() -> None:
    sched = Scheduler(BlockAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    log: list = []
    got = drive(sched, make_seqs(PROMPTS), max_new=6, steps_log=log)
    assert got == {f"r{i}": alone(p, 6) for i, p in enumerate(PROMPTS)}
    mixed = [step for step in log if any(n == 1 for _, n in step) and any(n > 1 for _, n in step)]
    assert mixed, "expected at least one step mixing decodes with a prefill"
    # the longest prompt (20 tokens) cannot fit the 8-token budget in one step: it was chunked
    r5 = [n for step in log for rid, n in step if rid == "r5"]
    assert max(r5) <= 8 and sum(r5) >= 20 + 6 - 1


def test_max_num_seqs_caps_running_requests() -> None:
    sched = Scheduler(BlockAllocator(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    log: list = []
    got = drive(sched, make_seqs(PROMPTS), max_new=4, steps_log=log)
    assert max(len(step) for step in log) == 2
    assert got == {f"r{i}": alone(p, 4) for i, p in enumerate(PROMPTS)}


def test_preemption_by_recompute_resumes_with_identical_tokens() -> None:
    # 10 blocks of 4 tokens cannot hold six sequences growing to 17..32 tokens: forces preemption
    sched = Scheduler(BlockAllocator(10, 4), max_num_seqs=6, max_num_batched_tokens=32)
    seqs = make_seqs(PROMPTS)
    got = drive(sched, seqs, max_new=12)
    assert sched.num_preemptions > 0
    assert any(s.num_preemptions for s in seqs)
    assert got == {f"r{i}": alone(p, 12) for i, p in enumerate(PROMPTS)}


def test_shared_prefix_is_computed_once_and_outputs_stay_correct() -> None:
    system = list(range(1, 17))  # 16 shared tokens = 4 full blocks of 4
    prompts = [[*system, 50 + i, 60 + i] for i in range(4)]
    sched = Scheduler(BlockAllocator(64, 4), max_num_seqs=1, max_num_batched_tokens=64)
    seqs = make_seqs(prompts)
    got = drive(sched, seqs, max_new=5)
    assert got == {f"r{i}": alone(p, 5) for i, p in enumerate(prompts)}
    assert seqs[0].num_cached_tokens == 0
    assert [s.num_cached_tokens for s in seqs[1:]] == [16, 16, 16]


def test_finish_frees_blocks_of_waiting_and_running_requests() -> None:
    alloc = BlockAllocator(16, 4)
    sched = Scheduler(alloc, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = make_seqs([[1, 2, 3, 4, 5], [6, 7, 8]])
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a]
    assert alloc.num_free == 14
    sched.finish(b, "abort")  # still waiting
    sched.finish(a, "abort")  # running
    assert alloc.num_free == 16 and not sched.has_unfinished()
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "abort"


def test_invalid_limits_are_rejected() -> None:
    with pytest.raises(ValueError):
        Scheduler(BlockAllocator(4, 4), max_num_seqs=0)


@pytest.mark.process
def test_scheduler_blocks_and_sequence_run_without_torch() -> None:
    """What the import-linter contract says, checked at run time in a fresh interpreter: the scheduler side of
    the engine (scheduler, block allocator, sequence, sampling parameters) loads no torch."""
    code = ("import sys\n"
            "import engine.scheduler, engine.blocks, engine.sequence, engine.sampling_params\n"
            "from engine import SamplingParams\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print(len(loaded))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0"


def test_rejected_draft_tokens_roll_back_computed_count_blocks_and_cache() -> None:
    """A decode carrying 6 draft tokens over block boundaries; 2 accepted: the computed count covers only
    the accepted ones, blocks that held only rejected tokens go back, and only blocks made entirely of
    accepted tokens are published to the prefix cache."""
    alloc = BlockAllocator(num_blocks=16, block_size=4)
    sched = Scheduler(alloc, max_num_seqs=2, max_num_batched_tokens=32)
    seq = Sequence("r", list(range(1, 7)), SamplingParams(), arrival=0)  # 6 prompt tokens
    sched.add(seq)
    out = sched.schedule()
    sched.advance(out)
    seq.append_token(50)  # 7 tokens, 6 computed
    seq.spec_token_ids = [51, 52, 53, 54, 55, 56]
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens, s.num_spec, s.samples) == (6, 7, 6, True)
    assert len(seq.block_table) == 4  # positions 0..12
    free_before = alloc.num_free
    sched.advance(out, {seq: 2})  # 51, 52 accepted; 53.. rejected
    assert seq.num_computed_tokens == 9 and seq.spec_token_ids == []
    assert len(seq.block_table) == 3 and alloc.num_free == free_before + 1  # room for token 9 (the bonus) only
    assert len(seq.block_hashes) == 2  # blocks [1..4] and [5, 6, 50, 51]; block 2 holds 52 + rejected slots
    assert alloc.lookup_prefix([1, 2, 3, 4, 5, 6, 50, 51, 52]) == seq.block_table[:2]
    assert alloc.lookup_prefix([1, 2, 3, 4, 5, 6, 50, 53, 0]) == seq.block_table[:1]
    for token in (51, 52, 60):  # the engine appends the accepted drafts and the verify step's own token
        seq.append_token(token)
    seq.spec_token_ids = [1, 2]
    bad = sched.schedule()
    assert bad.scheduled[0].num_spec == 2
    with pytest.raises(ValueError):
        sched.advance(bad, {seq: 3})


def test_drafts_are_dropped_rather_than_preempting_or_overrunning_the_budget() -> None:
    alloc = BlockAllocator(num_blocks=3, block_size=4)
    sched = Scheduler(alloc, max_num_seqs=2, max_num_batched_tokens=4)
    seq = Sequence("r", [1, 2, 3], SamplingParams(), arrival=0)
    sched.add(seq)
    sched.advance(sched.schedule())
    seq.append_token(9)
    seq.spec_token_ids = [4, 5, 6, 7]  # 1 + 4 > the 4-token budget
    (s,) = sched.schedule().scheduled
    assert s.num_spec == 0 and s.num_new_tokens == 1 and seq.spec_token_ids == []
