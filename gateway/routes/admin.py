"""The admin console's pages and read-only JSON under ``/admin``: spend, all-high baseline and
savings per tenant and per day (from ``daily_spend``; inline-SVG charts stacked by tier with the
baseline line), each tenant's live budget (limit, spent, held, remaining, % used, reset), refused
(429) requests, open alerts, the effort mix of requests that ran, latency percentiles, keys with
their spend and budgets, alerts with readable names and times, batches (with a cancel form), the audit log,
and a paged recent-requests table with the key of each request.

Auth: the admin key (environment variable named by ``server.admin_key_env``) entered in a
login form, which sets an HttpOnly, SameSite=Strict, expiring session cookie signed with a key
derived from it; the JSON endpoints also take ``Authorization: Bearer <admin key>``. With no
admin key configured every page answers 403. Pages only read; state changes are POSTs (login,
logout here; the console's actions in gateway.routes.admin_forms and gateway.routes.admin_api,
CSRF-checked and audited), and a POST whose Origin is another site is refused; every admin key a
client sends (login form or bearer) is checked through one throttle per client address
(gateway.routes.admin_auth). Templates are autoescaped. Every query is an index range scan or an
aggregate (``tiergate bench dashboard`` times them at 1M rows). Imports the db query helpers,
budgets' read side, the jobs store's reads, gateway.console's read helpers, gateway.admin and
admin_auth; never the pipeline or providers.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import anyio
import jinja2
import orjson
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from gateway import console
from gateway.admin import SESSION_COOKIE, SessionSigner, charts
from gateway.budgets.alerts import recent_alerts
from gateway.budgets.policies import default_tenant_policy, tenant_policies
from gateway.db import admin_queries as aq
from gateway.db.models import BudgetPolicyRow
from gateway.db.queries import SpendTotals
from gateway.errors import InvalidRequest, NotFound, PermissionDenied, RateLimited
from gateway.ids import Identifier, check_identifier
from gateway.jobs import store as jobs_store
from gateway.routes.admin_auth import (
    admin_json,
    admin_key,
    check_key,
    csrf_for,
    same_origin,
    signed_in,
    throttled,
)
from gateway.runtime import Runtime
from gateway.web.deps import get_runtime
from gateway.web.request_body import read_body

router = APIRouter(prefix="/admin")

ASSETS = Path(__file__).resolve().parent.parent / "admin"
STATIC = {"admin.css": "text/css; charset=utf-8", "admin.js": "text/javascript; charset=utf-8"}
SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
                    "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "same-origin",  # not no-referrer: chromium then sends Origin: null on our own POSTs
                    "Cache-Control": "no-store"}
MAX_LOGIN_BODY = 4096


@lru_cache(maxsize=1)
def _templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ASSETS / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["usd"] = lambda v: f"{Decimal(v):.6f}"
    env.filters["pct"] = lambda v: "–" if v is None else f"{100 * v:.1f}%"
    env.filters["when"] = _when
    env.filters["tiers"] = lambda d: [(t, d[t]) for t in charts.tier_sort(list(d))]
    return env


def _html(template: str, status: int = 200, **ctx: Any) -> HTMLResponse:
    return HTMLResponse(_templates().get_template(template).render(**ctx), status_code=status,
                        headers=SECURITY_HEADERS)


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body, default=_encode), media_type="application/json",
                    headers={"Cache-Control": "no-store"})


def _encode(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)
    raise TypeError(type(value).__name__)


# ---- auth (gateway.routes.admin_auth: one throttled check of every admin key sent) -----------

def _disabled_message(state: Runtime) -> str:
    return f"admin dashboard disabled: set the environment variable {state.settings.server.admin_key_env}"


def _throttled_page(wait: RateLimited) -> Response:
    refused = _html("login.html", 429, error="too many failed logins; try again later")
    refused.headers.update(wait.headers)
    return refused


def _page_gate(request: Request, state: Runtime) -> Response | None:
    """For HTML pages: None when the caller may see the page, else the response to send."""
    key = admin_key(state)
    if key is None:
        return _html("disabled.html", 403, message=_disabled_message(state))
    try:
        allowed = signed_in(request, state, key)
    except RateLimited as wait:
        return _throttled_page(wait)
    if not allowed:
        return RedirectResponse("/admin/login", status_code=303)
    return None


# ---- data ------------------------------------------------------------------------------------

def _window(days: int) -> tuple[date, date]:
    today = datetime.now(UTC).date()
    return today - timedelta(days=days - 1), today


def _totals_json(t: aq.SpendTotals) -> dict[str, Any]:
    return {"calls": t.calls, "prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens,
            "cost_usd": t.cost_usd, "baseline_cost_usd": t.baseline_cost_usd, "savings_usd": t.savings_usd,
            "savings_ratio": t.savings_ratio}


def _overview(state: Runtime, days: int, mix_hours: int) -> dict[str, Any]:
    since, until = _window(days)
    with state.session_factory() as s:
        tenants, day_tier = aq.overview_spend(s, since, until)  # per day and the total follow from day_tier
        per_day, total = aq.days_and_total(day_tier)
        mixes = aq.tier_mix_by_tenant(s, [t.tenant_id for t in tenants],
                                      datetime.now(UTC) - timedelta(hours=mix_hours))
        open_alerts = aq.open_alerts_by_tenant(s)
        audit = console.audit_log(s, limit=20)
    mix = aq.combine_mixes(list(mixes.values()))
    return {"since": since, "until": until, "days": days, "total": total, "tenants": tenants, "per_day": per_day,
            "mix_hours": mix_hours, "mixes": mixes, "mix": mix, "open_alerts": open_alerts,
            "audit": audit, "chart_days": _day_chart(per_day, day_tier, "Spend per day by tier (all tenants)"),
            "chart_mix": charts.share_bar(mix.by_tier, label=f"Effort mix, last {mix_hours} h")}


def _day_chart(per_day: list[aq.DaySpend], day_tier: dict[date, dict[str, SpendTotals]], label: str) -> str:
    tiers = sorted({t for v in day_tier.values() for t in v})
    days = [d.day for d in per_day]
    series = {t: [float(day_tier.get(d, {}).get(t, _ZERO).cost_usd) for d in days] for t in tiers}
    return charts.stacked_days([d.isoformat() for d in days], series,
                               [float(d.totals.baseline_cost_usd) for d in per_day], label=label)


_ZERO = SpendTotals(0, 0, 0, Decimal(0), Decimal(0))


async def _budgets_of(state: Runtime) -> dict[str, dict[str, Any]]:
    """Live budget status (spent, held, remaining, reset) of every tenant with a stored budget:
    the policies in one query, the counters in one snapshot."""
    budgets = state.budgets.budgets

    def read() -> list[Any]:
        defaults = budgets.policies.defaults
        with state.session_factory() as s:
            stored = tenant_policies(s, defaults)
            if defaults.limit_usd is None:
                return stored
            # budgets.limit_usd gives every tenant without its own policy the configured default
            have = {p.tenant_id for p in stored}
            return stored + [default_tenant_policy(tid, defaults) for tid, _ in aq.list_tenants(s) if tid not in have]

    statuses = await budgets.statuses(await anyio.to_thread.run_sync(read))
    return {subject.removeprefix("tenant:"): _with_gauge(st.to_json()) for subject, st in statuses.items()}


def _with_gauge(status: dict[str, Any]) -> dict[str, Any]:
    limit = status["hard_limit_usd"] or status["soft_limit_usd"]
    used = None if not limit else (status["spent_usd"] + status["held_usd"]) / limit
    resets = status.get("resets_in_s")
    reset_at = None if resets is None else (datetime.now(UTC) + timedelta(seconds=resets)).strftime("%Y-%m-%d %H:%M UTC")
    return {**status, "used": used, "reset_at": reset_at}


async def _overview_data(state: Runtime, days: int, mix_hours: int) -> dict[str, Any]:
    data = await anyio.to_thread.run_sync(_overview, state, days, mix_hours)
    data["budgets"] = await _budgets_of(state)
    return data


def _when(ts: str | datetime | None) -> str:
    """A timestamp as people read it: ``2026-12-01 16:02:07 UTC``."""
    if ts is None:
        return "–"
    at = datetime.fromisoformat(ts) if isinstance(ts, str) else ts
    at = at if at.tzinfo else at.replace(tzinfo=UTC)
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def webhook_configured(state: Runtime) -> bool:
    env = state.settings.budgets.alert_webhook_env
    return bool(env and os.environ.get(env))


def _readable_alerts(alerts: list[dict[str, Any]], tenant_name: str, keys: list[aq.KeyRow],
                     webhook: bool) -> list[dict[str, Any]]:
    names = {f"key:{k.id}": f"key {k.name or k.prefix} ({k.prefix}…)" for k in keys}
    out = []
    for a in alerts:
        subject = names.get(a["subject"], f"tenant {tenant_name}" if a["subject"].startswith("tenant:") else a["subject"])
        if a["delivered_at"]:
            delivery = f"delivered {_when(a['delivered_at'])}"
        elif not webhook:
            delivery = "not sent: no webhook configured"
        else:
            delivery = f"not delivered yet ({a['attempts']} attempts{'; ' + a['last_error'] if a['last_error'] else ''})"
        out.append({**a, "subject_name": subject, "when": _when(a["created_at"]), "delivery": delivery,
                    "acknowledged": _when(a["acknowledged_at"]) if a["acknowledged_at"] else None})
    return out


def _mix_json(mix: aq.TierMix, hours: int) -> dict[str, Any]:
    return {"hours": hours, "total": mix.total, "by_tier": mix.by_tier, "pipeline": mix.pipeline,
            "pipeline_share": mix.pipeline_share, "refused": mix.refused}


def _tenant(state: Runtime, tenant_id: str, days: int, mix_hours: int, limit: int,
            before: tuple[datetime, str] | None) -> dict[str, Any]:
    since, until = _window(days)
    mix_since = datetime.now(UTC) - timedelta(hours=mix_hours)
    with state.session_factory() as s:
        name = aq.tenant_name(s, tenant_id)
        if name is None:
            raise NotFound(f"no tenant {tenant_id!r}")
        per_day = aq.spend_by_day(s, since, until, tenant_id)
        mix = aq.tier_mix(s, tenant_id, mix_since)
        keys = aq.keys_of_tenant(s, tenant_id, datetime.combine(since, datetime.min.time(), UTC))
        latency = aq.latency_percentiles(s, tenant_id, mix_since)
        policy = s.get(BudgetPolicyRow, f"tenant:{tenant_id}")
        return {"tenant_id": tenant_id, "name": name, "since": since, "until": until, "days": days,
                "total": aq.spend_total(s, since, until, tenant_id),
                "per_day": per_day,
                "per_tier": aq.spend_by_tier(s, since, until, tenant_id),
                "mix_hours": mix_hours, "mix": mix, "keys": keys, "policy": console.policy_json(policy),
                "page": aq.recent_requests(s, tenant_id, limit=limit, before=before),
                "alerts": recent_alerts(s, tenant_id, limit=20),
                "audit": console.audit_log(s, tenant_id=tenant_id, limit=20),
                "batches": _batches_view(s, tenant_id),
                "chart_days": _day_chart(per_day, aq.spend_by_day_tier(s, since, until, tenant_id),
                                         f"Spend per day by tier ({name})"),
                "chart_mix": charts.share_bar(mix.by_tier, label=f"Effort mix, last {mix_hours} h"),
                "chart_latency": charts.grouped_bars(
                    {t: {f"p{round(p * 100)}": v for p, v in latency[t].items()} for t in charts.tier_sort(list(latency))},
                    label=f"Latency percentiles by tier, last {mix_hours} h")}


def _batches_view(s: Any, tenant_id: str, limit: int = 10) -> list[dict[str, Any]]:
    """A tenant's latest batches: status, OpenAI's counts (completed, failed; a cancelled line is
    neither), cancelled lines, progress and a naive ETA (the rate since the batch started, applied
    to its remaining lines); ``cancellable`` while a cancel is accepted (validating, in_progress)."""
    batches = jobs_store.list_batches(s, tenant_id, limit=limit, after=None)
    ids = [b.id for b in batches]
    counts = jobs_store.line_counts(s, ids)
    states = jobs_store.line_states(s, ids)
    now = datetime.now(UTC)
    out = []
    for b in batches:
        c = counts.get(b.id, {"completed": 0, "failed": 0})
        done = c["completed"] + c["failed"]
        eta = None
        if b.in_progress_at is not None and b.status == "in_progress" and 0 < done < b.total:
            started = b.in_progress_at if b.in_progress_at.tzinfo else b.in_progress_at.replace(tzinfo=UTC)
            elapsed = (now - started).total_seconds()
            eta = f"~{max(elapsed / done * (b.total - done), 1):.0f} s"
        st = states[b.id]
        out.append({"id": b.id, "status": b.status, "total": b.total, "completed": c["completed"],
                    "failed": c["failed"], "cancelled": st["cancelled"], "running": st["running"],
                    "done": done, "settled": done + st["cancelled"] + st["expired"],
                    "created_at": _when(b.created_at), "eta": eta, "cancellable": b.status in jobs_store.ACTIVE})
    return out


class _Tenant:
    def __init__(self, tenant_id: str) -> None:
        self.tenant_id, self.key_id = tenant_id, None


async def _budget(state: Runtime, tenant_id: str) -> dict[str, Any] | None:
    return (await state.budgets.budgets.status(_Tenant(tenant_id))).to_json()


def _cursor(before_at: str | None, before_id: str | None) -> tuple[datetime, str] | None:
    if before_at is None or before_id is None:
        return None
    try:
        return datetime.fromisoformat(before_at), before_id
    except ValueError:
        raise InvalidRequest("invalid paging cursor", param="before_at") from None


async def _tenant_data(state: Runtime, tenant_id: str, days: int, mix_hours: int, limit: int,
                       before_at: str | None, before_id: str | None) -> dict[str, Any]:
    before = _cursor(before_at, before_id)
    data = await anyio.to_thread.run_sync(_tenant, state, tenant_id, days, mix_hours, limit, before)
    budget = await _budget(state, tenant_id)
    data["budget"] = None if budget is None else _with_gauge(budget)
    key_status = {}
    for k in data["keys"]:
        if k.budget_period is not None:
            st = (await state.budgets.budgets.status(_Key(tenant_id, k.id))).to_json()
            key_status[k.id] = _with_gauge(st) if st["subject"] == f"key:{k.id}" else None
    data["key_status"] = key_status
    data["key_names"] = {k.id: k.name or k.prefix for k in data["keys"]}
    data["alerts_view"] = _readable_alerts(data["alerts"], data["name"], data["keys"], webhook_configured(state))
    return data


class _Key:
    def __init__(self, tenant_id: str, key_id: str) -> None:
        self.tenant_id, self.key_id = tenant_id, key_id


DAYS = Query(30, ge=1, le=366)
MIX_HOURS = Query(24, ge=1, le=24 * 31)
LIMIT = Query(50, ge=1, le=aq.MAX_PAGE)


# ---- HTML pages ------------------------------------------------------------------------------

@router.get("/login", response_class=HTMLResponse)
async def login_form(state: Runtime = Depends(get_runtime)) -> Response:
    if admin_key(state) is None:
        return _html("disabled.html", 403, message=_disabled_message(state))
    return _html("login.html", error=None)


@router.post("/login")
async def login(request: Request, state: Runtime = Depends(get_runtime)) -> Response:
    key = admin_key(state)
    if key is None:
        return _html("disabled.html", 403, message=_disabled_message(state))
    if not same_origin(request):
        return _html("login.html", 403, error="cross-site login refused")
    wait = throttled(request, state)
    if wait is not None:  # refused before its body is read
        return _throttled_page(wait)
    server = state.settings.server
    raw = await read_body(request, min(MAX_LOGIN_BODY, server.max_body_bytes), server.body_read_timeout_s)
    given = (parse_qs(raw.decode("utf-8", "replace")).get("admin_key") or [""])[0]
    try:
        accepted = check_key(request, state, given, key)
    except RateLimited as refused:
        return _throttled_page(refused)
    if not accepted:
        return _html("login.html", 401, error="wrong admin key")
    signer = SessionSigner(key)
    resp = RedirectResponse("/admin", status_code=303)
    resp.set_cookie(SESSION_COOKIE, signer.issue(), max_age=signer.ttl_s, path="/admin", httponly=True,
                    samesite="strict", secure=request.url.scheme == "https")
    return resp


@router.post("/logout")
async def logout(request: Request) -> Response:
    if not same_origin(request):
        raise PermissionDenied("cross-site request refused")
    resp = RedirectResponse("/admin/login", status_code=303)
    resp.delete_cookie(SESSION_COOKIE, path="/admin", httponly=True, samesite="strict")
    return resp


@router.get("", response_class=HTMLResponse)
async def overview_page(request: Request, days: int = DAYS, mix_hours: int = MIX_HOURS,
                        shown: int = Query(100, ge=1, le=100_000), state: Runtime = Depends(get_runtime)) -> Response:
    """The overview; its tenants table lists the ``shown`` biggest spenders, then tenants near or
    over a budget or with open alerts (the JSON API lists every tenant)."""
    gate = _page_gate(request, state)
    if gate is not None:
        return gate
    data = await _overview_data(state, days, mix_hours)
    every = data["tenants"]
    flagged = {tid for tid, b in data["budgets"].items() if (b["used"] or 0) >= 0.8} | set(data["open_alerts"])
    listed = every[:shown] + [t for t in every[shown:] if t.tenant_id in flagged]
    data["tenants"] = listed
    return _html("overview.html", csrf=csrf_for(request, state), back=str(request.url.path), shown=shown,
                 tenant_count=len(every), **data)


@router.get("/tenants/{tenant_id}", response_class=HTMLResponse)
async def tenant_page(request: Request, tenant_id: str, days: int = DAYS, mix_hours: int = MIX_HOURS,
                      limit: int = LIMIT, before_at: str | None = None, before_id: str | None = None,
                      state: Runtime = Depends(get_runtime)) -> Response:
    gate = _page_gate(request, state)
    if gate is not None:
        return gate
    check_identifier(tenant_id, "tenant_id")
    if before_id is not None:
        check_identifier(before_id, "before_id")
    data = await _tenant_data(state, tenant_id, days, mix_hours, limit, before_at, before_id)
    return _html("tenant.html", limit=limit, csrf=csrf_for(request, state), back=str(request.url.path),
                 webhook=webhook_configured(state), **data)


@router.get("/static/{name}")
async def static_file(name: str) -> Response:
    if name not in STATIC:
        raise NotFound("not found")
    body = await anyio.Path(ASSETS / "static" / name).read_bytes()
    return Response(body, media_type=STATIC[name], headers={"X-Content-Type-Options": "nosniff"})


# ---- JSON ------------------------------------------------------------------------------------

@router.get("/api/overview")
async def overview_json(days: int = DAYS, mix_hours: int = MIX_HOURS,
                        state: Runtime = Depends(admin_json)) -> Response:
    d = await _overview_data(state, days, mix_hours)
    return _json({"since": d["since"], "until": d["until"], "total": _totals_json(d["total"]),
                  "mix": _mix_json(d["mix"], mix_hours),
                  "tenants": [{"tenant_id": t.tenant_id, "name": t.name, **_totals_json(t.totals),
                               "mix": _mix_json(d["mixes"][t.tenant_id], mix_hours),
                               "budget": d["budgets"].get(t.tenant_id),
                               "open_alerts": d["open_alerts"].get(t.tenant_id, 0)} for t in d["tenants"]],
                  "per_day": [{"day": x.day, **_totals_json(x.totals)} for x in d["per_day"]]})


@router.get("/api/tenants/{tenant_id}")
async def tenant_json(tenant_id: Identifier, days: int = DAYS, mix_hours: int = MIX_HOURS, limit: int = LIMIT,
                      before_at: str | None = None, before_id: Identifier | None = None,
                      state: Runtime = Depends(admin_json)) -> Response:
    d = await _tenant_data(state, tenant_id, days, mix_hours, limit, before_at, before_id)
    page: aq.RequestPage = d["page"]
    mix: aq.TierMix = d["mix"]
    nxt = page.next_cursor
    return _json({"tenant_id": tenant_id, "name": d["name"], "since": d["since"], "until": d["until"],
                  "total": _totals_json(d["total"]),
                  "per_day": [{"day": x.day, **_totals_json(x.totals)} for x in d["per_day"]],
                  "per_tier": {k: _totals_json(v) for k, v in d["per_tier"].items()},
                  "mix": _mix_json(mix, mix_hours),
                  "budget": d["budget"], "alerts": d["alerts"],
                  "keys": [{**k.to_json(), "status": d["key_status"].get(k.id)} for k in d["keys"]],
                  "requests": [asdict(r) for r in page.rows],
                  "next": None if nxt is None else {"before_at": nxt[0].isoformat(), "before_id": nxt[1]}})
