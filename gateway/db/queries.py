"""Named queries over the core tables: tenants, API keys, ledger totals. Every value goes
through bound parameters. Callers own the session and the transaction boundaries
(``with factory() as s, s.begin(): ...``). Imports only gateway.db.models.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.db.models import ApiKey, LedgerEntryRow, Tenant, utcnow

KEY_PREFIX_CHARS = 12


class RecordNotFound(LookupError):
    """No tenant / key matches the given id or name."""


def new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def create_tenant(session: Session, name: str, *, allow_prompt_storage: bool = False) -> Tenant:
    tenant = Tenant(id=new_id("ten"), name=name, allow_prompt_storage=allow_prompt_storage,
                    created_at=utcnow())
    session.add(tenant)
    session.flush()
    return tenant


def find_tenant(session: Session, id_or_name: str) -> Tenant:
    tenant = session.scalar(sa.select(Tenant).where(sa.or_(Tenant.id == id_or_name, Tenant.name == id_or_name)))
    if tenant is None:
        raise RecordNotFound(f"no tenant with id or name {id_or_name!r}")
    return tenant


def list_tenants(session: Session) -> Sequence[Tenant]:
    return session.scalars(sa.select(Tenant).order_by(Tenant.created_at, Tenant.name)).all()


def add_api_key(session: Session, tenant_id: str, raw_key: str, key_hash: str, name: str = "") -> ApiKey:
    """Store a key's hash and visible prefix (the raw key itself is never stored)."""
    key = ApiKey(id=new_id("key"), tenant_id=tenant_id, name=name, prefix=raw_key[:KEY_PREFIX_CHARS],
                 key_hash=key_hash, created_at=utcnow())
    session.add(key)
    session.flush()
    return key


def list_api_keys(session: Session, tenant_id: str | None = None) -> Sequence[ApiKey]:
    q = sa.select(ApiKey).order_by(ApiKey.created_at)
    if tenant_id is not None:
        q = q.where(ApiKey.tenant_id == tenant_id)
    return session.scalars(q).all()


def revoke_api_key(session: Session, key_id_or_prefix: str, *, at: datetime | None = None) -> ApiKey:
    """Mark a key revoked (by id, or by its visible prefix when that is unambiguous)."""
    keys = session.scalars(sa.select(ApiKey).where(
        sa.or_(ApiKey.id == key_id_or_prefix, ApiKey.prefix == key_id_or_prefix))).all()
    if not keys:
        raise RecordNotFound(f"no API key with id or prefix {key_id_or_prefix!r}")
    if len(keys) > 1:
        raise RecordNotFound(f"prefix {key_id_or_prefix!r} matches {len(keys)} keys; use the key id")
    key = keys[0]
    if key.revoked_at is None:
        key.revoked_at = at or utcnow()
    session.flush()
    return key


@dataclass(frozen=True)
class ActiveKey:
    key_id: str
    key_prefix: str
    key_hash: str
    tenant_id: str
    allow_prompt_storage: bool
    routing_exploration: float | None = None  # the tenant's routing settings (None: the config's)
    routing_target_quality: float | None = None
    routing_target_cost: float | None = None


def find_active_key(session: Session, key_hash: str) -> ActiveKey | None:
    """The unrevoked key with this hash and its tenant, or None."""
    row = session.execute(
        sa.select(ApiKey.id, ApiKey.prefix, ApiKey.key_hash, Tenant.id, Tenant.allow_prompt_storage,
                  Tenant.routing_exploration, Tenant.routing_target_quality, Tenant.routing_target_cost)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))).first()
    if row is None:
        return None
    return ActiveKey(row[0], row[1], row[2], row[3], bool(row[4]), row[5], row[6], row[7])


@dataclass(frozen=True)
class SpendTotals:
    """Sums of ledger or daily_spend rows; ``calls`` counts upstream calls (one request may make
    several)."""

    calls: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal
    baseline_cost_usd: Decimal

    @property
    def savings_usd(self) -> Decimal:
        return self.baseline_cost_usd - self.cost_usd

    @property
    def savings_ratio(self) -> float | None:
        """Share of the all-high cost saved; None when nothing was spent at all."""
        if self.baseline_cost_usd <= 0:
            return None
        return float(self.savings_usd / self.baseline_cost_usd)


def ledger_totals(session: Session, tenant_id: str | None = None) -> SpendTotals:
    """Sums over ledger rows (optionally one tenant); used by tests and the admin views."""
    q = sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(LedgerEntryRow.prompt_tokens), 0),
                  sa.func.coalesce(sa.func.sum(LedgerEntryRow.completion_tokens), 0),
                  sa.func.coalesce(sa.func.sum(LedgerEntryRow.cost_usd), 0),
                  sa.func.coalesce(sa.func.sum(LedgerEntryRow.baseline_cost_usd), 0))
    if tenant_id is not None:
        q = q.where(LedgerEntryRow.tenant_id == tenant_id)
    calls, prompt, completion, cost, baseline = session.execute(q).one()
    return SpendTotals(int(calls), int(prompt), int(completion), Decimal(str(cost)), Decimal(str(baseline)))
