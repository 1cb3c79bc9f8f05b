"""Helpers for the batch-job tests (not a test module): a gateway with a ``jobs:`` section,
JSONL input files, and bounded polling of a batch until it is final."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from gateway.settings import settings_from_dict
from tests.gateway.gateway_harness import Gateway, asgi_client, make_database
from tests.gateway.scripted_upstream import ScriptedUpstream, config_for

FINAL = ("completed", "failed", "expired", "cancelled")


def batch_config(base_url: str, db_url: str, *, jobs: dict[str, Any] | None = None, **config: Any) -> dict[str, Any]:
    cfg = config_for(base_url, db_url=db_url, **config)
    cfg["jobs"] = {"poll_interval_s": 0.05, **(jobs or {})}
    return cfg


@asynccontextmanager
async def jobs_gateway(tmp_path: Path, upstream: ScriptedUpstream, *, jobs: dict[str, Any] | None = None,
                       **config: Any) -> AsyncIterator[Gateway]:
    url, sf, tenant_id, raw = make_database(tmp_path)
    settings = settings_from_dict(batch_config(upstream.base_url, url, jobs=jobs, **config), base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf)))
    try:
        async with asgi_client(app) as client:
            yield Gateway(app, client, settings, upstream, ledger, sf, tenant_id, raw)
    finally:
        ledger.stop()


def line(custom_id: str, body: dict[str, Any], *, url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list[Any]) -> bytes:
    return b"\n".join(orjson.dumps(x) if not isinstance(x, bytes) else x for x in lines) + b"\n"


async def upload(client: httpx.AsyncClient, auth: dict[str, str], content: bytes, *,
                 purpose: str = "batch") -> httpx.Response:
    return await client.post("/v1/files", headers=auth, files={"file": ("in.jsonl", content)},
                             data={"purpose": purpose})


async def create_batch(client: httpx.AsyncClient, auth: dict[str, str], file_id: str, **extra: Any) -> httpx.Response:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **extra}
    return await client.post("/v1/batches", headers=auth, json=body)


async def wait_final(client: httpx.AsyncClient, auth: dict[str, str], batch_id: str,
                     polls: int = 1500) -> dict[str, Any]:
    """The batch once final, polled every 20 ms (at most ``polls`` times)."""
    batch: dict[str, Any] = {}
    for _ in range(polls):
        batch = (await client.get(f"/v1/batches/{batch_id}", headers=auth)).json()
        if batch["status"] in FINAL:
            return batch
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch not final: {batch}")


async def file_lines(client: httpx.AsyncClient, auth: dict[str, str], file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    r = await client.get(f"/v1/files/{file_id}/content", headers=auth)
    assert r.status_code == 200, r.text
    return [orjson.loads(x) for x in r.content.splitlines() if x.strip()]
