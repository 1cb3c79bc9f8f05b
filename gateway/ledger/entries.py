"""The ledger's plain data: one ``LedgerEntry`` per upstream call, one ``RequestRecord`` per
client request, and their JSON journal encoding. Money is integer nano-USD (``cost_nanos``,
``baseline_cost_nanos``); journal lines carry the same integers, which are what this version
reads. Lines of the older format (float ``cost_usd`` / ``baseline_cost_usd`` only, found in
journals written before the upgrade) are converted exactly as that format's writer stored them
(``gateway.money.legacy_usd_to_nanos``). Ledger-entry lines also carry the float fields, never
read back when the integers are present: a rollback to the older version, which reads only
those, still replays the billing rows of a journal this version left behind.
``to_json`` gives each record's journal fields with ``created_at`` as the datetime itself: the
journal's encoder (orjson) writes it exactly as ``datetime.isoformat()`` does, in C (an
``isoformat()`` call was ~2.5 us of the event loop's time per record).
Imports only providers.base (Usage), gateway.money and gateway.ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from gateway.ids import fast_id
from gateway.money import legacy_usd_to_nanos, usd_number
from gateway.providers.base import Usage

Stage = Literal["direct", "perceive", "plan", "execute", "review"]
CallStatus = Literal["ok", "error", "cancelled", "interrupted"]
# A call settled from its intent after its process died mid-call (see ``CallIntent``).
INTERRUPTED = "interrupted"
# Request statuses: ok | error | cancelled | budget_denied | rate_limited | in_progress ...
IN_PROGRESS = "in_progress"


def new_entry_id() -> str:
    return fast_id()


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _dt(value: str) -> datetime:
    dt = datetime.fromisoformat(value)
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def _nanos(d: dict[str, Any], name: str) -> int:
    """``<name>_nanos`` of a journal line, or its older float ``<name>_usd`` converted; a line
    with neither is malformed (KeyError: the journal reader counts it as a corrupt line)."""
    if f"{name}_nanos" in d:
        value = d[f"{name}_nanos"]
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name}_nanos must be an integer")
        return value
    return legacy_usd_to_nanos(float(d[f"{name}_usd"]))


@dataclass(frozen=True)
class LedgerEntry:
    """One upstream call. ``id`` is chosen by the caller (``new_entry_id()``), so recording the
    same entry twice (journal replay, a retried write) never double-counts."""

    id: str
    request_id: str
    tenant_id: str
    key_id: str | None
    stage: str
    tier: str
    model: str
    usage: Usage
    cost_nanos: int
    baseline_cost_nanos: int
    status: str = "ok"
    created_at: datetime = field(default_factory=_utcnow)

    def to_json(self) -> dict[str, Any]:
        u = self.usage
        return {"t": "e", "id": self.id, "request_id": self.request_id, "tenant_id": self.tenant_id,
                "key_id": self.key_id, "stage": self.stage, "tier": self.tier, "model": self.model,
                "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                "completion_tokens": u.completion_tokens, "reasoning_tokens": u.reasoning_tokens,
                "cost_nanos": self.cost_nanos, "baseline_cost_nanos": self.baseline_cost_nanos,
                "cost_usd": usd_number(self.cost_nanos), "baseline_cost_usd": usd_number(self.baseline_cost_nanos),
                "status": self.status, "created_at": self.created_at}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LedgerEntry:
        return cls(id=d["id"], request_id=d["request_id"], tenant_id=d["tenant_id"], key_id=d["key_id"],
                   stage=d["stage"], tier=d["tier"], model=d["model"],
                   usage=Usage(prompt_tokens=d["prompt_tokens"], completion_tokens=d["completion_tokens"],
                               cached_tokens=d["cached_tokens"], reasoning_tokens=d["reasoning_tokens"]),
                   cost_nanos=_nanos(d, "cost"), baseline_cost_nanos=_nanos(d, "baseline_cost"),
                   status=d["status"], created_at=_dt(d["created_at"]))


@dataclass(frozen=True)
class RequestRecord:
    """One client request (the ``requests`` table). Recording it again with the same ``id``
    overwrites the earlier record, except that an ``in_progress`` record never overwrites a
    final one."""

    id: str
    tenant_id: str
    key_id: str | None
    requested_model: str
    status: str
    tier: str | None = None
    effort_source: str | None = None
    classifier_score: float | None = None
    classifier_version: str | None = None
    pipeline: bool = False
    http_status: int | None = None
    error_code: str | None = None
    latency_ms: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_nanos: int = 0
    baseline_cost_nanos: int = 0
    created_at: datetime = field(default_factory=_utcnow)

    def to_json(self) -> dict[str, Any]:
        return {"t": "r", "id": self.id, "tenant_id": self.tenant_id, "key_id": self.key_id,
                "requested_model": self.requested_model, "status": self.status, "tier": self.tier,
                "effort_source": self.effort_source, "classifier_score": self.classifier_score,
                "classifier_version": self.classifier_version, "pipeline": self.pipeline,
                "http_status": self.http_status, "error_code": self.error_code,
                "latency_ms": self.latency_ms, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cost_nanos": self.cost_nanos,
                "baseline_cost_nanos": self.baseline_cost_nanos, "created_at": self.created_at}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        fields = {k: v for k, v in d.items() if k not in _REQUEST_NOT_FIELDS}
        return cls(**fields, cost_nanos=_nanos(d, "cost"), baseline_cost_nanos=_nanos(d, "baseline_cost"),
                   created_at=_dt(d["created_at"]))


_REQUEST_NOT_FIELDS = frozenset({"t", "created_at", "cost_nanos", "baseline_cost_nanos", "cost_usd",
                                 "baseline_cost_usd"})


@dataclass(frozen=True)
class CallIntent:
    """An upstream call about to start, journaled (and written with write(2)) before its first
    byte goes upstream. ``id`` is the call id: the call's ``LedgerEntry`` has the same id and
    supersedes the intent (the applier deletes it in the transaction that inserts the row). An
    intent left by a process that died is settled as an ``interrupted`` row at the ``estimate_*``
    or the ``reserved_*`` cost (``ledger.interrupted_billing``), priced when the call started.
    ``owner`` names the ledger process that journaled it (set by ``Ledger.begin``)."""

    id: str
    request_id: str
    tenant_id: str
    key_id: str | None
    stage: str
    tier: str
    model: str
    prompt_tokens: int
    max_output_tokens: int
    estimate_output_tokens: int
    price: dict[str, float | None]  # USD per 1M tokens: input, cached_input, output
    estimate_cost_nanos: int
    estimate_baseline_nanos: int
    reserved_cost_nanos: int
    reserved_baseline_nanos: int
    owner: str = ""
    created_at: datetime = field(default_factory=_utcnow)

    def to_json(self) -> dict[str, Any]:
        return {"t": "i", "id": self.id, "request_id": self.request_id, "tenant_id": self.tenant_id,
                "key_id": self.key_id, "stage": self.stage, "tier": self.tier, "model": self.model,
                "prompt_tokens": self.prompt_tokens, "max_output_tokens": self.max_output_tokens,
                "estimate_output_tokens": self.estimate_output_tokens, "price": self.price,
                "estimate_cost_nanos": self.estimate_cost_nanos,
                "estimate_baseline_nanos": self.estimate_baseline_nanos,
                "reserved_cost_nanos": self.reserved_cost_nanos,
                "reserved_baseline_nanos": self.reserved_baseline_nanos, "owner": self.owner,
                "created_at": self.created_at}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CallIntent:
        ints = ("prompt_tokens", "max_output_tokens", "estimate_output_tokens", "estimate_cost_nanos",
                "estimate_baseline_nanos", "reserved_cost_nanos", "reserved_baseline_nanos")
        for name in ints:
            if not isinstance(d[name], int) or isinstance(d[name], bool):
                raise TypeError(f"{name} must be an integer")
        return cls(id=d["id"], request_id=d["request_id"], tenant_id=d["tenant_id"], key_id=d["key_id"],
                   stage=d["stage"], tier=d["tier"], model=d["model"], price=dict(d["price"]),
                   owner=d["owner"], created_at=_dt(d["created_at"]), **{n: d[n] for n in ints})

    def interrupted_entry(self, policy: Literal["estimate", "reserved"]) -> LedgerEntry:
        """The ``interrupted`` ledger row that settles this intent under ``policy``."""
        reserved = policy == "reserved"
        out = self.max_output_tokens if reserved else self.estimate_output_tokens
        return LedgerEntry(id=self.id, request_id=self.request_id, tenant_id=self.tenant_id, key_id=self.key_id,
                           stage=self.stage, tier=self.tier, model=self.model,
                           usage=Usage(prompt_tokens=self.prompt_tokens, completion_tokens=out),
                           cost_nanos=self.reserved_cost_nanos if reserved else self.estimate_cost_nanos,
                           baseline_cost_nanos=self.reserved_baseline_nanos if reserved else self.estimate_baseline_nanos,
                           status=INTERRUPTED, created_at=self.created_at)


@dataclass(frozen=True)
class IntentVoid:
    """The call of intent ``id`` never started (its intent could not be confirmed written, so
    the call was refused): the intent is dropped, nothing is billed."""

    id: str

    def to_json(self) -> dict[str, Any]:
        return {"t": "v", "id": self.id}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> IntentVoid:
        if not isinstance(d["id"], str):
            raise TypeError("id must be a string")
        return cls(id=d["id"])


Record = LedgerEntry | RequestRecord | CallIntent | IntentVoid


def record_from_json(d: dict[str, Any]) -> Record:
    kind = d.get("t")
    if kind == "e":
        return LedgerEntry.from_json(d)
    if kind == "r":
        return RequestRecord.from_json(d)
    if kind == "i":
        return CallIntent.from_json(d)
    if kind == "v":
        return IntentVoid.from_json(d)
    raise ValueError(f"unknown journal record kind {kind!r}")
