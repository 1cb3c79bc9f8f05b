"""``consumers``: whether any worker takes a queue's tasks, on the two broker kinds, with no
worker running (the no-worker note of a new batch rests on it; the two-worker case is in
test_jobs_celery_fanout)."""

from __future__ import annotations

import uuid

import pytest
from celery import Celery

from gateway.jobs.celery_app import consumers, make_celery
from gateway.settings import settings_from_dict
from tests.gateway.scripted_upstream import config_for


def _celery(monkeypatch: pytest.MonkeyPatch, broker: str) -> Celery:
    monkeypatch.setenv("TIERGATE_BROKER_URL", broker)
    cfg = config_for("http://127.0.0.1:9/v1")
    cfg["jobs"] = {"backend": "celery"}
    return make_celery(settings_from_dict(cfg))


def test_no_consumer_on_rabbitmq(rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    celery = _celery(monkeypatch, rabbitmq_url)
    try:
        assert consumers(celery, f"tiergate-test-{uuid.uuid4().hex[:12]}") == 0
    finally:
        celery.close()


def test_no_consumer_on_redis(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    celery = _celery(monkeypatch, redis_url)
    try:
        assert consumers(celery, f"tiergate-test-{uuid.uuid4().hex[:12]}", timeout_s=0.5) == 0
    finally:
        celery.close()
