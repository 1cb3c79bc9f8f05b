"""`tiergate bench journal-writes`: how long the ledger journal's write(2) takes while another
thread fdatasyncs the same file, for the two ways of writing a segment — appending (the file grows
with each write) and writing in place into a segment preallocated with ``posix_fallocate`` (what
``gateway.ledger.journal`` does). The event loop makes these writes, so their tail is the loop's.

Each variant writes ``record_bytes``-byte groups every ``gap_ms`` for ``seconds`` while a thread
runs ``fdatasync`` every ``sync_ms`` (the journal's sync thread under steady traffic) and another
writer commits 8 KiB with ``fdatasync`` every 2 ms to its own file on the same file system (as
PostgreSQL's WAL or another replica's journal does on a shared disk: without such traffic the file
system's journal commits are short and both variants look alike); the two variants take turns for
``rounds`` rounds. Bench-only: imports nothing of the gateway.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path


def _one(path: Path, preallocate: bool, seconds: float, record_bytes: int, gap_s: float, sync_s: float,
         size: int) -> list[float]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (0 if preallocate else os.O_APPEND), 0o600)
    if preallocate:
        os.posix_fallocate(fd, 0, size)
    stop = threading.Event()

    def syncer() -> None:
        while not stop.is_set():
            os.fdatasync(fd)
            stop.wait(sync_s)

    def other_writer() -> None:
        other = os.open(path.with_suffix(".other"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while not stop.is_set():
                os.write(other, b"w" * 8192)
                os.fdatasync(other)
                stop.wait(0.002)
        finally:
            os.close(other)
            path.with_suffix(".other").unlink()

    threads = [threading.Thread(target=syncer, daemon=True), threading.Thread(target=other_writer, daemon=True)]
    for thread in threads:
        thread.start()
    data, offset, waits = b"x" * record_bytes, 0, []
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            if preallocate:
                os.pwrite(fd, data, offset)
            else:
                os.write(fd, data)
            waits.append(time.perf_counter() - t0)
            offset += record_bytes
            time.sleep(gap_s)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        os.close(fd)
        path.unlink()
    return waits


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(directory: str | None, rounds: int = 4, seconds: float = 2.0, record_bytes: int = 600, gap_ms: float = 0.5,
        sync_ms: float = 10.0) -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory(prefix="tiergate-journal-writes-", dir=directory) as tmp:
        size = int((seconds / (gap_ms / 1000) + 1000) * record_bytes)
        kinds = {"appending": False, "preallocated": True}
        stats: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in kinds}
        for i in range(rounds):
            for kind in (list(kinds) if i % 2 == 0 else list(reversed(kinds))):
                waits = _one(Path(tmp) / f"{kind}-{i}", kinds[kind], seconds, record_bytes, gap_ms / 1000,
                             sync_ms / 1000, size)
                stats[kind].append((_q(waits, 0.5), _q(waits, 0.99), _q(waits, 0.999), max(waits)))
        lines.append(f"journal write(2) of {record_bytes} bytes every {gap_ms} ms beside an fdatasync every {sync_ms} ms "
                     f"and another writer's 8 KiB commit every 2 ms (in {tmp.rsplit('/', 1)[0]}; {rounds} rounds of {seconds} s, medians of the rounds):")
        med = {k: [statistics.median(r[j] for r in v) for j in range(4)] for k, v in stats.items()}
        for kind, (p50, p99, p999, worst) in med.items():
            lines.append(f"  {kind:12s}  p50 {p50 * 1e6:7.1f} us  p99 {p99 * 1e6:8.1f} us  p99.9 {p999 * 1e6:8.1f} us  "
                         f"max {worst * 1e3:6.2f} ms")
        a, p = med["appending"], med["preallocated"]
        lines.append(f"  appending / preallocated: p99 x{a[1] / p[1]:.1f}, p99.9 x{a[2] / p[2]:.1f}, max x{a[3] / p[3]:.1f}")
    return lines
