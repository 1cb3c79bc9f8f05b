"""Fixtures shared by the gateway tests: the scripted OpenAI-compatible upstream.

Tests that need a different set-up (e.g. an admin key in the environment as well) define their
own ``upstream`` fixture, which overrides this one in that module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.scripted_upstream import UPSTREAM_KEY, UPSTREAM_KEY_ENV, ScriptedUpstream


@pytest.fixture
def upstream(monkeypatch: pytest.MonkeyPatch) -> Iterator[ScriptedUpstream]:
    """A scripted upstream on a local port, its API key set in the environment."""
    monkeypatch.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    with ScriptedUpstream() as up:
        yield up
