"""The test lanes: what each marker means, the marks derived at collection, and the checks that
keep the marks true (tests/conftest.py wires these into pytest's hooks).

Markers (registered in pyproject.toml; `make test-fast` deselects the last four):

- ``postgres`` / ``redis`` / ``rabbitmq``: needs that service. A test that uses the
  ``postgres_url`` / ``redis_url`` / ``rabbitmq_url`` fixture gets the mark at collection.
- ``integration``: talks to a real service: PostgreSQL, Redis or RabbitMQ (derived from the three
  marks above), or a real server over a socket: the gateway under uvicorn in the test's process
  (``gateway_harness.served``) or a server the test spawns (``tiergate serve``, ``tiergate engine
  serve``, the bench's mock upstream); explicit. The scripted upstream, an aiohttp test double in
  the test's process, is not a service.
- ``process``: spawns a subprocess: ``tiergate serve``, ``tiergate worker``, a kill -9 child, a
  CLI or ``python -c`` child, a C compiler, ``nginx -t``; derived from ``postgres`` too (a ledger
  on PostgreSQL writes through its applier child process, gateway.ledger.applier_process).
- ``browser``: drives Debian's chromium through Playwright (which spawns it).
- ``slow``: takes more than ``SLOW_S`` seconds.

Checks, on every run (so the whole suite, which CI runs, keeps the fast lane honest):

- a test that spawns a subprocess without ``process`` or ``browser`` fails;
- a test that connects to PostgreSQL, Redis or RabbitMQ, or serves the gateway on a socket,
  without ``integration`` fails;
- a test that takes more than ``SLOW_S`` s (setup + call + teardown) without ``slow`` is listed
  at the end of the run (listed, not failed: timings on a shared machine are noisy).

Work done by a thread that a finished test started is not held against the test running now,
nor are the probes a library makes once per process to learn about the machine (``_probe``).
``TIERGATE_LANE_CHECKS=0`` turns the checks off (nothing is wrapped).
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SLOW_S = 2.0
SERVICE_MARKS = ("postgres", "redis", "rabbitmq")
SERVICE_FIXTURES = {"postgres_url": "postgres", "redis_url": "redis", "rabbitmq_url": "rabbitmq"}
# `make test-fast` sets this and deselects FAST_LANE_OUT; modules whose own pytestmark carries one of
# them are then not even imported (read with ast instead), which spares the lane their imports.
FAST_LANE_ENV = "TIERGATE_FAST_LANE"
FAST_LANE_OUT = ("integration", "process", "browser", "slow", *SERVICE_MARKS)
# What a test must be marked with (any of) to do each kind of thing.
ALLOWED = {"process": ("process", "browser"), "integration": ("integration",)}

_current: str | None = None
_marks: frozenset[str] = frozenset()
_violations: dict[str, list[str]] = {}
_lock = threading.Lock()
_service_ports: dict[int, str] = {}
slow_marked: set[str] = set()  # node ids marked slow, for the end-of-run list


def derive_marks(items: Iterable[pytest.Item]) -> None:
    """Service marks from the service fixtures, and ``integration`` from the service marks."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        for fixture, mark in SERVICE_FIXTURES.items():
            if fixture in names and item.get_closest_marker(mark) is None:
                item.add_marker(mark)
        if item.get_closest_marker("integration") is None and any(
                item.get_closest_marker(m) is not None for m in SERVICE_MARKS):
            item.add_marker("integration")
        if item.get_closest_marker("postgres") is not None and item.get_closest_marker("process") is None:
            item.add_marker("process")  # a ledger on PostgreSQL writes through its applier child process
        if item.get_closest_marker("slow") is not None:
            slow_marked.add(item.nodeid)


def fast_lane() -> bool:
    return os.environ.get(FAST_LANE_ENV) == "1"


def module_marks_out_of_fast_lane(path: Path) -> list[str]:
    """The marks of FAST_LANE_OUT in ``path``'s module-level ``pytestmark`` (parsed, not imported)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            names = {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)
                     and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
            return sorted(names & set(FAST_LANE_OUT))
    return []


def begin(item: pytest.Item) -> None:
    global _current, _marks
    _current, _marks = item.nodeid, frozenset(m.name for m in item.iter_markers())


def end() -> None:
    global _current, _marks
    _current, _marks = None, frozenset()


def take_violations(nodeid: str) -> list[str]:
    with _lock:
        return _violations.pop(nodeid, [])


def note(kind: str, what: str) -> None:
    """Record that the running test did ``what``, which needs one of ``ALLOWED[kind]``."""
    current, marks = _current, _marks
    if current is None or not enabled():
        return
    owner = getattr(threading.current_thread(), "_tiergate_lane_owner", None)
    if owner is not None and owner != current:
        return  # a thread left running by an earlier test
    if any(m in marks for m in ALLOWED[kind]):
        return
    with _lock:
        _violations.setdefault(current, []).append(
            f"{what}, but the test is not marked {kind} (add @pytest.mark.{kind}; see tests/lanes.py)")


def enabled() -> bool:
    return os.environ.get("TIERGATE_LANE_CHECKS", "1") != "0"


# --------------------------------------------------------------------------------- the patches
def install(service_urls: dict[str, str]) -> None:
    """Wrap what spawns processes and what connects to the services, once per session (not at all
    with the checks off)."""
    if not enabled():
        return
    from urllib.parse import urlparse

    defaults = {"PostgreSQL": 5432, "Redis": 6379, "RabbitMQ": 5672}
    for name, url in service_urls.items():
        _service_ports[urlparse(url).port or defaults[name]] = name

    start = threading.Thread.start

    def tagged_start(self: threading.Thread) -> None:
        if _current is not None and not hasattr(self, "_tiergate_lane_owner"):
            self._tiergate_lane_owner = _current  # type: ignore[attr-defined]
        start(self)

    threading.Thread.start = tagged_start  # type: ignore[method-assign]

    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def guarded_execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> Any:
        argv = [args] if isinstance(args, str | bytes) else list(args)
        if not _probe(argv):
            note("process", f"it spawned {os.path.basename(str(argv[0]))!r}")
        return execute_child(self, args, *rest, **kw)

    subprocess.Popen._execute_child = guarded_execute_child  # type: ignore[attr-defined]

    import multiprocessing.process

    mp_start = multiprocessing.process.BaseProcess.start

    def guarded_mp_start(self: Any) -> None:
        note("process", "it started a multiprocessing.Process")
        mp_start(self)

    multiprocessing.process.BaseProcess.start = guarded_mp_start  # type: ignore[method-assign]

    for method in ("connect", "connect_ex"):
        original = getattr(socket.socket, method)
        setattr(socket.socket, method, _guarded_connect(original))

    if "psycopg" in sys.modules:
        _patch_psycopg(sys.modules["psycopg"])
    else:
        sys.meta_path.insert(0, _PatchOnImport("psycopg", _patch_psycopg))


def _probe(argv: list[Any]) -> bool:
    """A library asking about the machine, once per process, whichever test comes first: ``cc
    --version`` (engine.native.build's cache key), ``uname -p`` (platform), ``ldconfig -p`` / ``gcc``
    (ctypes.util.find_library). Not the test's doing, so not held against it."""
    if len(argv) == 2 and str(argv[1]) == "--version":
        return True
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if name.endswith(("/platform.py", "/ctypes/util.py")):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _guarded_connect(original: Callable[..., Any]) -> Callable[..., Any]:
    def connect(self: socket.socket, address: Any) -> Any:
        if isinstance(address, tuple) and len(address) >= 2 and address[1] in _service_ports:
            note("integration", f"it connected to {_service_ports[address[1]]} at {address[0]}:{address[1]}")
        return original(self, address)

    return connect


def _patch_psycopg(module: ModuleType) -> None:
    """psycopg connects through libpq (C), past the socket patch: wrap its connect functions."""
    connect = module.connect

    def guarded(*args: Any, **kwargs: Any) -> Any:
        note("integration", "it connected to PostgreSQL")
        return connect(*args, **kwargs)

    module.connect = guarded  # type: ignore[attr-defined]
    for cls in (module.Connection, module.AsyncConnection):
        original = cls.__dict__["connect"].__func__

        def make(original: Callable[..., Any]) -> classmethod[Any, Any, Any]:
            def cls_connect(klass: Any, *args: Any, **kwargs: Any) -> Any:
                note("integration", "it connected to PostgreSQL")
                return original(klass, *args, **kwargs)

            return classmethod(cls_connect)

        cls.connect = make(original)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Calls ``patch(module)`` once ``name`` has been imported (without importing it sooner)."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, self.patch
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec
