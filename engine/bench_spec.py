"""Part (f) of `tiergate bench engine`: speculative decoding on the bundled demo model.

For a copy-heavy workload (rewrite / repeat / edit prompts) and free generation, batch-1 greedy tokens/s with
each proposer (prompt lookup, the draft model, MoE self-speculation) against plain decoding in the same run,
taking turns (`best_interleaved`). Per proposer it prints the acceptance, the measured costs (plain step,
verify step by draft length, drafting) and the *bound*: the speed those costs and the acceptance per draft
position imply at the best fixed draft length, drafting wherever the proposer has a guess (prompt lookup
has none where the last token never occurred before; its bound is replayed on the answers themselves, see
`lookup_bound`). The engine chooses per step, so it may beat the bound; a bound below 1 means speculating
cannot pay here and the best the engine can do is decode plainly. Prompt lookup's target is read off its
ceiling (below), which no choice of draft lengths can beat, where that is stricter than the bound (`SpecRow.target`).

Per workload it also says how much the answers actually reuse: the share of the answers' 4-grams found in
their prompt, and the share of answer positions where prompt lookup's next-token guess is right; and prompt
lookup's ceiling: its speed had it known in advance which guesses would hold.

Imports torch and the engine; nothing web/db.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from engine.bench import Log, _verdict, best_interleaved
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.spec_control import SpecCosts, SpecTotals
from engine.speculative import prompt_lookup

COPY_TEXTS = (
    "The meeting is moved from Tuesday to Thursday at three o'clock. Please bring the quarterly report, "
    "the budget draft and your notes from the last review. The room is on the second floor, next to the kitchen.",
    "def area(width, height):\n    return width * height\n\ndef perimeter(width, height):\n"
    "    return 2 * (width + height)\n\nprint(area(3, 4), perimeter(3, 4))",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: rough winds do shake "
    "the darling buds of May, and summer's lease hath all too short a date.",
)
COPY_ASKS = ("Rewrite the following text exactly, fixing only typos:", "Repeat this back verbatim:",
             "Edit the text below, keeping every sentence:")
FREE_ASKS = ("Write a short story about a lighthouse keeper.", "Explain why the sky is blue.",
             "What is 17 times 23? Show your work.")


@dataclass(frozen=True)
class SpecRow:
    """One workload x mode of part (f)."""

    workload: str
    mode: str
    tokens_per_s: float
    ratio: float  # vs plain decoding (mode "off") on the same workload, same run
    acceptance: float
    tokens_per_verify: float
    guess_share: float  # decode steps at which the proposer had a guess
    step_ms: float  # plain decode step (engine step incl. scheduling and sampling), mean over the plain runs
    verify_ms: float  # mean verify step, at a mean draft length of verify_k
    verify_k: float
    draft_ms: float  # proposing per draft token (model drafters, keeping up) or per lookup (prompt lookup)
    catch_up_ms: float  # a model drafter's run over one request's prompt
    bound: float
    bound_k: int
    ceiling: float = math.nan  # prompt lookup's: its speed had it known which guesses hold (`lookup_ceiling`)

    @property
    def reachable(self) -> float:
        """The most this proposer could reach here by the measured costs: prompt lookup's ceiling (an upper
        bound: the engine chooses per step, so it may beat the fixed-length ``bound``, never the ceiling), else
        the bound; at least plain speed (the engine may always decode plainly)."""
        basis = self.ceiling if self.ceiling == self.ceiling else self.bound
        return max(basis, 1.0) if basis == basis else 1.0

    @property
    def target(self) -> float:
        """0.95x on free generation. On copy-heavy, the issue's rule — 1.5x, or 85% of the bound the measured
        costs imply where that bound is lower — or, where stricter, 1.5x capped at 85% of what the costs allow
        (`reachable`: prompt lookup's ceiling). The cap keeps the target from jumping where the ceiling crosses
        1.5x (85% of a 1.49x ceiling would ask 1.27x, a 1.50x ceiling 1.5x, its whole self)."""
        if self.workload != "copy-heavy":
            return 0.95
        bound = self.bound if self.bound == self.bound else 1.0
        issue = 1.5 if bound >= 1.5 else 0.85 * max(bound, 1.0)
        return max(issue, min(1.5, 0.85 * self.reachable))


def spec_workloads(engine: LLMEngine) -> dict[str, list[list[int]]]:
    """Copy-heavy (rewrite/edit prompts whose answers should reuse the prompt) and free-generation prompts."""
    tok = engine.tokenizer
    copy = [tok.encode_chat([{"role": "user", "content": f"{ask}\n\n{text}"}])
            for ask, text in zip(COPY_ASKS, COPY_TEXTS, strict=True)]
    free = [tok.encode_chat([{"role": "user", "content": q}]) for q in FREE_ASKS]
    return {"copy-heavy": copy, "free generation": free}


def spec_tokens_per_s(engine: LLMEngine, prompts: list[list[int]], n: int, mode: str) -> float:
    """Batch-1 greedy generation of ``n`` tokens per prompt, one prompt after another (incl. prefill)."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        out = engine.generate([p], params, speculative=mode)[0]
        assert out.num_output_tokens == n
    return len(prompts) * n / (time.perf_counter() - start)


def answer_reuse(prompts: list[list[int]], answers: list[list[int]], ngram_max: int) -> tuple[float, float]:
    """(share of the answers' 4-grams that occur in their prompt, share of answer positions where prompt
    lookup's first guess is the answer's token)."""
    grams = found = hits = positions = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        seen = {tuple(prompt[i:i + 4]) for i in range(len(prompt) - 3)}
        for i in range(len(answer) - 3):
            grams += 1
            found += tuple(answer[i:i + 4]) in seen
        for t, token in enumerate(answer):
            positions += 1
            hits += prompt_lookup([*prompt, *answer[:t]], 1, ngram_max) == [token]
    return found / max(grams, 1), hits / max(positions, 1)


def speed_bound(costs: SpecCosts, totals: SpecTotals, proposer: str, plain: float, k_max: int, tokens: int,
                prompt: float) -> tuple[float, int]:
    """The speed (a multiple of plain decoding's) that drafting ``k`` tokens wherever the proposer has a guess
    would reach with these costs and the acceptance per draft position measured in the run, at the best ``k``,
    and that ``k``: a guessed step yields ``1 + sum_j P(first j accepted)`` tokens for a verify of ``k`` plus
    proposing, an unguessed one 1 token for a plain step plus the (failed) lookup; a model drafter also runs
    each request's ``prompt`` tokens once (its catch-up), over a request of ``tokens`` decode steps. The plain
    step is the proposer's own runs' (the same statistic, measured alongside its verify steps), else ``plain``."""
    if costs.plain is None:
        costs.record_plain(plain)
    plain = costs.plain_step() or plain
    g = totals.guess_share
    call = costs.draft_call.get(proposer, 0.0)
    once = prompt * costs.catch_up_token.get(proposer, 0.0)
    best, best_k = math.nan, 0
    made = 1.0
    for k, alive in enumerate(totals.positions.survival(k_max), start=1):
        made += alive
        step = costs.step_cost(proposer, k)
        if step is None or g != g:
            return math.nan, 0
        per_token = (g * (step + call) + (1 - g) * (plain + call)) / (g * made + 1 - g)
        speed = tokens * plain / (tokens * per_token + once)
        if not speed <= best:
            best, best_k = speed, k
    return best, best_k


def lookup_bound(prompts: list[list[int]], answers: list[list[int]], costs: SpecCosts, plain: float, k_max: int,
                 ngram_max: int, other: float = 0.0) -> tuple[float, int]:
    """Prompt lookup's bound at a fixed draft length, replayed on the answers themselves: the speed (a multiple
    of plain decoding's) of drafting ``k`` guessed tokens wherever it has a guess (fewer where the guess or the
    answer is shorter) and decoding plainly elsewhere, with the costs `lookup_ceiling` uses, at the best ``k``,
    and that ``k``. Replaying rather than applying the run's acceptance per draft position to every guess: the
    engine drafts where its guesses hold best, so those figures overstate the guesses it declines."""
    table = costs.verify_costs(k_max)
    if table is None:
        return math.nan, 0
    plain = table[0] or plain
    call = costs.draft_call.get("prompt_lookup", 0.0)
    best, best_k = math.nan, 0
    plain_spent = sum((len(a) - 1) * plain for a in answers)
    for k in range(1, k_max + 1):
        spent = 0.0
        for prompt, answer in zip(prompts, answers, strict=True):
            t = 1
            while t < len(answer):
                guess = prompt_lookup([*prompt, *answer[:t]], min(k, len(answer) - t - 1), ngram_max)
                if not guess:
                    spent += plain + call
                    t += 1
                    continue
                held = 0
                while held < len(guess) and guess[held] == answer[t + held]:
                    held += 1
                spent += table[len(guess)] + call
                t += held + 1
        speed = (other + plain_spent) / (other + spent)
        if not speed <= best:
            best, best_k = speed, k
    return best, best_k


def lookup_ceiling(prompts: list[list[int]], answers: list[list[int]], costs: SpecCosts, plain: float, k_max: int,
                   ngram_max: int, other: float = 0.0) -> float:
    """Prompt lookup's ceiling: the speed (a multiple of plain decoding's) if it knew which of its guesses will
    hold — at every answer position it drafts exactly the guessed tokens that the target accepts (nothing where
    the first is wrong) — with the plain and verify steps measured in its runs (``plain`` where they had no
    plain step) and its lookup cost on every step; ``other``: seconds both pay besides the decode steps (the
    prefills)."""
    table = costs.verify_costs(k_max)
    if table is None:
        return math.nan
    plain = table[0] or plain
    call = costs.draft_call.get("prompt_lookup", 0.0)
    spent = plain_spent = 0.0
    for prompt, answer in zip(prompts, answers, strict=True):
        n = len(answer)
        best = [0.0] * (n + 1)  # best[t]: the least cost of producing answer[t:] (answer[0] came with the prefill)
        for t in range(n - 1, 0, -1):
            guess = prompt_lookup([*prompt, *answer[:t]], min(k_max, n - t - 1), ngram_max)
            held = 0
            while held < len(guess) and guess[held] == answer[t + held]:
                held += 1
            best[t] = min([plain + call + best[t + 1]] + [table[k] + call + best[t + k + 1]
                                                          for k in range(1, held + 1)])
        spent += best[1]
        plain_spent += (n - 1) * plain
    return (other + plain_spent) / (other + spent)


def run_speculative_bench(demo_dir: Path, draft_dir: Path | None, log: Log, *, decode_tokens: int = 96,
                          repeats: int = 3) -> list[SpecRow]:
    """Part (f): see the module docstring."""
    if not (demo_dir / "config.json").is_file():
        log(f"(f) skipped: no demo model at {demo_dir}")
        return []
    has_draft = draft_dir is not None and (draft_dir / "config.json").is_file()
    engine = LLMEngine.from_dir(demo_dir, enable_prefix_caching=False,
                                draft_model_dir=draft_dir if has_draft else None)
    spec = engine.speculator
    modes = ["off", "prompt_lookup"] + (["draft"] if has_draft else []) + (
        ["self"] if (engine.default_experts_per_token or 0) > 1 else [])
    rows: list[SpecRow] = []
    for workload, prompts in spec_workloads(engine).items():
        params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
        answers = [o.output_token_ids for o in engine.generate(prompts, params, speculative="off")]
        in_prompt, guessed = answer_reuse(prompts, answers, spec.config.ngram_max)
        log(f"(f) {workload}: {in_prompt:.0%} of the answers' 4-grams occur in their prompt; prompt lookup's "
            f"next-token guess is right at {guessed:.0%} of the answer positions")
        costs = {m: SpecCosts() for m in modes}

        def measure(mode: str, prompts: list[list[int]] = prompts, costs: dict[str, SpecCosts] = costs) -> float:
            spec.costs = costs[mode]
            return spec_tokens_per_s(engine, prompts, decode_tokens, mode)

        spec.totals.clear()
        spec.acceptance.clear()
        for m in modes:  # warm-up: kernels, drafter caches
            spec.costs = SpecCosts()
            spec_tokens_per_s(engine, prompts[:1], 8, m)
        spec.totals.clear()
        speed = best_interleaved({m: partial(measure, m) for m in modes}, repeats)
        plain = costs["off"].mean("plain")
        for m in modes:
            totals = spec.totals.get(m, SpecTotals())
            c = costs[m]
            prompt = sum(map(len, prompts)) / len(prompts)
            bound, bound_k = (1.0, 0) if m == "off" else speed_bound(c, totals, m, plain, spec.config.max_draft,
                                                                   decode_tokens - 1, prompt)
            verified = c.sums.get("verify", [0.0, 0.0])[0]
            mean_k = sum(k * c.sums[f"verify:{k}"][0] for k in c.verify) / verified if verified else math.nan
            draft = c.draft_call.get(m, c.draft_token.get(m, math.nan)) if m != "off" else 0.0
            rows.append(SpecRow(workload, m, speed[m], speed[m] / speed["off"], totals.acceptance_rate,
                                totals.tokens_per_verify, totals.guess_share, 1e3 * plain, 1e3 * c.mean("verify"),
                                mean_k, 1e3 * draft, 1e3 * prompt * c.catch_up_token.get(m, 0.0), bound, bound_k))
        curve = costs["prompt_lookup"]
        prefills = len(prompts) * decode_tokens / speed["off"] - len(prompts) * (decode_tokens - 1) * plain
        ceiling = lookup_ceiling(prompts, answers, curve, plain, spec.config.max_draft, spec.config.ngram_max,
                                 max(prefills, 0.0))
        bound, bound_k = lookup_bound(prompts, answers, curve, plain, spec.config.max_draft, spec.config.ngram_max,
                                      max(prefills, 0.0))
        rows = [replace(r, ceiling=ceiling, bound=bound, bound_k=bound_k)
                if r.workload == workload and r.mode == "prompt_lookup" else r for r in rows]
        log(f"(f) {workload}: plain decoding {speed['off']:.1f} tok/s (decode step {1e3 * plain:.2f} ms); verify step "
            "by draft length (prompt lookup's runs, ms): " + ", ".join(
                f"{k}: {1e3 * curve.verify[k].value:.2f}" for k in sorted(curve.verify) if curve.verify[k].count >= 3))
        log(f"(f) {workload}: prompt lookup's ceiling, had it known in advance which of its guesses hold, "
            f"{ceiling:.2f}x; it reached {rows[-len(modes) + 1].ratio / ceiling:.0%} of that")
        for row in rows[-len(modes) + 1:]:
            _log_row(row, log)
    return rows


def _log_row(row: SpecRow, log: Log) -> None:
    reached = row.ratio / max(row.bound, 1.0) if row.bound == row.bound else math.nan
    ceiling = (f"; its ceiling {row.ceiling:.2f}x, reached {row.ratio / row.reachable:.0%} of max(ceiling, 1)"
               if row.ceiling == row.ceiling else "")
    log(f"(f) {row.workload}, {row.mode}: {row.tokens_per_s:.1f} tok/s -> ratio {row.ratio:.2f}x vs plain "
        f"(target >= {row.target:.2f}x: {_verdict(row.ratio, row.target)}); a guess at {row.guess_share:.0%} of its "
        f"steps, acceptance {row.acceptance:.0%}, {row.tokens_per_verify:.2f} tokens/verify; step {row.step_ms:.2f} ms, "
        f"verify {row.verify_ms:.2f} ms at {row.verify_k:.1f} drafts, {_drafting(row)} -> bound "
        f"{row.bound:.2f}x (drafting {row.bound_k} wherever it has a guess), reached {reached:.0%} of "
        f"max(bound, 1){ceiling}")


def _drafting(row: SpecRow) -> str:
    if row.mode == "prompt_lookup":
        return f"lookup {row.draft_ms:.2f} ms a step"
    return f"drafting {row.draft_ms:.2f} ms a token + {row.catch_up_ms:.1f} ms over the prompt"
