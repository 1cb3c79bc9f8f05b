"""Celery task bodies: as thin as a web view — take an id, call the plain batch logic.
Imports jobs.backends and perceive; no Celery (celery_app registers these)."""

from __future__ import annotations

import asyncio

from gateway.jobs.backends import drain_batch
from gateway.resolve import DecideAuto
from gateway.settings import Settings


def load_decide_auto(settings: Settings) -> DecideAuto | None:
    """The classifier for ``model: "auto"`` (loaded once per worker process by the caller)."""
    from gateway.perceive import build_perceiver

    perceiver = build_perceiver(settings)
    return perceiver.decide if perceiver is not None else None


def run_batch(settings: Settings, batch_id: str, decide_auto: DecideAuto | None) -> None:
    """Run ``batch_id``'s lines in this worker until the batch is final."""
    asyncio.run(drain_batch(settings, batch_id, decide_auto=decide_auto))
