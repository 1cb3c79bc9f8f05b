"""The console's forms: plain HTML form POSTs (no script needed) under ``/admin/actions``, each
over the same audited action as the admin HTTP API (gateway.console, validated by the same
pydantic models as gateway.routes.admin_api):

create a tenant; create a key (the secret is shown once, on the page that answers the POST, never
in a URL); revoke a key; set, raise or clear a tenant's or a key's budget; acknowledge an alert;
cancel a batch (gateway.jobs.store.request_cancel, the code path of ``POST /v1/batches/{id}/cancel``,
with the audit row in its transaction).

Each form carries the session's CSRF token (field ``csrf``) and must come from the console's
own origin; actions are throttled per client address (gateway.routes.admin_auth.writer). On
success the browser is sent back (303) to the page it came from (``back``: a path under
``/admin`` only); on failure a page states the error (OpenAI's message) with its status.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qs

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import RedirectResponse

from gateway import console
from gateway.errors import GatewayError
from gateway.ids import check_identifier
from gateway.routes.admin import _html
from gateway.routes.admin_api import BudgetChangeIn, KeyCreate, TenantCreate, apply_budget, cancel_as_admin
from gateway.routes.admin_auth import check_csrf, writer
from gateway.runtime import Runtime
from gateway.web.request_body import parse_model, read_body

router = APIRouter(prefix="/admin/actions")

MAX_FORM = 8 * 1024
_BACK = re.compile(r"^/admin(/tenants/[A-Za-z0-9_.:-]{1,64})?$")
_BUDGET_FIELDS = ("period", "limit_usd", "soft_limit_usd", "raise_by_usd", "requests_per_min", "tokens_per_min")


def _back(form: dict[str, list[str]]) -> str:
    back = (form.get("back") or ["/admin"])[0]
    return back if _BACK.match(back) else "/admin"


async def _form(request: Request, state: Runtime, token: str | None) -> dict[str, list[str]]:
    server = state.settings.server
    raw = await read_body(request, min(MAX_FORM, server.max_body_bytes), server.body_read_timeout_s)
    form = parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True)
    check_csrf(state, token, (form.get("csrf") or [""])[0])
    return form


def _one(form: dict[str, list[str]], name: str) -> str:
    return (form.get(name) or [""])[0].strip()


def _failed(err: GatewayError, back: str) -> Response:
    resp = _html("action_error.html", err.status, error=err.body()["error"], back=back)
    resp.headers.update(err.headers)
    return resp


async def _run(request: Request, act: Any) -> Response:
    """Authorise, read the form, run ``act(state, actor, form)`` (which returns a response or None
    for "go back"), answer errors as a page."""
    back = "/admin"
    try:
        state, actor, token = writer(request)
        form = await _form(request, state, token)
        back = _back(form)
        out = await act(state, actor, form)
    except GatewayError as err:
        return _failed(err, back)
    return out if out is not None else RedirectResponse(back, status_code=303)


@router.post("/tenants")
async def create_tenant(request: Request) -> Response:
    async def act(state: Runtime, actor: console.Actor, form: dict[str, list[str]]) -> Response | None:
        body = parse_model(TenantCreate, {"name": _one(form, "name"),
                                          "allow_prompt_storage": _one(form, "allow_prompt_storage") == "on"})
        await anyio.to_thread.run_sync(lambda: console.create_tenant(
            state.session_factory, actor, body.name, allow_prompt_storage=body.allow_prompt_storage))
        return None

    return await _run(request, act)


@router.post("/tenants/{tenant_id}/keys")
async def create_key(request: Request, tenant_id: str) -> Response:
    async def act(state: Runtime, actor: console.Actor, form: dict[str, list[str]]) -> Response | None:
        check_identifier(tenant_id, "tenant_id")
        body = parse_model(KeyCreate, {"name": _one(form, "name")})
        out, _raw = await anyio.to_thread.run_sync(console.create_key, state.session_factory, actor, tenant_id,
                                                   body.name)
        return _html("key_created.html", key=out, back=_back(form))

    return await _run(request, act)


@router.post("/keys/{key_id}/revoke")
async def revoke_key(request: Request, key_id: str) -> Response:
    async def act(state: Runtime, actor: console.Actor, form: dict[str, list[str]]) -> Response | None:
        check_identifier(key_id, "key_id")
        _body, key_hash = await anyio.to_thread.run_sync(console.revoke_key, state.session_factory, actor, key_id)
        state.keys.invalidate(key_hash)
        return None

    return await _run(request, act)


def _budget_change(form: dict[str, list[str]]) -> BudgetChangeIn:
    data: dict[str, Any] = {name: _one(form, name) for name in _BUDGET_FIELDS if _one(form, name)}
    data["clear"] = [c for c in form.get("clear", []) if c]
    return parse_model(BudgetChangeIn, data)


@router.post("/tenants/{tenant_id}/budget")
async def set_tenant_budget(request: Request, tenant_id: str) -> Response:
    async def act(state: Runtime, actor: console.Actor, form: dict[str, list[str]]) -> Response | None:
        check_identifier(tenant_id, "tenant_id")
        await apply_budget(state, actor, "tenant", tenant_id, _budget_change(form).change())
        return None

    return await _run(request, act)


@router.post("/keys/{key_id}/budget")
async def set_key_budget(request: Request, key_id: str) -> Response:
    async def act(state: Runtime, actor: console.Actor, form: dict[str, list[str]]) -> Response | None:
        check_identifier(key_id, "key_id")
        await apply_budget(state, actor, "key", key_id, _budget_change(form).change())
        return None

    return await _run(request, act)


@router.post("/alerts/{alert_id}/acknowledge")
async def acknowledge_alert(request: Request, alert_id: str) -> Response:
    async def act(state: Runtime, actor: console.Actor, form: dict[str, list[str]]) -> Response | None:
        check_identifier(alert_id, "alert_id")
        await anyio.to_thread.run_sync(console.acknowledge_alert, state.session_factory, actor, alert_id)
        return None

    return await _run(request, act)


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    async def act(state: Runtime, actor: console.Actor, form: dict[str, list[str]]) -> Response | None:
        check_identifier(batch_id, "batch_id")
        await anyio.to_thread.run_sync(cancel_as_admin, state, actor, batch_id)
        return None

    return await _run(request, act)

