"""The operator's provider key never leaves for an address a tenant chose.

For each provider type (``openai``, ``litellm`` — a real litellm call over HTTP — and ``local``),
every entry into the gateway (a model named directly, a named tier, ``auto``, a pipeline, JSON and
streamed, a batch line) is sent every smuggling route found against gateways of this kind:
``fallbacks`` (litellm merges each fallback over the call's kwargs, key included), URL/key/header
fields at any depth, and litellm's own keyword arguments — each once with the upstream answering
and once with the first upstream call failing (what makes litellm try a fallback). A listener on
another port stands for the attacker's server. It must see no connection at all; every request
the scripted upstream saw carries the configured key to the configured URL; and the ledger holds
exactly one row per HTTP call the upstream saw. With ``server.unknown_fields: drop`` the same
requests are answered (the fields are dropped) and the same must hold.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from gateway.settings import settings_from_dict
from tests.gateway.gateway_harness import Gateway, asgi_client, make_database
from tests.gateway.jobs_support import batch_config, create_batch, jsonl, line, upload, wait_final
from tests.gateway.scripted_upstream import UPSTREAM_KEY, UPSTREAM_KEY_ENV, Behaviour, ScriptedUpstream
from tests.gateway.tiny_local_model import write_tiny_model

pytestmark = pytest.mark.slow


class Listener:
    """The attacker's server: accepts connections on a loopback port and records what arrives."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.connections = 0
        self.received = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.settimeout(1)
            try:
                self.received += conn.recv(65536)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def evil() -> Iterator[Listener]:
    listener = Listener()
    yield listener
    listener.close()


def smuggling_routes(evil: str) -> dict[str, dict[str, Any]]:
    """Extra body fields, by name. Each is refused (400) or dropped; none may reach ``evil``."""
    text = {"role": "user", "content": "hi"}
    return {
        "fallbacks": {"fallbacks": [{"model": "openai/stolen", "api_base": evil, "api_key": "x"}]},
        "fallbacks_str": {"fallbacks": ["openai/stolen"], "api_base": evil},
        "api_base": {"api_base": evil},
        "base_url": {"base_url": evil},
        "api_key": {"api_key": "sk-tenant", "api_base": evil},
        "extra_headers": {"extra_headers": {"Host": "evil"}},
        "extra_body": {"extra_body": {"api_base": evil}},
        "litellm_params": {"litellm_params": {"api_base": evil, "model": "openai/stolen"}},
        "custom_llm_provider": {"custom_llm_provider": "openai", "api_base": evil},
        "context_window_fallback_dict": {"context_window_fallback_dict": {"x": "openai/stolen"}},
        "model_list": {"model_list": [{"model_name": "x", "litellm_params": {"api_base": evil}}]},
        "num_retries": {"num_retries": 5},
        "mock_response": {"mock_response": "pwned"},
        "proxy": {"proxy": evil},
        "user_config": {"user_config": {"model_list": [{"litellm_params": {"api_base": evil}}]}},
        "message.api_base": {"messages": [{**text, "api_base": evil}]},
        "content_part.api_base": {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi", "api_base": evil}]}]},
        "tool.api_base": {"tools": [{"type": "function", "function": {"name": "f", "api_base": evil}}]},
        "tiergate.api_base": {"tiergate": {"api_base": evil}},
        "stream_options.api_base": {"stream_options": {"include_usage": True, "api_base": evil}},
        # Accepted: the values are data, never settings (metadata is not forwarded at all; a JSON
        # schema is forwarded as the schema it is).
        "metadata.api_base": {"metadata": {"api_base": evil}},
        "schema.api_base": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "api_base": evil}}}},
    }


ACCEPTED = {"metadata.api_base", "schema.api_base"}  # valid requests whatever the mode
OPENAI_FEATURES = {"tool.api_base", "schema.api_base"}  # tools / JSON schema: the bundled engine has neither


def entries(model: str) -> dict[str, dict[str, Any]]:
    """Request bodies, without messages, for each way into the gateway."""
    return {
        "named model": {"model": model},
        "named tier, stream": {"model": "tier-low", "stream": True},
        "named tier": {"model": "medium"},
        "auto": {"model": "auto"},
        "auto, stream": {"model": "auto", "stream": True, "stream_options": {"include_usage": True}},
        "pipeline": {"model": "auto", "reasoning_effort": "high", "tiergate": {"pipeline": "on"}},
        "pipeline, stream": {"model": "auto", "reasoning_effort": "high", "stream": True,
                             "tiergate": {"pipeline": "on"}},
    }


@asynccontextmanager
async def provider_gateway(tmp_path: Path, upstream: ScriptedUpstream, provider: str,
                           unknown_fields: str) -> AsyncIterator[Gateway]:
    """A gateway whose every tier is one model of ``provider``'s type (batch jobs embedded)."""
    url, sf, tenant_id, raw = make_database(tmp_path)
    cfg = batch_config(upstream.base_url, url, unknown_fields=unknown_fields)
    cfg.update(_models_and_tiers(provider, upstream, tmp_path))
    settings = settings_from_dict(cfg, base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf)))
    try:
        async with asgi_client(app) as client:
            yield Gateway(app, client, settings, upstream, ledger, sf, tenant_id, raw)
    finally:
        ledger.stop()


def _models_and_tiers(provider: str, upstream: ScriptedUpstream, tmp_path: Path) -> dict[str, Any]:
    if provider == "openai":
        model = {"provider": "openai", "model": "upstream-a", "api_base": upstream.base_url}
    elif provider == "litellm":
        model = {"provider": "litellm", "model": "openai/upstream-ll", "api_base": upstream.base_url}
    else:
        model = {"provider": "local", "model": str(write_tiny_model(tmp_path / "tiny", max_positions=2048)),
                 "context_window": 2048}
    model = {"api_key_env": UPSTREAM_KEY_ENV, "max_retries": 0, "price": {"input": 1.0, "output": 2.0},
             **({"context_window": 8192} if provider != "local" else {}), **model}
    return {"models": {"m": model},
            "tiers": {t: {"model": "m", "max_output_tokens": 4} for t in
                      ("none", "minimal", "low", "medium", "high", "xhigh")},
            "pipeline": {"plan_fallback": "single_step", "max_review_rounds": 0, "max_steps": 1}}


def _with(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "hi"}], **base, **extra}
    if ("response_format" in extra or "tools" in extra) and (body.get("tiergate") or {}).get("pipeline") == "on":
        body.pop("tiergate")  # tool calls and structured answers are not composed by a pipeline
    if isinstance(extra.get("tiergate"), dict):
        body["tiergate"] = {**(base.get("tiergate") or {}), **extra["tiergate"]}
    if "stream_options" in extra and not body.get("stream"):
        body["stream"] = True
    return body


@pytest.mark.parametrize("unknown_fields", ["reject", "drop"])
@pytest.mark.parametrize("provider", ["openai", "litellm", "local"])
async def test_the_key_never_leaves_for_a_tenants_address(tmp_path: Path, upstream: ScriptedUpstream,
                                                          evil: Listener, provider: str,
                                                          unknown_fields: str) -> None:
    http = provider != "local"
    routes = smuggling_routes(evil.url)
    async with provider_gateway(tmp_path, upstream, provider, unknown_fields) as gw:
        for entry, base in entries("m").items():
            for name, extra in routes.items():
                refused = (unknown_fields == "reject" and name not in ACCEPTED) or (
                    not http and name in OPENAI_FEATURES)
                for failing_first in ((False, True) if http else (False,)):
                    if failing_first:
                        upstream.push(Behaviour(status=400))  # what sends litellm to its fallbacks
                    r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=_with(base, extra))
                    await r.aread()
                    upstream.clear()  # a refused request never used it
                    where = (entry, name, failing_first, r.status_code, r.text[:300])
                    if refused:
                        assert r.status_code == 400, where
                        assert r.json()["error"]["code"] == "unsupported_parameter", where
                    elif failing_first:
                        assert r.status_code in (200, 400), where  # the pipeline may stop early with a 200
                    else:
                        assert r.status_code == 200, where
        # Batch lines: one batch of every route (drop mode runs them all; reject mode refuses the
        # file at creation, naming the line, and runs the accepted ones).
        lines = [line(f"{i}", _with({"model": "auto"}, extra)) for i, extra in enumerate(routes.values())
                 if "stream_options" not in extra]
        accepted = [x for x, name in zip(lines, [n for n, e in routes.items() if "stream_options" not in e],
                                         strict=True) if unknown_fields == "drop" or name in ACCEPTED]
        if len(accepted) < len(lines):
            f = (await upload(gw.client, gw.auth, jsonl(lines))).json()
            r = await create_batch(gw.client, gw.auth, f["id"])
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_batch_line", r.text
        f = (await upload(gw.client, gw.auth, jsonl(accepted))).json()
        batch = await wait_final(gw.client, gw.auth, (await create_batch(gw.client, gw.auth, f["id"])).json()["id"])
        unsupported = 0 if http else sum(1 for x in accepted if "tools" in x["body"] or "response_format" in x["body"])
        assert batch["request_counts"]["completed"] == len(accepted) - unsupported, batch

        assert evil.connections == 0 and evil.received == b""
        assert UPSTREAM_KEY.encode() not in evil.received
        rows = gw.ledger_rows()
        if http:
            assert upstream.requests, "the upstream was never called"
            for seen in upstream.requests:  # the configured URL, with the configured key only
                assert seen.headers.get("Authorization") == f"Bearer {UPSTREAM_KEY}"
                assert "stolen" not in str(seen.body) and "fallbacks" not in seen.body
            assert len(rows) == len(upstream.requests)  # one ledger row per HTTP call
        else:
            assert upstream.requests == [] and rows
