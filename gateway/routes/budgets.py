"""Admin API for budgets and rate limits per tenant and per API key.

``GET|PUT /admin/budgets/tenants/{tenant_id}`` and ``GET|PUT /admin/budgets/keys/{key_id}``:
read a policy with its live status (spent, held, remaining, soft-limit state) or create /
update it; ``GET /admin/budgets/tenants/{tenant_id}/alerts``: the tenant's recorded threshold
alerts (newest first) for the dashboard. Protected by the admin key: ``Authorization: Bearer
<value of the environment variable named by server.admin_key_env>`` (gateway.routes.admin_auth:
checked before the body is read, wrong keys throttled per client address); when that variable is
unset every call is refused. Values are bounded (gateway.budgets.bounds); every write is audited
(gateway.console, ``admin_audit``). Uses the
``BudgetRuntime`` of the process's ``Runtime``.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Literal

import anyio
import orjson
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from gateway import console
from gateway.budgets import BudgetRuntime, subject_of
from gateway.budgets.alerts import recent_alerts
from gateway.budgets.policies import Scope
from gateway.db.models import ApiKey, BudgetPolicyRow, Tenant
from gateway.errors import NotFound
from gateway.ids import Identifier
from gateway.routes.admin_auth import client_address, require_admin
from gateway.runtime import Runtime
from gateway.web.request_body import read_model

router = APIRouter(prefix="/admin/budgets")


class BudgetUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    period: Literal["day", "week", "month", "total"] | None = None
    limit_usd: Decimal | None = Field(None, ge=0)
    soft_limit_usd: Decimal | None = Field(None, ge=0)
    alert_thresholds: list[float] | None = None
    requests_per_min: int | None = Field(None, gt=0)
    tokens_per_min: int | None = Field(None, gt=0)
    clear: list[Literal["limit_usd", "soft_limit_usd", "alert_thresholds", "requests_per_min",
                        "tokens_per_min"]] = []


def _runtime(state: Runtime) -> BudgetRuntime:
    return state.budgets


class _Caller:
    def __init__(self, tenant_id: str, key_id: str | None) -> None:
        self.tenant_id, self.key_id = tenant_id, key_id


def _tenant_of(state: Runtime, scope: Scope, subject_id: str) -> str:
    with state.session_factory() as session:
        if scope == "tenant":
            if session.get(Tenant, subject_id) is None:
                raise NotFound(f"no tenant {subject_id!r}")
            return subject_id
        key = session.get(ApiKey, subject_id)
        if key is None:
            raise NotFound(f"no API key {subject_id!r}")
        return key.tenant_id


def _policy_json(state: Runtime, scope: Scope, subject_id: str) -> dict[str, Any] | None:
    with state.session_factory() as session:
        row = session.get(BudgetPolicyRow, subject_of(scope, subject_id))
        if row is None:
            return None
        return {"period": row.period, "limit_usd": _num(row.limit_usd), "soft_limit_usd": _num(row.soft_limit_usd),
                "alert_thresholds": row.alert_thresholds, "requests_per_min": row.requests_per_min,
                "tokens_per_min": row.tokens_per_min, "updated_at": row.updated_at.isoformat()}


def _num(value: Decimal | None) -> float | None:
    return None if value is None else float(value)


async def _show(state: Runtime, scope: Scope, subject_id: str) -> Response:
    rt = _runtime(state)
    tenant_id = await anyio.to_thread.run_sync(_tenant_of, state, scope, subject_id)
    policy = await anyio.to_thread.run_sync(_policy_json, state, scope, subject_id)
    status = await rt.budgets.status(_Caller(tenant_id, subject_id if scope == "key" else None))
    body = {"subject": subject_of(scope, subject_id), "tenant_id": tenant_id, "policy": policy,
            "status": status.to_json()}
    return Response(orjson.dumps(body), media_type="application/json")


async def _update(request: Request, state: Runtime, scope: Scope, subject_id: str, update: BudgetUpdate) -> Response:
    """Write through the audited console action (actor: the bearer admin key)."""
    change = console.BudgetChange(period=update.period, limit_usd=update.limit_usd,
                                  soft_limit_usd=update.soft_limit_usd, alert_thresholds=update.alert_thresholds,
                                  requests_per_min=update.requests_per_min, tokens_per_min=update.tokens_per_min,
                                  clear=tuple(update.clear))
    out = await anyio.to_thread.run_sync(console.set_budget, state.session_factory,
                                         console.Actor("bearer", client_address(request)), scope, subject_id, change)
    _runtime(state).budgets.policies.invalidate(out["subject"])
    return await _show(state, scope, subject_id)


MAX_UPDATE_BYTES = 16 * 1024


async def _read_update(request: Request, state: Runtime) -> BudgetUpdate:
    return await read_model(request, state.settings.server, BudgetUpdate, max_bytes=MAX_UPDATE_BYTES)


@router.get("/tenants/{tenant_id}")
async def show_tenant(tenant_id: Identifier, state: Runtime = Depends(require_admin)) -> Response:
    return await _show(state, "tenant", tenant_id)


@router.put("/tenants/{tenant_id}")
async def set_tenant(request: Request, tenant_id: Identifier, state: Runtime = Depends(require_admin)) -> Response:
    return await _update(request, state, "tenant", tenant_id, await _read_update(request, state))


@router.get("/keys/{key_id}")
async def show_key(key_id: Identifier, state: Runtime = Depends(require_admin)) -> Response:
    return await _show(state, "key", key_id)


@router.put("/keys/{key_id}")
async def set_key(request: Request, key_id: Identifier, state: Runtime = Depends(require_admin)) -> Response:
    return await _update(request, state, "key", key_id, await _read_update(request, state))


@router.get("/tenants/{tenant_id}/alerts")
async def tenant_alerts(tenant_id: Identifier, state: Runtime = Depends(require_admin)) -> Response:
    await anyio.to_thread.run_sync(_tenant_of, state, "tenant", tenant_id)  # an unknown tenant is 404

    def read() -> list[dict[str, Any]]:
        with state.session_factory() as session:
            return recent_alerts(session, tenant_id)

    return Response(orjson.dumps({"data": await anyio.to_thread.run_sync(read)}), media_type="application/json")
