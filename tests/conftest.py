"""Shared fixtures: real PostgreSQL / Redis / RabbitMQ where the machine has them; and the lanes.

Marked tests skip when the service is unreachable, except under CI (CI=true), where a
missing service is a failure: CI's machine runs them and must not silently skip.

The lanes (tests/lanes.py): the markers integration, process, browser and slow, the service and
integration marks derived at collection, and the checks that fail a test which spawns a process or
talks to a service without its mark. `make test-fast` runs what none of the four marks.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests import lanes

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PG_URL = os.environ.get("TIERGATE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TIERGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ_URL = os.environ.get("TIERGATE_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")


def pytest_configure(config: pytest.Config) -> None:
    lanes.install({"PostgreSQL": PG_URL, "Redis": REDIS_URL, "RabbitMQ": RABBITMQ_URL})


_not_collected: list[str] = []


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    """In the fast lane, a module marked out of it as a whole is not imported at all."""
    if (lanes.fast_lane() and collection_path.suffix == ".py" and collection_path.name.startswith("test_")
            and lanes.module_marks_out_of_fast_lane(collection_path)):
        _not_collected.append(collection_path.name)
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects, so it sees the derived marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    lanes.derive_marks(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    lanes.begin(item)
    try:
        return (yield)
    finally:
        lanes.end()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A phase (setup, call, teardown) in which the test did what its marks do not allow fails,
    saying what it did."""
    report = yield
    problems = lanes.take_violations(item.nodeid)
    if problems:
        report.outcome = "failed"
        report.longrepr = "lane markers: " + "; ".join(problems)
    return report


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _not_collected:
        terminalreporter.write_line(f"fast lane: {len(_not_collected)} modules marked out of it as a whole were "
                                    f"not collected ({', '.join(sorted(_not_collected))})")
    slow_marked = lanes.slow_marked
    late = sorted(((d, n) for n, d in _durations.items() if d > lanes.SLOW_S and n not in slow_marked),
                  reverse=True)
    if late:
        terminalreporter.section(f"over {lanes.SLOW_S:g} s without @pytest.mark.slow (mark them, or speed them up)")
        for d, n in late:
            terminalreporter.write_line(f"{d:6.2f}s {n}")


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
