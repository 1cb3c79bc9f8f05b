"""Fixtures shared by the gateway tests: the scripted OpenAI-compatible upstream.

Tests that also use the admin API put ``pytestmark = pytest.mark.usefixtures("admin_key")`` in their
module; tests that need a different set-up define their own ``upstream`` fixture, which overrides
this one in that module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.scripted_upstream import ADMIN_KEY, UPSTREAM_KEY, UPSTREAM_KEY_ENV, ScriptedUpstream


@pytest.fixture
def upstream(monkeypatch: pytest.MonkeyPatch) -> Iterator[ScriptedUpstream]:
    """A scripted upstream on a local port, its API key set in the environment."""
    monkeypatch.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    with ScriptedUpstream() as up:
        yield up


@pytest.fixture
def admin_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """``TIERGATE_ADMIN_KEY`` set to ``ADMIN_KEY`` for the gateways the test builds."""
    monkeypatch.setenv("TIERGATE_ADMIN_KEY", ADMIN_KEY)
    return ADMIN_KEY
