"""Server-side charts for the admin console as inline SVG: no script, no CDN, no inline style
(the pages' CSP forbids both; colours are presentation attributes). Each function takes plain
numbers and returns SVG markup as a string the templates mark safe; every label is escaped
here. Pure: the standard library only; must not import the rest of the gateway.

- ``stacked_days``: spend per day stacked by tier, with the all-high baseline as a line.
- ``share_bar``: one horizontal bar split by share (the effort mix).
- ``grouped_bars``: small groups of bars (latency percentiles per tier).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

TIER_ORDER = ("low", "medium", "high", "xhigh", "unrouted")
COLORS = {"low": "#4e9a6b", "medium": "#2d5bd8", "high": "#b54708", "xhigh": "#7a2e9e", "unrouted": "#98a2b3"}
LINE = "#1d2330"


def tier_sort(tiers: Sequence[str]) -> list[str]:
    """Tiers in effort order (low → xhigh), unknown ones after, by name."""
    rank = {t: i for i, t in enumerate(TIER_ORDER)}
    return sorted(tiers, key=lambda t: (rank.get(t, len(rank)), t))


def _color(tier: str) -> str:
    return COLORS.get(tier, "#667085")


def _fmt(v: float) -> str:
    return f"{v:.6f}".rstrip("0").rstrip(".") if v else "0"


def _legend(items: Sequence[tuple[str, str]], y: float, *, line: str | None = None) -> str:
    out, x = [], 0.0
    for name, color in items:
        out.append(f'<rect x="{x:.0f}" y="{y - 9:.0f}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{x + 14:.0f}" y="{y:.0f}" font-size="11">{escape(name)}</text>')
        x += 22 + 7 * len(name)
    if line:
        out.append(f'<line x1="{x:.0f}" y1="{y - 4:.0f}" x2="{x + 16:.0f}" y2="{y - 4:.0f}" stroke="{LINE}" '
                   f'stroke-width="2" stroke-dasharray="4 2"/><text x="{x + 20:.0f}" y="{y:.0f}" font-size="11">'
                   f'{escape(line)}</text>')
    return "".join(out)


def stacked_days(days: Sequence[str], series: Mapping[str, Sequence[float]], baseline: Sequence[float], *,
                 label: str, width: int = 720, height: int = 220) -> str:
    """Bars per day stacked by tier (``series[tier][i]`` USD on ``days[i]``), and the all-high
    baseline per day as a dashed line. ``label`` names the chart for screen readers."""
    n = len(days)
    if n == 0:
        return f'<p class="empty" data-testid="chart-empty">{escape(label)}: no spend in this window.</p>'
    tiers = tier_sort(list(series))
    left, top, bottom = 56, 10, 40
    plot_w, plot_h = width - left - 8, height - top - bottom
    totals = [sum(series[t][i] for t in tiers) for i in range(n)]
    peak = max([*totals, *baseline, 1e-12])
    slot = plot_w / n
    bar_w = max(1.0, slot * 0.7)

    def y(v: float) -> float:
        return top + plot_h - plot_h * v / peak

    parts = [f'<svg class="chart" role="img" aria-label="{escape(label)}" viewBox="0 0 {width} {height}" '
             f'preserveAspectRatio="xMidYMid meet" xmlns="http://www.w3.org/2000/svg" data-testid="chart-days">',
             f'<title>{escape(label)}</title>']
    for frac in (0.0, 0.5, 1.0):
        gy = y(peak * frac)
        parts.append(f'<line x1="{left}" y1="{gy:.1f}" x2="{width - 8}" y2="{gy:.1f}" stroke="#e4e7ec"/>'
                     f'<text x="{left - 4}" y="{gy + 4:.1f}" font-size="10" text-anchor="end">${_fmt(peak * frac)}</text>')
    for i in range(n):
        x = left + i * slot + (slot - bar_w) / 2
        acc = 0.0
        for t in tiers:
            v = series[t][i]
            if v <= 0:
                continue
            y0, y1 = y(acc), y(acc + v)
            parts.append(f'<rect x="{x:.1f}" y="{y1:.1f}" width="{bar_w:.1f}" height="{max(y0 - y1, 0.5):.1f}" '
                         f'fill="{_color(t)}"><title>{escape(days[i])} {escape(t)}: ${_fmt(v)}</title></rect>')
            acc += v
        if n <= 16 or i % max(1, n // 8) == 0:
            parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{top + plot_h + 14}" font-size="10" '
                         f'text-anchor="middle">{escape(days[i][5:])}</text>')
    if baseline:
        pts = " ".join(f"{left + i * slot + slot / 2:.1f},{y(b):.1f}" for i, b in enumerate(baseline))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{LINE}" stroke-width="2" stroke-dasharray="4 2" '
                     f'data-testid="baseline-line"><title>all-high baseline</title></polyline>')
    parts.append(f'<g transform="translate({left},{height - 6})">'
                 + _legend([(t, _color(t)) for t in tiers], 0, line="all-high baseline") + "</g>")
    parts.append("</svg>")
    return "".join(parts)


def share_bar(counts: Mapping[str, int], *, label: str, width: int = 480, height: int = 44) -> str:
    """One bar split by each tier's share of ``counts``, in effort order, with a legend."""
    total = sum(counts.values())
    if total <= 0:
        return f'<p class="empty">{escape(label)}: no requests in this window.</p>'
    parts = [f'<svg class="chart small" role="img" aria-label="{escape(label)}" viewBox="0 0 {width} {height}" '
             f'xmlns="http://www.w3.org/2000/svg" data-testid="chart-mix"><title>{escape(label)}</title>']
    x = 0.0
    tiers = [t for t in tier_sort(list(counts)) if counts[t] > 0]
    for t in tiers:
        w = width * counts[t] / total
        parts.append(f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="18" fill="{_color(t)}">'
                     f'<title>{escape(t)}: {counts[t]} ({100 * counts[t] / total:.1f}%)</title></rect>')
        x += w
    parts.append(_legend([(f"{t} {100 * counts[t] / total:.0f}%", _color(t)) for t in tiers], height - 6))
    parts.append("</svg>")
    return "".join(parts)


def grouped_bars(groups: Mapping[str, Mapping[str, float]], *, label: str, unit: str = "ms",
                 width: int = 480, height: int = 180) -> str:
    """For each group (a tier) one bar per key (p50, p90, p99), with its value on top."""
    if not groups:
        return f'<p class="empty">{escape(label)}: no answered requests in this window.</p>'
    keys = list(next(iter(groups.values())))
    peak = max([v for g in groups.values() for v in g.values()] + [1e-9])
    left, top, bottom = 8, 16, 36
    plot_h = height - top - bottom
    slot = (width - left) / len(groups)
    bar_w = slot * 0.8 / max(1, len(keys))
    shades = ["#9db4f0", "#5a7fe0", "#2d45a8"]
    parts = [f'<svg class="chart small" role="img" aria-label="{escape(label)}" viewBox="0 0 {width} {height}" '
             f'xmlns="http://www.w3.org/2000/svg" data-testid="chart-latency"><title>{escape(label)}</title>']
    for gi, (name, values) in enumerate(groups.items()):
        x0 = left + gi * slot + slot * 0.1
        for ki, k in enumerate(keys):
            v = values[k]
            h = plot_h * v / peak
            x = x0 + ki * bar_w
            parts.append(f'<rect x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{bar_w * 0.9:.1f}" height="{max(h, 0.5):.1f}" '
                         f'fill="{shades[ki % len(shades)]}"><title>{escape(name)} {escape(k)}: {v:.0f} {escape(unit)}</title>'
                         f'</rect><text x="{x + bar_w * 0.45:.1f}" y="{top + plot_h - h - 3:.1f}" font-size="9" '
                         f'text-anchor="middle">{v:.0f}</text>')
        parts.append(f'<text x="{x0 + bar_w * len(keys) / 2:.1f}" y="{top + plot_h + 14}" font-size="11" '
                     f'text-anchor="middle">{escape(name)}</text>')
    parts.append(_legend([(k, shades[i % len(shades)]) for i, k in enumerate(keys)], height - 4))
    parts.append("</svg>")
    return "".join(parts)
