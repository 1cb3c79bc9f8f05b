"""``BatchWork``: running batch lines through the live chat flow, exactly once each.

A claimed line runs as a request of the batch creator's tenant and key through the same
``ChatFlow`` as ``POST /v1/chat/completions`` (tier routing including ``model: "auto"``, budget
reserve/settle, one ledger row per upstream call), under the attempt's request id
``batch_req_<batch hex>_<line no>`` (``_a<n>`` appended for retries, so ledger rows name their
batch and attempt). The flow's ledger is an ``AttemptLedger``: each upstream call's row goes to
the real ledger's journal as the call finishes, as a live request's does, and is written there
(survives kill -9) before the line's result commits; the result commit (``store.finish_line``,
fenced: the first attempt to finish keeps the line) carries only the attempt's request record,
with its final status. A line the budget refuses fails with the 429 body; the batch goes on. A
line interrupted by shutdown is handed back (pending) with what it spent billed; a worker killed
mid-line leaves a lease that expires, and the line runs again, its killed attempt's calls billed
from the journal. An attempt still running when its lease expired is billed when it ends, as a
``superseded`` request if another attempt finished the line first (the budgets, which settled
its call live, then agree with the ledger).

Used by the embedded runner and the Celery task alike; knows nothing of FastAPI or Celery.
Imports chat_flow, errors, the jobs store and capture.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker

from gateway.chat.flow import ChatFlow
from gateway.errors import GatewayError
from gateway.jobs import progress as views
from gateway.jobs import store
from gateway.jobs.capture import AttemptLedger
from gateway.jobs.store import ClaimedLine, LineOutcome, utc_now
from gateway.routing import NO_PREFS, RoutingPrefs

log = logging.getLogger("tiergate.jobs")
T = TypeVar("T")


@dataclass(frozen=True)
class LinePrincipal:
    """The batch creator, as the chat flow sees a caller."""

    tenant_id: str
    key_id: str | None
    allow_prompt_storage: bool = False
    routing: RoutingPrefs = NO_PREFS


class BatchWork:
    def __init__(self, flow: ChatFlow, capture: AttemptLedger, session_factory: sessionmaker[Session], *,
                 lease_s: float, clock: Callable[[], datetime] = utc_now) -> None:
        self.flow, self.capture, self.session_factory = flow, capture, session_factory
        self.lease_s, self.clock = lease_s, clock

    async def _db(self, fn: Callable[[Session], T]) -> T:
        def run() -> T:
            with self.session_factory() as session:
                return fn(session)
        return await asyncio.to_thread(run)

    async def claim(self, limit: int, batch_id: str | None = None,
                    line_range: store.LineRange | None = None) -> list[ClaimedLine]:
        now = self.clock()
        return await self._db(lambda s: store.claim_lines(s, now=now, lease_s=self.lease_s, limit=limit,
                                                          batch_id=batch_id, line_range=line_range))

    async def heartbeat(self, claims: list[ClaimedLine]) -> int:
        """Extend the leases of these live attempts (a dead worker's run out: its lines run again)."""
        now = self.clock()
        return await self._db(lambda s: store.extend_leases(s, claims, now, self.lease_s))

    async def _answer(self, claim: ClaimedLine) -> LineOutcome:
        try:
            req, _ = await self.flow.prepare(LinePrincipal(claim.tenant_id, claim.key_id), claim.body,
                                             request_id=claim.request_id)
            outcome = await self.flow.complete(req)
            response = outcome.response
            if outcome.spend.model:  # the model that answered (OpenAI's output bodies name it), not "auto"
                response["model"] = outcome.spend.model
            return LineOutcome(200, response)
        except GatewayError as err:
            return LineOutcome(err.status, err.body(), {"code": err.code, "message": err.message})
        except Exception as err:  # recorded by the flow as a 500; the line fails, its spend is billed
            log.error("batch line %s failed: %s", claim.request_id, type(err).__name__)
            body = {"error": {"message": "The server had an error while processing this request.",
                              "type": "server_error", "param": None, "code": "internal_error"}}
            return LineOutcome(500, body, {"code": "internal_error", "message": body["error"]["message"]})

    async def run_line(self, claim: ClaimedLine) -> None:
        """Run one claimed line: its call rows go to the ledger's journal as the calls finish
        and are written there before the line commits its outcome, unless another attempt
        finished the line first (then this one's request is recorded as superseded). Cancelled
        (shutdown): the line goes back to pending, what it spent is billed. Ledger and database
        errors propagate (the line keeps its lease and is retried when it expires)."""
        try:
            outcome = await self._answer(claim)
        except asyncio.CancelledError:
            request = self.capture.take_request(claim.request_id)
            await asyncio.shield(self._settle(store.release_line, claim, request))
            raise
        request = self.capture.take_request(claim.request_id)
        now = self.clock()
        kept = await asyncio.shield(self._settle(store.finish_line, claim, outcome, request, now))
        if not kept:
            log.warning("batch line %s: another attempt finished the line first; this one is billed as "
                        "superseded, its result dropped", claim.request_id)

    async def _settle(self, write: Callable[..., T], *args: Any) -> T:
        """The attempt's call rows written to the journal first (a kill -9 after this loses none),
        then its fenced line update and request record, in one transaction."""
        await self.capture.wait_durable()
        return await self._db(lambda s: _commit(s, write, *args))

    async def release(self, claim: ClaimedLine) -> None:
        """Hand a claimed line back unrun."""
        await self._db(lambda s: _commit(s, store.release_line, claim, None))

    async def finalize(self, batch_id: str) -> str | None:
        now = self.clock()
        return await self._db(lambda s: store.finalize_if_done(s, batch_id, now))

    async def sweep(self) -> list[str]:
        """Finalize every open batch that has nothing left to run (expiring overdue ones)."""
        done = []
        for batch_id in await self._db(store.open_batch_ids):
            if await self.finalize(batch_id):
                done.append(batch_id)
        return done

    async def is_open(self, batch_id: str) -> bool:
        def check(s: Session) -> bool:
            batch = s.get(store.Batch, batch_id)
            return batch is not None and batch.status in store.OPEN
        return await self._db(check)

    async def has_unsettled(self, batch_id: str, line_range: store.LineRange | None = None) -> bool:
        return await self._db(lambda s: store.has_unsettled(s, batch_id, line_range))

    async def progress(self, batch_id: str) -> dict[str, int]:
        return await self._db(lambda s: views.progress(s, batch_id))


def _commit(session: Session, write: Callable[..., T], *args: Any) -> T:
    with session.begin():
        return write(session, *args)
