"""The ledger's DB applier in a child process (``ledger.applier: process``; ``auto``, the default,
picks it on PostgreSQL).

Why: the syncer's DB thread used to run ``applier.write_batch`` inside the serving process. Its
Python holds the GIL (~20 µs per request on PostgreSQL), and every one of its many short steps
between libpq calls asks for the GIL again, so each syscall of the event loop (a journal write, a
socket send, ``epoll_wait``) could hand the GIL over and take it back: a futex wake of the DB
thread (an inter-processor interrupt, costly in a VM) and a futex wait of the loop. Measured with
``perf record -e cpu-clock`` on a loop recording ledger rows into PostgreSQL: 12% of the loop
thread's CPU in ``pthread_cond_signal`` → ``futex_wake`` and 8% in ``futex_wait``, against 4% and
3% without the DB thread's work; loop CPU per request 62–89 µs with the applier in a thread,
47–55 µs with it in a child process (the micro-bench of ``tiergate bench ledger``'s serving
path; ``tiergate bench ledger`` shows the effect on request latency).

The parent side, ``ProcessApplier``, is the syncer's ``apply``: it sends one batch to its own child
over a private pipe — as the journal lines the journal writer already encoded (``apply_lines``,
what the syncer sends: the child decodes them with the journal's own reader; pickling the records
here cost this thread ~10 µs per record of GIL-holding Python, ~30 µs per chat request, taken from
the event loop), or the records pickled (``__call__``), never anything a client sent in that form
— and blocks, the GIL released, until the child answers with the batch's result or its
error, raised here as ``ApplierError`` (the syncer logs it and retries the batch with backoff, as
before: nothing is swallowed). The child (``python -c "from gateway.ledger.applier_process import main; main()"``) reads its
database URL from the first message (never from argv or the environment, where ``ps`` shows it),
builds its own engine and calls ``applier.write_batch`` for each batch: the same one
transaction, the same idempotence. It exits when its stdin closes — the parent stopped or died, a
kill -9 of the gateway included; a batch it was in the middle of commits or rolls back as one
transaction, and the journal replays it either way. A child that died, or a pipe that broke, fails
that batch; the next batch starts a new child. Imports ledger.entries and ledger.journal (its line
codec); the child imports the applier.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from gateway.ledger.entries import Record
from gateway.ledger.journal import decode_lines

log = logging.getLogger("tiergate.ledger")

_LENGTH = struct.Struct("<Q")
# A batch message's first byte: what follows is the records pickled, or a record count and the
# records' journal lines.
_PICKLED, _LINES = b"P", b"L"
_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the ``gateway`` package


class ApplierError(RuntimeError):
    """A batch the applier process did not commit (its error, or the process or pipe failing)."""


def _send(pipe: IO[bytes], payload: bytes) -> None:
    pipe.write(_LENGTH.pack(len(payload)))
    pipe.write(payload)
    pipe.flush()


def _read_exactly(pipe: IO[bytes], n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = pipe.read(left)
        if not chunk:
            raise EOFError("the pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(pipe: IO[bytes]) -> bytes:
    (n,) = _LENGTH.unpack(_read_exactly(pipe, _LENGTH.size))
    return _read_exactly(pipe, n)


class ProcessApplier:
    """``apply`` for the syncer: each batch written by a child process (see the module docstring).
    ``url``: the database, password included; ``engine_options``: keyword arguments for the
    child's ``create_engine``; ``nice``: added to the child's niceness, so that where the cores are
    busy the event loop serving requests gets them before this background work (a batch waits a
    little longer; nothing waits for it but the dashboard). Thread-safe (one batch at a time)."""

    def __init__(self, url: str, engine_options: dict[str, Any] | None = None, *, nice: int = 10) -> None:
        self._url = url
        self._nice = nice
        self._engine_options = dict(engine_options or {})
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self.started = 0  # children started (a restart after a failure counts)

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def __call__(self, records: Sequence[Record]) -> Any:
        return self._batch(_PICKLED + pickle.dumps(list(records), protocol=pickle.HIGHEST_PROTOCOL))

    def apply_lines(self, lines: bytes, count: int) -> Any:
        """One batch given as its journal lines (``journal.encode_lines``; ``count`` records)."""
        return self._batch(_LINES + _LENGTH.pack(count) + lines)

    def _batch(self, message: bytes) -> Any:
        with self._lock:
            proc = self._child()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                _send(proc.stdin, message)
                status, payload = pickle.loads(_receive(proc.stdout))
            except (OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
                self._proc = None
                _stop(proc, 1.0)
                raise ApplierError(f"the ledger applier process failed ({type(exc).__name__}: {exc}; "
                                   f"exit code {proc.returncode}); the batch is retried") from exc
        if status != "ok":
            raise ApplierError(payload)
        return payload

    def _child(self) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return proc
        if proc is not None:
            log.error("ledger applier process %d exited with code %s; starting a new one", proc.pid, proc.returncode)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen([sys.executable, "-c", "from gateway.ledger.applier_process import main; main()"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, close_fds=True)
        assert proc.stdin is not None
        _send(proc.stdin, pickle.dumps({"url": self._url, "engine": self._engine_options, "nice": self._nice}))
        self._proc = proc
        self.started += 1
        return proc

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the child (its stdin closed: it finishes the batch it has, then exits)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _stop(proc, timeout_s)


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    for pipe in (proc.stdin, proc.stdout):
        try:
            if pipe is not None:
                pipe.close()
        except OSError:
            pass
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.error("ledger applier process %d did not exit within %.1f s; killing it", proc.pid, timeout_s)
        proc.kill()
        proc.wait()


def _records(message: bytes) -> list[Record]:
    """The records of one batch message (see ``_PICKLED``, ``_LINES``); raises on a malformed one."""
    kind, body = message[:1], message[1:]
    if kind == _PICKLED:
        records: list[Record] = pickle.loads(body)
        return records
    if kind != _LINES:
        raise ValueError(f"unknown batch message kind {kind!r}")
    (count,) = _LENGTH.unpack_from(body)
    records = decode_lines(body[_LENGTH.size:])
    if len(records) != count:
        raise ValueError(f"batch of {count} record(s) arrived with {len(records)}")
    return records


def main() -> None:
    """The child: one batch per message until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this stops: it closes stdin
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the answer pipe
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s ledger-applier: %(message)s")
    try:
        config = pickle.loads(_receive(inp))
    except EOFError:
        return
    if config.get("nice"):
        os.nice(config["nice"])
    import sqlalchemy as sa
    from sqlalchemy.orm import sessionmaker

    from gateway.ledger.applier import write_batch

    engine = sa.create_engine(config["url"], **config["engine"])
    factory = sessionmaker(bind=engine, expire_on_commit=False)
    try:
        while True:
            try:
                data = _receive(inp)
            except EOFError:
                return
            try:
                reply: tuple[str, Any] = ("ok", write_batch(factory, _records(data)))
            except Exception as exc:  # answered to the parent, which logs it and retries the batch
                reply = ("error", f"{type(exc).__name__}: {exc}"[:2000])
            _send(out, pickle.dumps(reply))
    finally:
        engine.dispose()


if __name__ == "__main__":
    main()
