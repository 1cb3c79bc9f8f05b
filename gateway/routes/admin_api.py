"""The admin HTTP API that changes state (JSON), shared by the console's forms and any client
such as the CLI; every action audited (gateway.console):

- ``POST /admin/api/tenants`` ``{"name", "allow_prompt_storage"?}`` → 201, the tenant;
- ``GET /admin/api/tenants/{id}/keys`` → the tenant's keys with spend in the window and budgets;
- ``POST /admin/api/tenants/{id}/keys`` ``{"name"?}`` → 201, the key with its secret under ``key``
  (shown once; only its hash is stored);
- ``POST /admin/api/keys/{id}/revoke`` (gateway.routes.admin_keys);
- ``PUT /admin/api/tenants/{id}/budget`` and ``PUT /admin/api/keys/{id}/budget``: ``period``,
  ``limit_usd``, ``soft_limit_usd``, ``alert_thresholds``, ``requests_per_min``,
  ``tokens_per_min``, ``raise_by_usd`` (adds to the hard limit) and ``clear`` (names to unset);
- ``POST /admin/api/alerts/{id}/acknowledge``;
- ``POST /admin/api/batches/{id}/cancel``: any tenant's batch, by the code path of
  ``POST /v1/batches/{id}/cancel`` (gateway.jobs.store.request_cancel) → the batch as that answers it;
- ``GET /admin/api/audit?tenant_id=&limit=``: the audit log, newest first;
- ``GET /admin/api/export/spend.csv?days=`` (tenant × day × tier) and
  ``GET /admin/api/export/tenants/{id}/keys.csv?days=`` (key × day × tier): CSV exports.

Auth (gateway.routes.admin_auth.writer): ``Authorization: Bearer <admin key>``, or the console's
session cookie on a same-origin request with the header ``X-CSRF-Token``; throttled per client.
Bodies are pydantic models that forbid unknown fields; errors are OpenAI-shaped.
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Literal

import anyio
import orjson
from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from gateway import console
from gateway.budgets.policies import Scope
from gateway.db import admin_queries as aq
from gateway.ids import Identifier
from gateway.jobs import store as jobs_store
from gateway.routes.admin_auth import CSRF_HEADER, admin_json, check_csrf, writer
from gateway.runtime import Runtime
from gateway.web.request_body import parse_model, read_json

router = APIRouter(prefix="/admin/api")

MAX_BODY = 16 * 1024
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 _.@:-]*$"


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200, pattern=NAME_PATTERN)
    allow_prompt_storage: bool = False


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("", max_length=200, pattern=r"^[A-Za-z0-9 _.@:-]*$")


class BudgetChangeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    period: Literal["day", "week", "month", "total"] | None = None
    limit_usd: Decimal | None = Field(None, ge=0, allow_inf_nan=False)
    soft_limit_usd: Decimal | None = Field(None, ge=0, allow_inf_nan=False)
    raise_by_usd: Decimal | None = Field(None, gt=0, allow_inf_nan=False)
    alert_thresholds: list[float] | None = Field(None, max_length=10)
    requests_per_min: int | None = Field(None, gt=0)
    tokens_per_min: int | None = Field(None, gt=0)
    clear: list[Literal["limit_usd", "soft_limit_usd", "alert_thresholds", "requests_per_min",
                        "tokens_per_min"]] = Field([], max_length=5)

    def change(self) -> console.BudgetChange:
        return console.BudgetChange(period=self.period, limit_usd=self.limit_usd, soft_limit_usd=self.soft_limit_usd,
                                    alert_thresholds=self.alert_thresholds, requests_per_min=self.requests_per_min,
                                    tokens_per_min=self.tokens_per_min, raise_by_usd=self.raise_by_usd,
                                    clear=tuple(self.clear))


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json",
                    headers={"Cache-Control": "no-store"})


async def _body(request: Request, state: Runtime, token: str | None, model: type[Any]) -> Any:
    check_csrf(state, token, request.headers.get(CSRF_HEADER))
    server = state.settings.server
    return parse_model(model, await read_json(request, server, max_bytes=MAX_BODY))


async def apply_budget(state: Runtime, actor: console.Actor, scope: Scope, subject_id: str,
                       change: console.BudgetChange) -> dict[str, Any]:
    """Write the policy (audited), make this replica see it at once, and answer it with its status."""
    out = await anyio.to_thread.run_sync(console.set_budget, state.session_factory, actor, scope, subject_id, change)
    state.budgets.budgets.policies.invalidate(out["subject"])
    status = await state.budgets.budgets.status(
        _Caller(out["tenant_id"], subject_id if scope == "key" else None))
    return {**out, "status": status.to_json()}


class _Caller:
    def __init__(self, tenant_id: str, key_id: str | None) -> None:
        self.tenant_id, self.key_id = tenant_id, key_id


@router.post("/tenants")
async def create_tenant(request: Request) -> Response:
    state, actor, token = writer(request)
    body: TenantCreate = await _body(request, state, token, TenantCreate)
    out = await anyio.to_thread.run_sync(
        lambda: console.create_tenant(state.session_factory, actor, body.name,
                                      allow_prompt_storage=body.allow_prompt_storage))
    return _json(out, 201)


@router.post("/tenants/{tenant_id}/keys")
async def create_key(request: Request, tenant_id: Identifier) -> Response:
    state, actor, token = writer(request)
    body: KeyCreate = await _body(request, state, token, KeyCreate)
    out, _raw = await anyio.to_thread.run_sync(console.create_key, state.session_factory, actor, tenant_id, body.name)
    return _json(out, 201)


@router.get("/tenants/{tenant_id}/keys")
async def list_keys(tenant_id: Identifier, days: int = Query(30, ge=1, le=366),
                    state: Runtime = Depends(admin_json)) -> Response:
    since = datetime.now(UTC) - timedelta(days=days)

    def read() -> list[aq.KeyRow]:
        with state.session_factory() as s:
            console.tenant_of(s, "tenant", tenant_id)
            return aq.keys_of_tenant(s, tenant_id, since)

    rows = await anyio.to_thread.run_sync(read)
    return _json({"object": "list", "data": [r.to_json() for r in rows]})


@router.put("/tenants/{tenant_id}/budget")
async def set_tenant_budget(request: Request, tenant_id: Identifier) -> Response:
    state, actor, token = writer(request)
    body: BudgetChangeIn = await _body(request, state, token, BudgetChangeIn)
    return _json(await apply_budget(state, actor, "tenant", tenant_id, body.change()))


@router.put("/keys/{key_id}/budget")
async def set_key_budget(request: Request, key_id: Identifier) -> Response:
    state, actor, token = writer(request)
    body: BudgetChangeIn = await _body(request, state, token, BudgetChangeIn)
    return _json(await apply_budget(state, actor, "key", key_id, body.change()))


@router.post("/alerts/{alert_id}/acknowledge")
async def acknowledge_alert(request: Request, alert_id: Identifier) -> Response:
    state, actor, token = writer(request)
    check_csrf(state, token, request.headers.get(CSRF_HEADER))
    return _json(await anyio.to_thread.run_sync(console.acknowledge_alert, state.session_factory, actor, alert_id))


def cancel_as_admin(state: Runtime, actor: console.Actor, batch_id: str) -> dict[str, Any]:
    """The batch API's cancel on any tenant's batch, audited (synchronous: run it in a thread)."""
    with state.session_factory() as session:
        return jobs_store.request_cancel(session, None, batch_id, jobs_store.utc_now(),
                                         on_cancel=console.batch_cancel_audit(actor))


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: Identifier) -> Response:
    state, actor, token = writer(request)
    check_csrf(state, token, request.headers.get(CSRF_HEADER))
    return _json(await anyio.to_thread.run_sync(cancel_as_admin, state, actor, batch_id))


def _cell(v: Any) -> Any:
    """A CSV cell that a spreadsheet will not run as a formula."""
    if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + v
    return str(v) if isinstance(v, Decimal) else v


def _csv(name: str, header: list[str], rows: list[tuple[Any, ...]]) -> Response:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows([_cell(c) for c in r] for r in rows)
    return Response(buf.getvalue(), media_type="text/csv; charset=utf-8",
                    headers={"Cache-Control": "no-store", "Content-Disposition": f'attachment; filename="{name}"'})


@router.get("/export/spend.csv")
async def export_spend(days: int = Query(30, ge=1, le=366), state: Runtime = Depends(admin_json)) -> Response:
    """Spend per tenant, day (UTC) and tier over the last ``days`` days."""
    until = datetime.now(UTC).date()
    since = until - timedelta(days=days - 1)

    def read() -> list[tuple[Any, ...]]:
        with state.session_factory() as s:
            return aq.spend_rows(s, since, until)

    rows = await anyio.to_thread.run_sync(read)
    return _csv(f"tiergate-spend-{since}-{until}.csv", ["day", "tenant_id", "tenant", "tier", "calls", "prompt_tokens",
                                                         "completion_tokens", "cost_usd", "baseline_cost_usd"], rows)


@router.get("/export/tenants/{tenant_id}/keys.csv")
async def export_keys(tenant_id: Identifier, days: int = Query(30, ge=1, le=366),
                      state: Runtime = Depends(admin_json)) -> Response:
    """One tenant's spend per key, day (UTC) and tier over the last ``days`` days (from the ledger)."""
    since = datetime.combine(datetime.now(UTC).date() - timedelta(days=days - 1), datetime.min.time(), UTC)

    def read() -> list[tuple[Any, ...]]:
        with state.session_factory() as s:
            console.tenant_of(s, "tenant", tenant_id)
            return aq.key_spend_rows(s, tenant_id, since)

    rows = await anyio.to_thread.run_sync(read)
    return _csv(f"tiergate-keys-{tenant_id}.csv", ["day", "key_id", "key", "tier", "calls", "cost_usd",
                                                   "baseline_cost_usd"], rows)


@router.get("/audit")
async def audit(tenant_id: Identifier | None = None, limit: int = Query(50, ge=1, le=500),
                state: Runtime = Depends(admin_json)) -> Response:
    def read() -> list[dict[str, Any]]:
        with state.session_factory() as s:
            return console.audit_log(s, tenant_id=tenant_id, limit=limit)

    return _json({"object": "list", "data": await anyio.to_thread.run_sync(read)})
