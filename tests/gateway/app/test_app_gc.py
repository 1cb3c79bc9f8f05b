"""``create_app(freeze_heap=True)``, as ``tiergate serve`` builds the app: after startup the
heap is collected and frozen out of full garbage collections (which otherwise stop the event
loop, every in-flight request, ~100+ ms), requests still run and their garbage is still
collected, and shutdown hands the heap back. Without the flag the collector is left alone."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import yaml

from gateway.app import SWITCH_INTERVAL_S, create_app
from gateway.auth import KeyStore
from gateway.cli.serve import app_from_env
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from gateway.settings import settings_from_dict
from gateway.web.gc_pacing import BACKSTOP_GEN0, GEN0_THRESHOLD
from tests.gateway.gateway_harness import asgi_client, gateway, make_database
from tests.gateway.scripted_upstream import ScriptedUpstream, config_for

MSGS = [{"role": "user", "content": "hi"}]


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())  # the permanent (frozen) generation is not listed


@pytest.mark.parametrize("paced", [False, True])
async def test_freeze_heap_freezes_the_startup_heap_until_shutdown(tmp_path: Path, upstream: ScriptedUpstream,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   paced: bool) -> None:
    if paced:
        monkeypatch.setenv("TIERGATE_GC_INTERVAL_S", "1")
    else:
        monkeypatch.delenv("TIERGATE_GC_INTERVAL_S", raising=False)
    url, sf, _, raw = make_database(tmp_path)
    settings = settings_from_dict(config_for(upstream.base_url, db_url=url), base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf)), freeze_heap=True)
    before_startup = [object()]
    thresholds = gc.get_threshold()
    switch = sys.getswitchinterval()
    assert gc.get_freeze_count() == 0 and _tracked(before_startup)
    assert switch != SWITCH_INTERVAL_S
    try:
        async with asgi_client(app) as client:
            assert gc.get_freeze_count() > 0
            young = BACKSTOP_GEN0 if paced else GEN0_THRESHOLD  # paced by a clock (opt-in), else rarer
            assert gc.get_threshold() == (young, *thresholds[1:])
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)  # as a server process
            assert not _tracked(before_startup)  # a full collection no longer walks it
            r = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {raw}"},
                                  json={"model": "low", "messages": MSGS})
            assert r.status_code == 200, r.text
            node = _Node()
            gone = weakref.ref(node)
            del node
            gc.collect()
            assert gone() is None  # what requests leave behind is still collected
        assert gc.get_freeze_count() == 0 and _tracked(before_startup)
        assert gc.get_threshold() == thresholds
        assert sys.getswitchinterval() == switch  # restored at shutdown
    finally:
        ledger.stop()


async def test_without_freeze_heap_the_collector_is_left_alone(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    thresholds, switch = gc.get_threshold(), sys.getswitchinterval()
    async with gateway(tmp_path, upstream) as gw:
        assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
        assert sys.getswitchinterval() == switch
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={"model": "low", "messages": MSGS})
        assert r.status_code == 200, r.text


async def test_serve_builds_the_app_with_a_frozen_heap(tmp_path: Path, upstream: ScriptedUpstream,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    url, _, _, raw = make_database(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(config_for(upstream.base_url, db_url=url)))
    monkeypatch.setenv("TIERGATE_CONFIG", str(config))
    switch = sys.getswitchinterval()
    try:
        app = app_from_env()
        async with asgi_client(app) as client:
            assert gc.get_freeze_count() > 0
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
            r = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {raw}"},
                                  json={"model": "low", "messages": MSGS})
            assert r.status_code == 200, r.text
        assert gc.get_freeze_count() == 0
    finally:
        sys.setswitchinterval(switch)  # in case the app did not shut down
