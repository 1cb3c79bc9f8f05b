"""Shared fixtures: real PostgreSQL / Redis where the machine has them.

Marked tests skip when the service is unreachable, except under CI (CI=true), where a
missing service is a failure: CI's machine runs them and must not silently skip.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PG_URL = os.environ.get("TIERGATE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TIERGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ_URL = os.environ.get("TIERGATE_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _reachable(url: str, default_port: int) -> bool:
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or default_port), timeout=1):
            return True
    except OSError:
        return False


def _unavailable(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is not reachable under CI; .ci/run should have started it")
    pytest.skip(f"{what} not reachable")


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    if not _reachable(PG_URL, 5432):
        _unavailable("PostgreSQL")
    import sqlalchemy as sa

    name = f"tiergate_t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = PG_URL.rsplit("/", 1)[0] + "/" + name
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def redis_url() -> str:
    if not _reachable(REDIS_URL, 6379):
        _unavailable("Redis")
    return REDIS_URL


@pytest.fixture
def rabbitmq_url() -> str:
    if not _reachable(RABBITMQ_URL, 5672):
        _unavailable("RabbitMQ")
    return RABBITMQ_URL


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix unique to one test, so concurrent runs never share keys."""
    return f"tiergate-test:{uuid.uuid4().hex[:12]}:"
