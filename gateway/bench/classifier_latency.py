"""`tiergate classifier bench`: p50/p99 per-prompt latency of one effort decision (single prompts,
one thread), with the cost of JSON-decoding the same request body measured in the same run as the
baseline. Call with OMP_NUM_THREADS=1 set before numpy loads (the command does)."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any


def run(model: Any, data_dir: Path, n: int, repeat: int) -> list[str]:
    """The report's lines for ``model`` (a classifier model) on ``n`` prompts of the shared data."""
    from threadpoolctl import threadpool_limits

    import classifier

    examples = classifier.build_dataset(data_dir)
    random.Random(0).shuffle(examples)
    convs = [list(ex.messages or []) for ex in examples[:n]]
    bodies = [json.dumps({"model": "auto", "messages": c}) for c in convs]
    long_conv = classifier.user_prompt(("Prove that the sequence converges. " * 3000)[:100_000])

    def timed(fn: Any, items: list[Any], clock: Any = time.perf_counter_ns) -> list[float]:
        out = []
        for _ in range(repeat):
            for it in items:
                t = clock()
                fn(it)
                out.append((clock() - t) / 1e6)
        return sorted(out)

    def pct(xs: list[float], q: float) -> float:
        return xs[min(int(q * len(xs)), len(xs) - 1)]

    with threadpool_limits(1):
        for c in convs[:200]:
            model.decide(c)  # warm-up
        rows = [("decide (features + model)", timed(model.decide, convs)),
                ("  same, thread CPU time", timed(model.decide, convs, time.thread_time_ns)),
                ("  features only", timed(classifier.extract, convs)),
                ("  100k-char prompt decide", timed(model.decide, [long_conv] * 20)),
                ("baseline: json.loads(body)", timed(json.loads, bodies))]
    lines = [f"{len(convs)} prompts x {repeat} passes, one thread; classifier {model.version}; "
             f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
             f"{'':28} {'p50 ms':>8} {'p99 ms':>8}"]
    lines += [f"{name:28} {pct(xs, .5):8.3f} {pct(xs, .99):8.3f}" for name, xs in rows]
    decide, base = rows[0][1], rows[-1][1]
    lines.append(f"ratio decide / json.loads body: p50 {pct(decide, .5) / pct(base, .5):.1f}x, "
                 f"p99 {pct(decide, .99) / pct(base, .99):.1f}x  (wall-clock p99 includes waiting for a CPU "
                 "on a loaded machine; the thread-CPU row excludes it)")
    return lines
