"""The ledger's journal on a disk that fills up: a real, tiny tmpfs mounted by the test (root
only; skipped elsewhere), filled with a file until write(2) fails with ENOSPC.

While the journal cannot be written, new chat requests are refused with a 503
``service_unavailable`` (OpenAI's error shape, ``retry-after``) before any upstream call — no
unbilled work starts — and ``/readyz`` says the ledger is unhealthy. When space returns, the
journal's retried write succeeds and requests are served again; every upstream call has exactly
one ledger row and no intent is left open (the refused calls' intents were voided)."""

from __future__ import annotations

import asyncio
import errno
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.db.models import LedgerIntentRow
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from gateway.settings import settings_from_dict
from tests.gateway.gateway_harness import Gateway, asgi_client, make_database
from tests.gateway.scripted_upstream import ScriptedUpstream, config_for

pytestmark = [pytest.mark.process, pytest.mark.slow]

BODY = {"model": "low", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs of the test's own."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


class Filler:
    """Another writer that keeps the file system full: it grows its file until write(2) fails
    with ENOSPC and takes whatever else frees space within a millisecond, until stopped and its
    file removed. (The journal's own deletions of sealed, committed segments are held by the test
    while the disk is to stay full: their pages would go straight back to the journal's next
    write in the same thread, before this thread could take them.)"""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stop = threading.Event()
        self._full = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        chunk = b"\0" * 4096
        with self.path.open("ab", buffering=0) as f:
            while not self._stop.is_set():
                try:
                    f.write(chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    self._full.set()
                    time.sleep(0.001)

    def start(self) -> None:
        self._thread.start()
        assert self._full.wait(10)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.path.unlink()


@asynccontextmanager
async def _gateway(tmp_path: Path, journal: Path, upstream: ScriptedUpstream) -> AsyncIterator[Gateway]:
    url, sf, tenant_id, raw = make_database(tmp_path)
    settings = settings_from_dict(config_for(upstream.base_url, db_url=url), base_dir=tmp_path)
    ledger = Ledger(sf, journal, flush_interval_ms=5, retry_max_s=0.3)
    ledger.start()
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf)))
    try:
        async with asgi_client(app) as client:
            yield Gateway(app, client, settings, upstream, ledger, sf, tenant_id, raw)
    finally:
        ledger.stop()


async def test_a_full_journal_disk_refuses_new_work_and_recovers(tmp_path: Path, tiny_fs: Path,
                                                                 upstream: ScriptedUpstream) -> None:
    async with _gateway(tmp_path, tiny_fs / "journal", upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=BODY)
        assert r.status_code == 200, r.text

        filler = Filler(tiny_fs / "filler")
        filler.start()
        # The disk stays full: the journal's own sealed, committed segments are not deleted until
        # space returns. Deleted, their pages went back to the journal before the filler could take
        # them (the journal thread seals, deletes and writes the next segment in one go), so its
        # retried writes went through and no request was ever refused (seen in CI, twice).
        held: list[int] = []
        delete = gw.ledger.segments._delete
        gw.ledger.segments._delete = held.append
        # The journal's current segment may still have room in its last page: requests are served
        # until a journal write fails. A request whose call was made but whose rows then cannot be
        # journaled is a 503 too (its rows stay queued and are billed when space returns); from
        # then on every new request, streamed or not, is refused before its upstream call.
        refused = 0
        for _ in range(300):
            before = len(upstream.requests)
            r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                     json={**BODY, "stream": refused % 2 == 1})
            if r.status_code == 200 and refused == 0:
                continue
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("server_error", "service_unavailable")
            assert int(r.headers["retry-after"]) >= 1
            if len(upstream.requests) == before:  # refused before its call: no unbilled work
                refused += 1
                if refused == 4:
                    break
            else:
                assert refused == 0  # only a request already under way when the disk filled
        assert refused == 4
        ready = await gw.client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["ledger"] is False

        filler.stop()  # space returns: the journal's retried write goes through
        gw.ledger.segments._delete = delete
        for seq in held:
            delete(seq)
        for _ in range(100):  # 100 polls of 50 ms at most
            r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=BODY)
            if r.status_code == 200:
                break
            assert r.status_code == 503, r.text
            await asyncio.sleep(0.05)
        assert r.status_code == 200, r.text
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={**BODY, "stream": True})
        assert r.status_code == 200, r.text
        assert (await gw.client.get("/readyz")).status_code == 200

        rows = gw.ledger_rows()
        assert len(rows) == len(upstream.requests) and all(row.status == "ok" for row in rows)
        with gw.session_factory() as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(LedgerIntentRow)) == 0  # refused: voided
