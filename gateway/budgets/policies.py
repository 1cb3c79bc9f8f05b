"""Budget and rate-limit policies per tenant and per API key, with a TTL cache.

A tenant without a row gets ``settings.budgets`` defaults; a key without a row has no
key-level budget (only its tenant's applies). Admin writes go through ``put_policy``
and become visible to other replicas within the cache TTL (immediately on the replica
that wrote, which calls ``invalidate``). Must not import routes, the app or the pipeline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal, Protocol, cast

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from gateway.budgets import bounds
from gateway.budgets.periods import PERIOD_NAMES, PeriodName
from gateway.db.models import BudgetPolicyRow
from gateway.errors import ServiceUnavailable
from gateway.money import fraction_of, usd_number, usd_to_nanos
from gateway.settings import BudgetDefaults

Scope = Literal["tenant", "key"]


class PrincipalLike(Protocol):
    """What budgets need from an authenticated caller (gateway.auth.Principal fits)."""

    @property
    def tenant_id(self) -> str: ...

    @property
    def key_id(self) -> str | None: ...


def subject_of(scope: Scope, subject_id: str) -> str:
    return f"{scope}:{subject_id}"


@dataclass(frozen=True)
class BudgetPolicy:
    subject: str
    scope: Scope
    tenant_id: str
    key_id: str | None
    period: PeriodName = "month"
    limit_nanos: int | None = None
    soft_limit_nanos: int | None = None
    alert_thresholds: tuple[float, ...] = ()
    requests_per_min: int | None = None
    tokens_per_min: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "subject": self.subject, "scope": self.scope, "tenant_id": self.tenant_id, "key_id": self.key_id,
            "period": self.period,
            "limit_usd": None if self.limit_nanos is None else usd_number(self.limit_nanos),
            "soft_limit_usd": None if self.soft_limit_nanos is None else usd_number(self.soft_limit_nanos),
            "alert_thresholds": list(self.alert_thresholds),
            "requests_per_min": self.requests_per_min, "tokens_per_min": self.tokens_per_min,
        }


def effective_policy(row: BudgetPolicyRow, defaults: BudgetDefaults) -> BudgetPolicy:
    """The policy a gateway enforces for ``row``: a soft limit left unset is
    ``budgets.soft_limit_fraction`` of the hard one, unset alert thresholds are the defaults."""
    return _row_to_policy(row, defaults)


def _row_to_policy(row: BudgetPolicyRow, defaults: BudgetDefaults) -> BudgetPolicy:
    limit = None if row.limit_usd is None else usd_to_nanos(row.limit_usd)
    soft = None if row.soft_limit_usd is None else usd_to_nanos(row.soft_limit_usd)
    if soft is None and limit is not None:
        soft = fraction_of(limit, defaults.soft_limit_fraction)
    thresholds = tuple(row.alert_thresholds) if row.alert_thresholds is not None else defaults.alert_thresholds
    return BudgetPolicy(subject=row.id, scope=cast(Scope, row.scope), tenant_id=row.tenant_id,
                        key_id=row.key_id, period=cast(PeriodName, row.period), limit_nanos=limit,
                        soft_limit_nanos=soft, alert_thresholds=thresholds,
                        requests_per_min=row.requests_per_min, tokens_per_min=row.tokens_per_min)


def default_tenant_policy(tenant_id: str, defaults: BudgetDefaults) -> BudgetPolicy:
    limit = None if defaults.limit_usd is None else usd_to_nanos(defaults.limit_usd)
    return BudgetPolicy(
        subject=subject_of("tenant", tenant_id), scope="tenant", tenant_id=tenant_id, key_id=None,
        period=defaults.period, limit_nanos=limit,
        soft_limit_nanos=None if limit is None else fraction_of(limit, defaults.soft_limit_fraction),
        alert_thresholds=defaults.alert_thresholds,
        requests_per_min=defaults.requests_per_min,
        tokens_per_min=defaults.tokens_per_min)


def put_policy(session: Session, *, scope: Scope, tenant_id: str, key_id: str | None = None,
               period: PeriodName | None = None, limit_usd: float | Decimal | str | None = None,
               soft_limit_usd: float | Decimal | str | None = None,
               alert_thresholds: Sequence[float] | None = None, requests_per_min: int | None = None,
               tokens_per_min: int | None = None, clear: Sequence[str] = ()) -> BudgetPolicyRow:
    """Create or update one policy row. Fields left None keep their value; names in
    ``clear`` are set to NULL (e.g. ``clear=("limit_usd",)`` removes the hard limit). Every
    value is held to gateway.budgets.bounds (``PolicyValueError``, a ValueError naming the
    param), and so is the row that results (a soft limit above the hard one is refused)."""
    if scope == "key" and not key_id:
        raise ValueError("a key-scoped budget needs key_id")
    if period is not None and period not in PERIOD_NAMES:
        raise bounds.PolicyValueError(f"period must be one of {', '.join(PERIOD_NAMES)}", "period")
    updates: dict[str, Any] = {
        "period": period, "limit_usd": bounds.usd("limit_usd", limit_usd),
        "soft_limit_usd": bounds.usd("soft_limit_usd", soft_limit_usd),
        "alert_thresholds": bounds.thresholds(alert_thresholds),
        "requests_per_min": bounds.per_minute("requests_per_min", requests_per_min, bounds.MAX_REQUESTS_PER_MIN),
        "tokens_per_min": bounds.per_minute("tokens_per_min", tokens_per_min, bounds.MAX_TOKENS_PER_MIN),
    }
    for name in clear:
        if name not in updates or name == "period":
            raise bounds.PolicyValueError(f"cannot clear {name!r}", "clear")
    sid = subject_of(scope, key_id if scope == "key" else tenant_id)  # type: ignore[arg-type]
    row = session.get(BudgetPolicyRow, sid)
    if row is None:
        row = BudgetPolicyRow(id=sid, scope=scope, tenant_id=tenant_id, key_id=key_id, period=period or "month")
        session.add(row)
    for name, value in updates.items():
        if value is not None:
            setattr(row, name, value)
    for name in clear:
        setattr(row, name, None)
    bounds.consistent(row.limit_usd, row.soft_limit_usd)
    row.updated_at = datetime.now(UTC)
    return row


def tenant_policies(session: Session, defaults: BudgetDefaults) -> list[BudgetPolicy]:
    """Every stored tenant-level policy, read in one query (the admin overview's budget column)."""
    rows = session.scalars(select(BudgetPolicyRow).where(BudgetPolicyRow.scope == "tenant"))
    return [_row_to_policy(row, defaults) for row in rows]


def get_policy_rows(session: Session, tenant_id: str) -> list[BudgetPolicyRow]:
    return list(session.scalars(select(BudgetPolicyRow).where(BudgetPolicyRow.tenant_id == tenant_id)
                                .order_by(BudgetPolicyRow.id)))


_MAX_DEFAULT_POLICIES = 10_000


class PolicyStore:
    """Cached lookups of the policies that apply to a caller (tenant's, then key's)."""

    def __init__(self, session_factory: sessionmaker[Session] | None, defaults: BudgetDefaults, *,
                 ttl_s: float = 5.0, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._sf = session_factory
        self._defaults = defaults
        self._ttl = ttl_s
        self._mono = monotonic
        self._cache: dict[str, tuple[float, BudgetPolicy | None]] = {}
        self._overrides: dict[str, BudgetPolicy] = {}
        self._loading: dict[str, asyncio.Future[BudgetPolicy | None]] = {}
        # The defaults' policy of tenants without a row, built once per tenant (it depends only on
        # the tenant id and ``defaults``): the chat path asks for a caller's policies ~4 times.
        self._default_policies: dict[str, BudgetPolicy] = {}

    @property
    def defaults(self) -> BudgetDefaults:
        return self._defaults

    def set_override(self, policy: BudgetPolicy) -> None:
        """In-memory policy (tests, DB-less embedding); wins over the database."""
        self._overrides[policy.subject] = policy

    def invalidate(self, subject: str | None = None) -> None:
        if subject is None:
            self._cache.clear()
        else:
            self._cache.pop(subject, None)

    async def for_principal(self, principal: PrincipalLike) -> list[BudgetPolicy]:
        tenant = await self._get(subject_of("tenant", principal.tenant_id))
        if tenant is None:
            tenant = self._default_policy(principal.tenant_id)
        policies = [tenant]
        if principal.key_id:
            key = await self._get(subject_of("key", principal.key_id))
            if key is not None:
                policies.append(replace(key, tenant_id=principal.tenant_id))
        return policies

    def _default_policy(self, tenant_id: str) -> BudgetPolicy:
        policy = self._default_policies.get(tenant_id)
        if policy is None:
            if len(self._default_policies) >= _MAX_DEFAULT_POLICIES:
                self._default_policies.clear()
            policy = self._default_policies[tenant_id] = default_tenant_policy(tenant_id, self._defaults)
        return policy

    async def _get(self, subject: str) -> BudgetPolicy | None:
        if subject in self._overrides:
            return self._overrides[subject]
        hit = self._cache.get(subject)
        now = self._mono()
        if hit is not None and now - hit[0] < self._ttl:
            return hit[1]
        if self._sf is None:
            return None
        task = self._loading.get(subject)
        if task is None:  # concurrent misses for one subject share a single DB read
            task = self._loading[subject] = asyncio.ensure_future(asyncio.to_thread(self._load, subject))
            task.add_done_callback(lambda _t: self._loading.pop(subject, None))
        try:
            policy = await asyncio.shield(task)
        except DBAPIError as exc:  # the database is unreachable: the last policy read, however old
            if hit is not None:
                return hit[1]
            raise ServiceUnavailable("Budgets cannot be read right now (the database is unreachable). "
                                     "Retry later.", retry_after_s=5) from exc
        self._cache[subject] = (now, policy)
        return policy

    def _load(self, subject: str) -> BudgetPolicy | None:
        assert self._sf is not None
        with self._sf() as session:
            row = session.get(BudgetPolicyRow, subject)
            return None if row is None else _row_to_policy(row, self._defaults)
