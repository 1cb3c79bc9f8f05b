"""The spend rollups behind the admin overview (tables ``tenant_spend_spans`` and
``daily_tier_spend``, revision 0008_spend_rollups): how a day maps to its spans, how a window of
days is covered by spans, and the increments the ledger applier adds to both tables from the
``daily_spend`` increments it writes (same transaction, same integer-summed amounts, so the
rollups equal daily_spend's sums to the nano-dollar).

A span of ``n`` days (``n`` in ``SPANS``) starts on a day whose epoch-day number (days since
1970-01-01) is a multiple of ``n``. Each day lies in exactly one span of each length, so one
daily increment adds to ``len(SPANS)`` span rows; and any window [since, until] is the disjoint
union of at most about ``2 * len(SPANS)`` spans (``cover``), for any window length (a window
longer than the longest span uses several of those). Imports nothing of the gateway.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import date, timedelta
from typing import Any

SPANS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
EPOCH = date(1970, 1, 1)
ROLLUP_SUMS = ("requests", "prompt_tokens", "completion_tokens", "cost_usd", "baseline_cost_usd")


def span_start(day: date, span: int) -> date:
    """The first day of the ``span``-day span holding ``day``."""
    return day - timedelta(days=(day - EPOCH).days % span)


def cover(since: date, until: date) -> list[tuple[int, date]]:
    """(span length, start) of the fewest aligned spans whose union is exactly [since, until]
    (inclusive days; empty when since > until): greedily the longest aligned span that fits."""
    out: list[tuple[int, date]] = []
    day = since
    while day <= until:
        left = (until - day).days + 1
        n = (day - EPOCH).days
        span = max(s for s in SPANS if n % s == 0 and s <= left)
        out.append((span, day))
        day += timedelta(days=span)
    return out


def _add(acc: dict[Any, dict[str, Any]], key: Any, base: dict[str, Any], row: Mapping[str, Any]) -> None:
    cur = acc.get(key)
    if cur is None:
        acc[key] = {**base, **{c: row[c] for c in ROLLUP_SUMS}}
    else:
        for c in ROLLUP_SUMS:
            cur[c] += row[c]


def rollup_rows(daily: Iterable[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The increments of ``tenant_spend_spans`` and ``daily_tier_spend`` for daily_spend
    increments (dicts with tenant_id, day, tier and the ``ROLLUP_SUMS``; money as exact Decimal
    or int nanos, added as given), each list sorted by its primary key: concurrent writers lock
    the rows in one order, so two appliers never deadlock on them."""
    spans: dict[tuple[int, date, str], dict[str, Any]] = {}
    tiers: dict[tuple[date, str], dict[str, Any]] = {}
    for row in daily:
        day, tenant = row["day"], row["tenant_id"]
        for span in SPANS:
            start = span_start(day, span)
            _add(spans, (span, start, tenant), {"span_days": span, "start_day": start, "tenant_id": tenant}, row)
        _add(tiers, (day, row["tier"]), {"day": day, "tier": row["tier"]}, row)
    return [spans[k] for k in sorted(spans)], [tiers[k] for k in sorted(tiers)]

