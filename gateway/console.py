"""The operator's actions behind the admin console and the admin HTTP API, each audited.

Create a tenant; create an API key (its secret returned once, only its hash stored), revoke a
key; set, raise or clear a tenant's or a key's budget (hard and soft limit, period, RPM/TPM);
acknowledge a budget alert; cancel a batch (its audit row only: ``batch_cancel_audit`` rides in
the transaction of gateway.jobs.store.request_cancel, the batch API's own cancel). Each runs in one transaction that also writes one ``admin_audit``
row: who (``Actor``: the admin session or bearer, and the client address), what (action and
target) and the target's state before and after. A failed action writes nothing. Callers
(gateway.routes.admin_api) validate the input with pydantic first; the values are held to
gateway.budgets.bounds here too. Synchronous (call it in a worker thread). Imports budgets'
policy writer, the db layer, auth's key helpers and errors; never routes or the web framework.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from gateway.auth import generate_key, hash_key
from gateway.budgets import put_policy, subject_of
from gateway.budgets.bounds import PolicyValueError
from gateway.budgets.policies import Scope
from gateway.db.models import AdminAuditRow, ApiKey, Batch, BudgetAlertRow, BudgetPolicyRow, Tenant, utcnow
from gateway.db.queries import add_api_key, new_id
from gateway.db.queries import create_tenant as db_create_tenant
from gateway.errors import InvalidRequest, NotFound

Period = Literal["day", "week", "month", "total"]
Clearable = Literal["limit_usd", "soft_limit_usd", "alert_thresholds", "requests_per_min", "tokens_per_min"]


@dataclass(frozen=True)
class Actor:
    """Who acts: ``who`` ("session:<id>" for a console session, "bearer" for the admin key sent as a
    bearer token) from ``client`` (the client address)."""

    who: str
    client: str


@dataclass(frozen=True)
class BudgetChange:
    """A validated budget update: None fields keep their value; ``raise_by_usd`` adds to the current
    hard limit (which must exist); names in ``clear`` become unset."""

    period: Period | None = None
    limit_usd: Decimal | None = None
    soft_limit_usd: Decimal | None = None
    alert_thresholds: Sequence[float] | None = None
    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    raise_by_usd: Decimal | None = None
    clear: Sequence[Clearable] = ()


def _iso(ts: datetime | None) -> str | None:
    if ts is None:
        return None
    return (ts if ts.tzinfo else ts.replace(tzinfo=UTC)).isoformat()


def _num(value: Decimal | None) -> str | None:
    return None if value is None else format(Decimal(value).normalize(), "f")


def tenant_json(t: Tenant) -> dict[str, Any]:
    return {"id": t.id, "object": "tenant", "name": t.name, "created_at": _iso(t.created_at),
            "allow_prompt_storage": t.allow_prompt_storage}


def key_json(k: ApiKey) -> dict[str, Any]:
    return {"id": k.id, "object": "api_key", "tenant_id": k.tenant_id, "name": k.name, "prefix": k.prefix,
            "created_at": _iso(k.created_at), "revoked_at": _iso(k.revoked_at), "revoked": k.revoked_at is not None}


def policy_json(row: BudgetPolicyRow | None) -> dict[str, Any] | None:
    """A stored policy with amounts as exact decimal strings (None: no row)."""
    if row is None:
        return None
    return {"period": row.period, "limit_usd": _num(row.limit_usd), "soft_limit_usd": _num(row.soft_limit_usd),
            "alert_thresholds": row.alert_thresholds, "requests_per_min": row.requests_per_min,
            "tokens_per_min": row.tokens_per_min}


def alert_json(a: BudgetAlertRow) -> dict[str, Any]:
    return {"id": a.id, "subject": a.subject, "tenant_id": a.tenant_id, "period": a.period_key,
            "threshold": a.threshold_permille / 1000, "created_at": _iso(a.created_at),
            "delivered_at": _iso(a.delivered_at), "attempts": a.attempts,
            "acknowledged_at": _iso(a.acknowledged_at)}


def _audit(session: Session, actor: Actor, action: str, target: str, tenant_id: str | None,
           before: Any, after: Any) -> None:
    session.add(AdminAuditRow(id=new_id("aud"), created_at=utcnow(), actor=actor.who[:120],
                              client=actor.client[:80], action=action, target=target, tenant_id=tenant_id,
                              before=before, after=after))


def create_tenant(sf: sessionmaker[Session], actor: Actor, name: str, *,
                  allow_prompt_storage: bool = False) -> dict[str, Any]:
    try:
        with sf.begin() as s:
            if s.scalar(sa.select(Tenant.id).where(Tenant.name == name)) is not None:
                raise InvalidRequest(f"a tenant named {name!r} already exists", param="name", code="already_exists")
            t = db_create_tenant(s, name, allow_prompt_storage=allow_prompt_storage)
            body = tenant_json(t)
            _audit(s, actor, "tenant.create", f"tenant:{t.id}", t.id, None, body)
            return body
    except IntegrityError:  # a concurrent create of the same name
        raise InvalidRequest(f"a tenant named {name!r} already exists", param="name", code="already_exists") from None


def _tenant(s: Session, tenant_id: str) -> Tenant:
    t = s.get(Tenant, tenant_id)
    if t is None:
        raise NotFound(f"No tenant with id '{tenant_id}'.", param="tenant_id")
    return t


def create_key(sf: sessionmaker[Session], actor: Actor, tenant_id: str, name: str = "") -> tuple[dict[str, Any], str]:
    """A new key for the tenant: its JSON (with the secret under ``key``, shown this once) and the secret."""
    raw = generate_key()
    with sf.begin() as s:
        _tenant(s, tenant_id)
        k = add_api_key(s, tenant_id, raw, hash_key(raw), name)
        body = key_json(k)
        _audit(s, actor, "key.create", f"key:{k.id}", tenant_id, None, body)  # the audit never holds the secret
    return {**body, "key": raw}, raw


def revoke_key(sf: sessionmaker[Session], actor: Actor, key_id: str) -> tuple[dict[str, Any], str]:
    """Revoke (idempotent: a revoked key keeps its first revocation); the key's JSON and its hash."""
    with sf.begin() as s:
        k = s.get(ApiKey, key_id)
        if k is None:
            raise NotFound(f"No API key with id '{key_id}'.", param="key_id")
        before = key_json(k)
        if k.revoked_at is None:
            k.revoked_at = utcnow()
            s.flush()
            _audit(s, actor, "key.revoke", f"key:{k.id}", k.tenant_id, before, key_json(k))
        return key_json(k), k.key_hash


def tenant_of(s: Session, scope: Scope, subject_id: str) -> str:
    if scope == "tenant":
        return _tenant(s, subject_id).id
    k = s.get(ApiKey, subject_id)
    if k is None:
        raise NotFound(f"No API key with id '{subject_id}'.", param="key_id")
    return k.tenant_id


def set_budget(sf: sessionmaker[Session], actor: Actor, scope: Scope, subject_id: str,
               change: BudgetChange) -> dict[str, Any]:
    """Create or update a tenant's or key's policy; the stored policy after the change."""
    with sf.begin() as s:
        tenant_id = tenant_of(s, scope, subject_id)
        sid = subject_of(scope, subject_id)
        row = s.get(BudgetPolicyRow, sid)
        before = policy_json(row)
        limit = change.limit_usd
        if change.raise_by_usd is not None:
            current = None if row is None else row.limit_usd
            if current is None:
                raise InvalidRequest("there is no hard limit to raise; set limit_usd first", param="raise_by_usd")
            if limit is not None:
                raise InvalidRequest("give limit_usd or raise_by_usd, not both", param="raise_by_usd")
            limit = Decimal(current) + change.raise_by_usd
        try:
            row = put_policy(s, scope=scope, tenant_id=tenant_id, key_id=subject_id if scope == "key" else None,
                             period=change.period, limit_usd=limit, soft_limit_usd=change.soft_limit_usd,
                             alert_thresholds=change.alert_thresholds, requests_per_min=change.requests_per_min,
                             tokens_per_min=change.tokens_per_min, clear=list(change.clear))
        except PolicyValueError as err:
            raise InvalidRequest(str(err), param=err.param, code="invalid_value") from None
        except ValueError as err:
            raise InvalidRequest(str(err), code="invalid_value") from None
        s.flush()
        after = policy_json(row)
        action = "budget.raise" if change.raise_by_usd is not None else "budget.set"
        if change.clear and not any(v is not None for v in (change.period, limit, change.soft_limit_usd,
                                                          change.alert_thresholds, change.requests_per_min,
                                                          change.tokens_per_min)):
            action = "budget.clear"
        _audit(s, actor, action, sid, tenant_id, before, after)
        return {"subject": sid, "tenant_id": tenant_id, "policy": after}


def acknowledge_alert(sf: sessionmaker[Session], actor: Actor, alert_id: str) -> dict[str, Any]:
    """Mark an alert acknowledged (idempotent: the first acknowledgement stands)."""
    with sf.begin() as s:
        a = s.get(BudgetAlertRow, alert_id)
        if a is None:
            raise NotFound(f"No alert with id '{alert_id}'.", param="alert_id")
        if a.acknowledged_at is None:
            before = alert_json(a)
            a.acknowledged_at = utcnow()
            s.flush()
            _audit(s, actor, "alert.acknowledge", f"alert:{a.id}", a.tenant_id, before, alert_json(a))
        return alert_json(a)


def batch_cancel_audit(actor: Actor) -> Callable[[Session, Batch, Any, Any], None]:
    """The audit of a batch cancel, for gateway.jobs.store.request_cancel's ``on_cancel`` (it runs
    in the cancel's transaction): ``batch.cancel`` of ``batch:<id>``, before → after its status,
    request counts and lines by state."""
    def audit(session: Session, batch: Batch, before: Any, after: Any) -> None:
        _audit(session, actor, "batch.cancel", f"batch:{batch.id}", batch.tenant_id, before, after)
    return audit


_SHOWN_ON_CREATE = ("name", "prefix", "period", "limit_usd", "soft_limit_usd", "requests_per_min", "tokens_per_min")


def _short(v: Any) -> str:
    return "–" if v is None else str(v)


def change_summary(before: Any, after: Any) -> str:
    """An audit row's change for people: ``limit_usd: 5 → 7.5; period: month → day`` (only the
    fields that changed), or the main fields of what was created."""
    if not isinstance(after, dict):
        return ""
    if not isinstance(before, dict):
        return ", ".join(f"{k}={_short(after[k])}" for k in _SHOWN_ON_CREATE if after.get(k) not in (None, ""))
    return "; ".join(f"{k}: {_short(before.get(k))} → {_short(after.get(k))}" for k in after
                     if before.get(k) != after.get(k))


def audit_log(s: Session, *, tenant_id: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """The newest audit rows (one tenant's, or all), newest first; an index range scan."""
    q = sa.select(AdminAuditRow)
    if tenant_id is not None:
        q = q.where(AdminAuditRow.tenant_id == tenant_id)
    q = q.order_by(AdminAuditRow.created_at.desc(), AdminAuditRow.id.desc()).limit(max(1, min(limit, 500)))
    return [{"id": r.id, "created_at": _iso(r.created_at), "actor": r.actor, "client": r.client,
             "action": r.action, "target": r.target, "tenant_id": r.tenant_id, "before": r.before,
             "after": r.after, "change": change_summary(r.before, r.after)} for r in s.scalars(q)]
