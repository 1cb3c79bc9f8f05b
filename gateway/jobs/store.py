"""Batches and their lines in the database: create, claim, finish, cancel, finalize.

A line is claimed with an optimistic, fenced update (its ``attempts`` counter must still be what
the claimer read), so two runners — threads, processes or hosts — never run the same attempt; a
line whose lease ran out (its worker died, or its call is slower than the lease) is claimable
again. Each attempt runs under its own request id (``attempt_request_id``), so its ledger rows
and request record are its own. An attempt's ledger rows never pass through here: they go to the
ledger's journal as its calls finish (``gateway.jobs.capture``). ``finish_line`` is the
attempt's fenced result commit: the first attempt to finish a line that is still pending or
running makes it done with its result (``result_request_id`` names it); any other attempt's
request record is written as ``superseded`` and its result is not kept, so the output has
exactly one result per line. ``finalize_if_done`` writes the output and error files when no
line is left to run and moves the batch to its final status, once (OpenAI's shapes: an HTTP error
is the line's ``response`` with ``error: null``; only a never-run line has ``error``).
``extend_leases`` is the heartbeat of live attempts; ``chunk_ranges`` cuts a batch into the
line-number ranges Celery tasks run; ``note_waiting`` says why a batch has not started (no
worker, or the broker did not take it yet); ``gateway.jobs.progress`` has the operator's
read-only views.

Plain functions on a Session with an explicit ``now``; imports the jobs tables, files, the
ledger applier and errors. Knows nothing of FastAPI or Celery.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.db.models import Batch, BatchLine
from gateway.errors import InvalidRequest, NotFound
from gateway.ids import fast_id
from gateway.jobs.files import create_file, unix
from gateway.jobs.validate import ENDPOINTS, LineSpec
from gateway.ledger.applier import write_records
from gateway.ledger.entries import RequestRecord

ACTIVE = ("validating", "in_progress")
OPEN = (*ACTIVE, "cancelling")  # lines may still be running
FINAL = ("completed", "failed", "expired", "cancelled")
WINDOWS = {"24h": timedelta(hours=24)}
# The request status of an attempt whose line another attempt finished (or owns): its spend is
# billed like any request's (ledger rows, daily_spend, budgets), its result is not in the output.
SUPERSEDED = "superseded"


def attempt_request_id(line_request_id: str, attempt: int) -> str:
    """The request id an attempt runs (and is billed) under: the line's own for the first attempt,
    ``<line's>_a<n>`` for a retry."""
    return line_request_id if attempt == 1 else f"{line_request_id}_a{attempt}"


@dataclass(frozen=True)
class ClaimedLine:
    batch_id: str
    custom_id: str
    request_id: str  # this attempt's (attempt_request_id)
    attempt: int
    tenant_id: str
    key_id: str | None
    body: dict[str, Any]


@dataclass(frozen=True)
class LineOutcome:
    status_code: int
    body: dict[str, Any]  # the chat.completion, or the OpenAI error body
    error: dict[str, Any] | None = None  # {"code", "message"} when the line failed


def utc_now() -> datetime:
    return datetime.now(UTC)


def _aware(ts: datetime) -> datetime:
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def check_batch_params(endpoint: str, completion_window: str) -> None:
    if completion_window not in WINDOWS:
        raise InvalidRequest("completion_window must be '24h'", param="completion_window", code="invalid_value")
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint",
                             code="invalid_value")


def create_batch(session: Session, tenant_id: str, key_id: str | None, input_file_id: str, endpoint: str,
                 completion_window: str, metadata: dict[str, str] | None, lines: Sequence[LineSpec],
                 now: datetime) -> Batch:
    check_batch_params(endpoint, completion_window)
    hexid = fast_id()
    batch = Batch(id="batch_" + hexid, tenant_id=tenant_id, key_id=key_id, endpoint=endpoint,
                  input_file_id=input_file_id, completion_window=completion_window, status="validating",
                  meta=metadata, total=len(lines), created_at=now, expires_at=now + WINDOWS[completion_window])
    session.add(batch)
    session.flush()
    session.execute(sa.insert(BatchLine), [
        {"batch_id": batch.id, "custom_id": s.custom_id, "line_no": s.line_no,
         "request_id": f"batch_req_{hexid}_{s.line_no}", "body": s.body, "state": "pending", "attempts": 0}
        for s in lines])
    return batch


def get_batch(session: Session, tenant_id: str, batch_id: str) -> Batch:
    batch = session.get(Batch, batch_id)
    if batch is None or batch.tenant_id != tenant_id:
        raise NotFound(f"No such Batch object: {batch_id}", param="batch_id")
    return batch


def list_batches(session: Session, tenant_id: str, *, limit: int, after: str | None) -> list[Batch]:
    q = sa.select(Batch).where(Batch.tenant_id == tenant_id)
    if after is not None:
        cursor = session.get(Batch, after)
        if cursor is None or cursor.tenant_id != tenant_id:
            raise NotFound(f"No such Batch object: {after}", param="after")
        key, mark = sa.tuple_(Batch.created_at, Batch.id), sa.tuple_(cursor.created_at, cursor.id)
        q = q.where(key < mark)
    return list(session.scalars(q.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit)))


def line_counts(session: Session, batch_ids: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per batch: completed (done, 2xx) and failed (done with an error, or expired unrun) line
    counts. A cancelled line is neither (as OpenAI counts it): while a batch is ``cancelling`` and
    once it is ``cancelled``, ``completed + failed`` is what ran and ``total`` what was asked."""
    ok = sa.and_(BatchLine.state == "done", BatchLine.status_code == 200)
    failed = sa.or_(BatchLine.state == "expired",
                    sa.and_(BatchLine.state == "done", BatchLine.status_code != 200))
    q = (sa.select(BatchLine.batch_id, sa.func.count().filter(ok), sa.func.count().filter(failed))
         .where(BatchLine.batch_id.in_(batch_ids)).group_by(BatchLine.batch_id))
    return {b: {"completed": c, "failed": f} for b, c, f in session.execute(q)}


def batch_json(batch: Batch, counts: dict[str, int] | None) -> dict[str, Any]:
    counts = counts or {"completed": 0, "failed": 0}
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
        "status": batch.status, "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": unix(batch.created_at), "in_progress_at": unix(batch.in_progress_at),
        "expires_at": unix(batch.expires_at), "finalizing_at": unix(batch.finalizing_at),
        "completed_at": unix(batch.completed_at), "failed_at": unix(batch.failed_at),
        "expired_at": unix(batch.expired_at), "cancelling_at": unix(batch.cancelling_at),
        "cancelled_at": unix(batch.cancelled_at),
        "request_counts": {"total": batch.total, **counts}, "metadata": batch.meta}


LineRange = tuple[int, int]  # first and last ``line_no`` of a chunk, inclusive


def claim_lines(session: Session, *, now: datetime, lease_s: float, limit: int,
                batch_id: str | None = None, line_range: LineRange | None = None) -> list[ClaimedLine]:
    """Claim up to ``limit`` runnable lines (pending, or running with an expired lease) of active
    batches, oldest batch first (of ``batch_id``, and of its lines ``line_range`` when given);
    commits. Moves their batches from validating to in_progress (clearing a ``no_worker`` note)."""
    runnable = sa.or_(BatchLine.state == "pending",
                      sa.and_(BatchLine.state == "running", BatchLine.lease_until < now))
    q = (sa.select(BatchLine.batch_id, BatchLine.custom_id, BatchLine.request_id, BatchLine.attempts,
                   BatchLine.body, Batch.tenant_id, Batch.key_id)
         .join(Batch, Batch.id == BatchLine.batch_id)
         .where(Batch.status.in_(ACTIVE), runnable)
         .order_by(Batch.created_at, BatchLine.batch_id, BatchLine.line_no).limit(limit))
    if batch_id is not None:
        q = q.where(Batch.id == batch_id)
    if line_range is not None:
        q = q.where(BatchLine.line_no.between(*line_range))
    candidates = list(session.execute(q))
    claimed: list[ClaimedLine] = []
    lease_until = now + timedelta(seconds=lease_s)
    for b_id, custom_id, request_id, attempts, body, tenant_id, key_id in candidates:
        res = session.execute(
            sa.update(BatchLine)
            .where(BatchLine.batch_id == b_id, BatchLine.custom_id == custom_id,
                   BatchLine.attempts == attempts, runnable)
            .values(state="running", attempts=attempts + 1, lease_until=lease_until))
        if res.rowcount == 1:  # type: ignore[attr-defined]
            claimed.append(ClaimedLine(b_id, custom_id, attempt_request_id(request_id, attempts + 1),
                                       attempts + 1, tenant_id, key_id, body))
    started = {c.batch_id for c in claimed}
    if started:
        session.execute(sa.update(Batch).where(Batch.id.in_(started), Batch.status == "validating")
                        .values(status="in_progress", in_progress_at=now, errors=None))
    session.commit()
    return claimed


def extend_leases(session: Session, claims: Sequence[ClaimedLine], now: datetime, lease_s: float) -> int:
    """The heartbeat of live attempts: each claim's lease runs ``lease_s`` from ``now`` again, if
    the claim still owns its line (fenced on ``attempts``); commits. Returns the leases extended."""
    extended = 0
    for claim in claims:
        res = session.execute(_fenced(claim).values(lease_until=now + timedelta(seconds=lease_s)))
        extended += res.rowcount  # type: ignore[attr-defined]
    session.commit()
    return extended


def chunk_ranges(session: Session, batch_id: str, chunk_lines: int, *, runnable_at: datetime | None = None
                 ) -> list[LineRange]:
    """The batch's lines cut into chunks of ``chunk_lines`` (in line order), as line-number ranges:
    the unit of work of one Celery task. ``runnable_at``: only the chunks holding a line no one is
    running at that time (pending, or running with an expired lease)."""
    nos = list(session.scalars(sa.select(BatchLine.line_no).where(BatchLine.batch_id == batch_id)
                               .order_by(BatchLine.line_no)))
    ranges = [(chunk[0], chunk[-1]) for chunk in (nos[i:i + chunk_lines] for i in range(0, len(nos), chunk_lines))]
    if runnable_at is None:
        return ranges
    runnable = sa.or_(BatchLine.state == "pending",
                      sa.and_(BatchLine.state == "running", BatchLine.lease_until < runnable_at))
    live = set(session.scalars(sa.select(BatchLine.line_no).where(BatchLine.batch_id == batch_id, runnable)))
    return [r for r in ranges if any(r[0] <= no <= r[1] for no in live)]


def has_unsettled(session: Session, batch_id: str, line_range: LineRange | None = None) -> bool:
    """The batch is open and has a line (in ``line_range``) still pending or running."""
    status = session.scalar(sa.select(Batch.status).where(Batch.id == batch_id))
    if status not in OPEN:
        return False
    q = sa.select(BatchLine.line_no).where(BatchLine.batch_id == batch_id,
                                           BatchLine.state.in_(("pending", "running")))
    if line_range is not None:
        q = q.where(BatchLine.line_no.between(*line_range))
    return session.scalar(q.limit(1)) is not None


NO_WORKER = "no_worker"
QUEUE_UNAVAILABLE = "queue_unavailable"


def note_waiting(session: Session, batch_id: str, code: str, message: str) -> bool:
    """Say on a batch that has not started (``validating``) why it waits: one entry ``code``
    (``no_worker``: no worker consumes the queue; ``queue_unavailable``: the broker did not take
    its tasks yet) in its ``errors``; its status stays ``validating`` and the first line a worker
    claims clears the note. Commits; False when the batch had already started."""
    res = session.execute(sa.update(Batch).where(Batch.id == batch_id, Batch.status == "validating").values(
        errors=[{"code": code, "message": message, "param": None, "line": None}]))
    session.commit()
    return res.rowcount == 1  # type: ignore[no-any-return, attr-defined]


def note_no_worker(session: Session, batch_id: str, message: str) -> bool:
    """``note_waiting`` with ``no_worker``: no worker is there to run the batch."""
    return note_waiting(session, batch_id, NO_WORKER, message)


def _fenced(claim: ClaimedLine) -> Any:
    return sa.update(BatchLine).where(
        BatchLine.batch_id == claim.batch_id, BatchLine.custom_id == claim.custom_id,
        BatchLine.state == "running", BatchLine.attempts == claim.attempt)


def superseded(request: RequestRecord) -> RequestRecord:
    """``request`` with its status set to ``superseded``."""
    return dataclasses.replace(request, status=SUPERSEDED)


def finish_line(session: Session, claim: ClaimedLine, outcome: LineOutcome, request: RequestRecord | None,
                now: datetime) -> bool:
    """If the line is still pending or running (this is the first attempt to finish it), make it
    done with ``outcome``; write the attempt's request record; in the caller's transaction.
    False: another attempt finished the line (or it was cancelled or expired), so this one's
    request is written as ``superseded`` and its outcome is not kept. The attempt's ledger rows
    are not written here (they are in the ledger's journal already)."""
    res = session.execute(sa.update(BatchLine).where(
        BatchLine.batch_id == claim.batch_id, BatchLine.custom_id == claim.custom_id,
        BatchLine.state.in_(("pending", "running"))).values(
        state="done", lease_until=None, status_code=outcome.status_code, response=outcome.body,
        error=outcome.error, finished_at=now, result_request_id=claim.request_id))
    kept = res.rowcount == 1  # type: ignore[attr-defined]
    if request is not None:
        write_records(session, [request if kept else superseded(request)])
    return kept


def release_line(session: Session, claim: ClaimedLine, request: RequestRecord | None) -> None:
    """Give an interrupted attempt's line back (pending), with its request record if it wrote
    one; in the caller's transaction. A line another attempt owns is left alone, and this
    attempt's request is written as ``superseded``. (Its ledger rows are in the journal.)"""
    cancelling = sa.select(Batch.status).where(Batch.id == claim.batch_id).scalar_subquery() == "cancelling"
    state = sa.case((cancelling, "cancelled"), else_="pending")  # a cancelled batch starts no line again
    res = session.execute(_fenced(claim).values(state=state, lease_until=None))
    owned = res.rowcount == 1  # type: ignore[attr-defined]
    if request is not None:
        write_records(session, [request if owned else superseded(request)])


def cancel_batch(session: Session, batch: Batch, now: datetime) -> None:
    """Stop new lines: pending ones become cancelled; running ones finish. In the caller's transaction."""
    if batch.status not in ACTIVE:
        raise InvalidRequest(f"Cannot cancel a batch with status '{batch.status}'.", param="batch_id",
                             code="invalid_state")
    batch.status, batch.cancelling_at = "cancelling", now
    session.execute(sa.update(BatchLine).where(BatchLine.batch_id == batch.id, BatchLine.state == "pending")
                    .values(state="cancelled"))


def line_states(session: Session, batch_ids: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per batch: its lines by state (pending, running, done, cancelled, expired), zeros included."""
    out: dict[str, dict[str, int]] = {b: dict.fromkeys(("pending", "running", "done", "cancelled", "expired"), 0)
                                      for b in batch_ids}
    q = (sa.select(BatchLine.batch_id, BatchLine.state, sa.func.count()).where(BatchLine.batch_id.in_(batch_ids))
         .group_by(BatchLine.batch_id, BatchLine.state))
    for batch_id, state, n in session.execute(q):
        out[batch_id][state] = int(n)
    return out


def cancel_view(session: Session, batch: Batch) -> dict[str, Any]:
    """What a cancel changes, for an audit row: the status, OpenAI's request counts and the lines
    by state."""
    counts = line_counts(session, [batch.id]).get(batch.id) or {"completed": 0, "failed": 0}
    return {"status": batch.status, "total": batch.total, **counts, **line_states(session, [batch.id])[batch.id]}


CancelHook = Callable[[Session, Batch, dict[str, Any], dict[str, Any]], None]


def request_cancel(session: Session, tenant_id: str | None, batch_id: str, now: datetime, *,
                   on_cancel: CancelHook | None = None) -> dict[str, Any]:
    """``POST /v1/batches/{id}/cancel`` — one code path for the API, the admin console and the CLI:
    the batch (of ``tenant_id``; None: any tenant's, for the operator) goes to ``cancelling``, its
    pending lines to ``cancelled``, in one transaction in which ``on_cancel(session, batch, before,
    after)`` (``cancel_view``s) runs too (the console's audit row: a failed cancel writes
    nothing); then the batch is finalized if no line is left running (``cancelled``, with its
    output/error files). Returns the batch's JSON as the API answers it."""
    with session.begin():
        # locked (PostgreSQL): a finalizer's conditional status update waits for this cancel
        batch = session.get(Batch, batch_id, with_for_update=True)
        if batch is None or (tenant_id is not None and batch.tenant_id != tenant_id):
            raise NotFound(f"No such Batch object: {batch_id}", param="batch_id")
        before = cancel_view(session, batch) if on_cancel is not None else {}
        cancel_batch(session, batch, now)
        session.flush()
        if on_cancel is not None:
            on_cancel(session, batch, before, cancel_view(session, batch))
    finalize_if_done(session, batch_id, now)
    batch = session.get(Batch, batch_id)
    assert batch is not None  # batches are never deleted
    return batch_json(batch, line_counts(session, [batch_id]).get(batch_id))


def runnable_batch_ids(session: Session, now: datetime) -> list[str]:
    """Active batches with a line that no one is running: pending, or running with an expired lease."""
    runnable = sa.or_(BatchLine.state == "pending",
                      sa.and_(BatchLine.state == "running", BatchLine.lease_until < now))
    q = (sa.select(Batch.id).where(Batch.status.in_(ACTIVE), sa.exists().where(
        BatchLine.batch_id == Batch.id, runnable)).order_by(Batch.created_at, Batch.id))
    return list(session.scalars(q))


def open_batch_ids(session: Session) -> list[str]:
    return list(session.scalars(sa.select(Batch.id).where(Batch.status.in_(OPEN)).order_by(Batch.created_at)))


def _unsettled(session: Session, batch_id: str) -> int:
    return session.scalar(sa.select(sa.func.count()).select_from(BatchLine).where(
        BatchLine.batch_id == batch_id, BatchLine.state.in_(("pending", "running")))) or 0


def _result_line(line: BatchLine) -> bytes:
    response = None if line.status_code is None else {
        "status_code": line.status_code, "request_id": line.result_request_id or line.request_id,
        "body": line.response}
    if line.state == "cancelled":
        error: dict[str, Any] | None = {"code": "batch_cancelled", "message": "The batch was cancelled before "
                                        "this request ran."}
    elif line.state == "expired":
        error = {"code": "batch_expired", "message": "The batch expired before this request ran."}
    elif line.status_code is not None:
        error = None  # an HTTP error: OpenAI puts it in ``response`` (status and error body) only
    else:
        error = line.error
    return orjson.dumps({"id": line.request_id, "custom_id": line.custom_id, "response": response,
                         "error": error})


def finalize_if_done(session: Session, batch_id: str, now: datetime) -> str | None:
    """When no line of the batch is left to run (expiring pending lines of an overdue batch first),
    write its output / error files and set its final status; commits. Returns the final status,
    or None when lines remain or another finalizer got there first."""
    batch = session.get(Batch, batch_id)
    if batch is None or batch.status not in OPEN:
        return None
    if batch.status == "cancelling":  # a dead worker's attempt (lease run out) will not finish its line
        session.execute(sa.update(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.state == "running",
                                                   BatchLine.lease_until < now).values(state="cancelled"))
        session.commit()
    if batch.status in ACTIVE and now >= _aware(batch.expires_at):
        session.execute(sa.update(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.state == "pending")
                        .values(state="expired"))
        session.commit()
    if _unsettled(session, batch_id):
        session.rollback()
        return None
    seen = batch.status
    final = "cancelled" if seen == "cancelling" else "expired" if now >= _aware(batch.expires_at) else "completed"
    # Claim the finalization first (a write: serialises concurrent finalizers on SQLite too).
    res = session.execute(sa.update(Batch).where(Batch.id == batch_id, Batch.status == seen)
                          .values(status="finalizing", finalizing_at=now))
    if res.rowcount != 1 or _unsettled(session, batch_id):  # type: ignore[attr-defined]
        session.rollback()
        return None
    lines = list(session.scalars(sa.select(BatchLine).where(BatchLine.batch_id == batch_id)
                                 .order_by(BatchLine.line_no)))
    ok = [_result_line(x) for x in lines if x.state == "done" and x.status_code == 200]
    bad = [_result_line(x) for x in lines if not (x.state == "done" and x.status_code == 200)]
    values: dict[str, Any] = {"status": final, f"{final}_at": now}
    if ok:
        values["output_file_id"] = create_file(session, batch.tenant_id, f"{batch_id}_output.jsonl",
                                               "batch_output", b"\n".join(ok) + b"\n", now).id
    if bad:
        values["error_file_id"] = create_file(session, batch.tenant_id, f"{batch_id}_error.jsonl",
                                              "batch_output", b"\n".join(bad) + b"\n", now).id
    session.execute(sa.update(Batch).where(Batch.id == batch_id).values(**values))
    session.commit()
    return final

