"""Cancel a batch from the console (issue 15): the tenant page's batches list has a cancel form per
batch that still accepts one; the form (CSRF-checked) and ``POST /admin/api/batches/{id}/cancel``
run the batch API's own cancel (gateway.jobs.store.request_cancel) with an audit row in its
transaction; OpenAI's semantics follow: ``cancelling`` while a line runs, pending lines
``cancelled`` (neither completed nor failed), then ``cancelled`` with the counts of what ran."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.db.models import AdminAuditRow, Batch, BatchLine
from gateway.jobs import store
from gateway.jobs.files import create_file
from gateway.jobs.validate import LineSpec
from tests.gateway.admin.admin_support import ADMIN
from tests.gateway.gateway_harness import Gateway
from tests.gateway.jobs_support import jobs_gateway
from tests.gateway.scripted_upstream import ScriptedUpstream

BEARER = {"Authorization": f"Bearer {ADMIN}"}
pytestmark = pytest.mark.usefixtures("admin_key")


@asynccontextmanager
async def quiet_gateway(tmp_path: Path, upstream: ScriptedUpstream) -> AsyncIterator[Gateway]:
    """A gateway whose batch runner is stopped: the test plays the worker."""
    async with jobs_gateway(tmp_path, upstream) as gw:
        runner = gw.app.state.tiergate.jobs.runner
        assert runner is not None
        await runner.stop()
        yield gw


def make_batch(gw: Gateway, lines: int, *, running: int = 0) -> str:
    """A batch ``in_progress`` whose first ``running`` lines are leased to a (pretend) live worker."""
    now = store.utc_now()
    with gw.session_factory.begin() as s:
        f = create_file(s, gw.tenant_id, "in.jsonl", "batch", b"{}\n", now)
        specs = [LineSpec(i + 1, f"c{i}", {"model": "low", "messages": [{"role": "user", "content": "hi"}]})
                 for i in range(lines)]
        b = store.create_batch(s, gw.tenant_id, None, f.id, "/v1/chat/completions", "24h", None, specs, now)
        b.status, b.in_progress_at = "in_progress", now
        s.execute(sa.update(BatchLine).where(BatchLine.batch_id == b.id, BatchLine.line_no <= running)
                  .values(state="running", attempts=1, lease_until=now + timedelta(minutes=5)))
        return b.id


async def session_csrf(gw: Gateway) -> str:
    assert (await gw.client.post("/admin/login", data={"admin_key": ADMIN})).status_code == 303
    page = (await gw.client.get(f"/admin/tenants/{gw.tenant_id}")).text
    m = re.search(r'name="csrf" value="([^"]+)"', page)
    assert m
    return m.group(1)


def states(gw: Gateway, batch_id: str) -> dict[str, int]:
    with gw.session_factory() as s:
        return dict(s.execute(sa.select(BatchLine.state, sa.func.count()).where(BatchLine.batch_id == batch_id)
                              .group_by(BatchLine.state)).tuples().all())


def audits(gw: Gateway) -> list[AdminAuditRow]:
    with gw.session_factory() as s:
        return list(s.scalars(sa.select(AdminAuditRow).where(AdminAuditRow.action == "batch.cancel")
                              .order_by(AdminAuditRow.created_at)))


async def test_console_form_cancels_a_running_batch_as_the_api_does(tmp_path: Path,
                                                                    upstream: ScriptedUpstream) -> None:
    async with quiet_gateway(tmp_path, upstream) as gw:
        batch_id = make_batch(gw, 6, running=2)
        csrf = await session_csrf(gw)
        back = f"/admin/tenants/{gw.tenant_id}"
        page = (await gw.client.get(back)).text
        assert f'action="/admin/actions/batches/{batch_id}/cancel"' in page  # a cancel form per active batch

        url = f"/admin/actions/batches/{batch_id}/cancel"
        r = await gw.client.post(url, data={"back": back})
        assert r.status_code == 403 and states(gw, batch_id) == {"running": 2, "pending": 4}  # no CSRF token
        r = await gw.client.post(url, data={"csrf": csrf, "back": back})
        assert r.status_code == 303 and r.headers["location"] == back

        assert states(gw, batch_id) == {"running": 2, "cancelled": 4}  # lines not run are cancelled
        got = (await gw.client.get(f"/v1/batches/{batch_id}", headers=gw.auth)).json()
        assert got["status"] == "cancelling" and got["cancelling_at"] and got["cancelled_at"] is None
        assert got["request_counts"] == {"total": 6, "completed": 0, "failed": 0}  # cancelled: neither
        page = (await gw.client.get(back)).text
        row = page[page.index(f'data-batch="{batch_id}"'):]
        row = row[:row.index("</tr>")]
        assert "cancelling" in row and "(2 running)" in row and "/cancel" not in row  # no second cancel form
        [audit] = audits(gw)
        assert audit.actor.startswith("session:") and audit.target == f"batch:{batch_id}"
        assert audit.tenant_id == gw.tenant_id
        before, after = audit.before or {}, audit.after or {}
        assert before["status"] == "in_progress" and after["status"] == "cancelling"
        assert (before["pending"], after["pending"]) == (4, 0) and (before["cancelled"], after["cancelled"]) == (0, 4)

        r = await gw.client.post(url, data={"csrf": csrf, "back": back})  # cancelling: refused, not audited
        assert r.status_code == 400 and "Cannot cancel a batch with status" in r.text
        assert len(audits(gw)) == 1

        # the two running lines finish (one answered 200, one an HTTP error): the batch is cancelled
        with gw.session_factory.begin() as s:
            s.execute(sa.update(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.line_no == 1)
                      .values(state="done", status_code=200, response={"id": "x"}, lease_until=None))
            s.execute(sa.update(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.line_no == 2)
                      .values(state="done", status_code=500, response={"error": {}}, lease_until=None))
        with gw.session_factory() as s:
            assert store.finalize_if_done(s, batch_id, store.utc_now()) == "cancelled"
        got = (await gw.client.get(f"/v1/batches/{batch_id}", headers=gw.auth)).json()
        assert got["status"] == "cancelled" and got["cancelled_at"]
        assert got["request_counts"] == {"total": 6, "completed": 1, "failed": 1}
        assert got["output_file_id"] and got["error_file_id"]


async def test_admin_api_cancels_any_tenants_batch_audited(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with quiet_gateway(tmp_path, upstream) as gw:
        batch_id = make_batch(gw, 3)  # nothing running: cancelled at once
        assert (await gw.client.post(f"/admin/api/batches/{batch_id}/cancel", headers=gw.auth)).status_code == 401
        r = await gw.client.post(f"/admin/api/batches/{batch_id}/cancel", headers=BEARER)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "batch" and body["status"] == "cancelled"
        assert body["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
        assert body == (await gw.client.get(f"/v1/batches/{batch_id}", headers=gw.auth)).json()
        with gw.session_factory() as s:
            assert s.get(Batch, batch_id).status == "cancelled"  # type: ignore[union-attr]
        assert states(gw, batch_id) == {"cancelled": 3}
        [audit] = audits(gw)
        after = audit.after or {}
        assert audit.actor == "bearer" and after["status"] == "cancelling" and after["cancelled"] == 3
        api = (await gw.client.get(f"/admin/api/audit?tenant_id={gw.tenant_id}", headers=BEARER)).json()["data"]
        assert api[0]["action"] == "batch.cancel" and "status: in_progress → cancelling" in api[0]["change"]

        r = await gw.client.post(f"/admin/api/batches/{batch_id}/cancel", headers=BEARER)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_state"
        r = await gw.client.post("/admin/api/batches/batch_nope/cancel", headers=BEARER)
        assert r.status_code == 404 and r.json()["error"]["param"] == "batch_id"
        assert len(audits(gw)) == 1  # refused cancels write nothing


async def test_tenant_api_cancel_still_scoped_to_its_tenant(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    from gateway.auth import generate_key, hash_key
    from gateway.db.queries import add_api_key, create_tenant

    async with quiet_gateway(tmp_path, upstream) as gw:
        batch_id = make_batch(gw, 2)
        with gw.session_factory.begin() as s:
            other = create_tenant(s, "other")
            raw = generate_key()
            add_api_key(s, other.id, raw, hash_key(raw))
        r = await gw.client.post(f"/v1/batches/{batch_id}/cancel", headers={"Authorization": f"Bearer {raw}"})
        assert r.status_code == 404 and states(gw, batch_id) == {"pending": 2}
        r = await gw.client.post(f"/v1/batches/{batch_id}/cancel", headers=gw.auth)
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        assert audits(gw) == []  # a tenant's own cancel is not an admin action
