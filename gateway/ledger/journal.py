"""The ledger's crash-safe journal: append-only JSON-lines segment files in one directory.

Each line is ``<crc32 hex8> <json>\\n``; a batch of lines is written with one ``pwrite`` at the
segment's end and made durable with one ``fdatasync`` (group commit).

Segments are preallocated (``posix_fallocate`` to ``max_segment_bytes``) and written in place, never
appended to: an appending write(2) changes the file's size, a metadata update that has to join the
file system's journal, and while a concurrent ``fdatasync`` commits that journal (ext4's jbd2) the
write waits for the commit (``tiergate bench journal-writes`` measures both kinds of write beside a
syncing thread). The writer is the event loop (journal_writer.py), so every such wait stalls every
request in flight. A sealed segment is
truncated to what was written; a segment left by a crash ends in zeros, which reading ignores.
Where the file system cannot preallocate (no space for a whole segment, no ``fallocate``), the
segment is written unpreallocated, as before. ``write`` and ``sync`` are separate steps
so the caller can acknowledge "handed to the kernel" (survives kill -9 of this process) before
"on the disk" (survives power loss): ``sync`` may run on another thread while the writer thread
keeps appending; ``seal`` syncs a segment before closing it, so a sync that finds the segment
rotated away has nothing left to do. Segments are named ``<seq:012d>.jsonl`` and
rotated by size or age; a new segment's directory entry is fsync'd. Reading skips a torn
tail (a crash mid-write) and any line whose checksum fails, reporting how many it skipped.

Several processes (uvicorn workers, replicas on one host) may share one journal root: each
writes only in a directory it holds with an exclusive ``flock`` for the life of the process
(the kernel releases it on kill -9) — the root itself for the first process, a ``w-<id>/``
sub-directory for the others. ``claim_writer_dir`` also adopts the segments of every
sub-directory whose lock is free (a writer that died) by renaming them into its own
directory, so they are replayed exactly once and never while their writer is alive. This module knows nothing of the database; the ledger service decides
when a segment may be deleted (only after all its rows are committed). Imports only
ledger.entries.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from gateway.ledger.entries import Record, record_from_json

log = logging.getLogger("tiergate.ledger")
SUFFIX = ".jsonl"
LOCK_NAME = ".lock"
WRITER_PREFIX = "w-"


def encode_line(record: Record) -> bytes:
    payload = orjson.dumps(record.to_json())
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def encode_lines(records: Sequence[Record]) -> bytes:
    """``records`` as journal lines, in one buffer (what ``Journal.write`` writes)."""
    if len(records) == 1:  # a call's intent: most writes on the event loop
        return encode_line(records[0])
    return b"".join([encode_line(r) for r in records])


def decode_lines(data: bytes) -> list[Record]:
    """The records of ``encode_lines(records)``. Raises ``ValueError`` on a line that does not
    decode: these bytes never touched a disk (unlike a segment's, which may end torn), so a bad
    line is a bug, never something to skip."""
    lines = data.split(b"\n")
    if lines[-1] == b"":  # the newline that ends the last line
        lines.pop()
    records: list[Record] = []
    for line in lines:
        rec = decode_line(line)
        if rec is None:
            raise ValueError(f"undecodable journal line: {line[:80]!r}")
        records.append(rec)
    return records


def decode_line(line: bytes) -> Record | None:
    """The record on one journal line, or None if the line is torn or corrupt."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    payload = line[9:].rstrip(b"\n")
    try:
        if int(line[:8], 16) != zlib.crc32(payload):
            return None
        return record_from_json(orjson.loads(payload))
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class SegmentContents:
    seq: int
    path: Path
    records: list[Record]
    skipped_lines: int


def read_segment(path: Path) -> SegmentContents:
    """The records of one segment. Zero bytes are never part of a line (JSON escapes them), so
    runs of them end a line like a newline does: the unwritten rest of a preallocated segment is
    no line, and after a hole a power loss left before later pages the lines after it are read;
    a line that fails its checksum (one the hole cut) is counted, not returned."""
    records: list[Record] = []
    skipped = 0
    for line in path.read_bytes().replace(b"\0", b"\n").split(b"\n"):
        if not line:
            continue
        rec = decode_line(line)
        if rec is None:
            skipped += 1
        else:
            records.append(rec)
    return SegmentContents(int(path.stem), path, records, skipped)


def _preallocate(fd: int, size: int) -> int:
    """Allocate ``size`` bytes of the new, empty file ``fd``; how many (0 where the file system
    has no room for them or cannot preallocate: the segment is then written unpreallocated)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        log.debug("ledger journal: segment not preallocated (%s)", exc)
        os.ftruncate(fd, 0)  # whatever part of it was allocated
        return 0
    return size


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """Appends batches to the current segment. One writer at a time (the caller serialises them)
    calls ``write``/``append``/``seal``/``should_rotate``; ``sync`` is the one method another thread
    may call concurrently."""

    def __init__(self, directory: str | Path, *, max_segment_bytes: int = 16 * 1024 * 1024,
                 max_segment_age_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = Path(directory)
        self.max_segment_bytes = max_segment_bytes
        self.max_segment_age_s = max_segment_age_s
        self._clock = clock
        self._fd: int | None = None
        self._seq = 0
        self._size = 0
        self._allocated = 0  # bytes preallocated in the current segment
        self._opened_at = 0.0
        self._fd_lock = threading.Lock()  # the fd is never closed while a sync uses it

    def existing_segments(self) -> list[Path]:
        """Segment files on disk, oldest first (call before the first append)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        paths = sorted(p for p in self.directory.glob("*" + SUFFIX) if p.stem.isdigit())
        if paths:
            self._seq = max(self._seq, int(paths[-1].stem))
        return paths

    def path_for(self, seq: int) -> Path:
        return self.directory / f"{seq:012d}{SUFFIX}"

    @property
    def current_seq(self) -> int | None:
        return self._seq if self._fd is not None else None

    @property
    def last_seq(self) -> int:
        """The seq of the current segment, or of the last one opened."""
        return self._seq

    @property
    def current_has_data(self) -> bool:
        return self._fd is not None and self._size > 0

    def _open_next(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        fd = os.open(self.path_for(self._seq), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._allocated = _preallocate(fd, self.max_segment_bytes)
        self._fd = fd
        self._size = 0
        self._opened_at = self._clock()
        _fsync_dir(self.directory)

    def should_rotate(self) -> bool:
        return self.current_has_data and (self._size >= self.max_segment_bytes
                                          or self._clock() - self._opened_at >= self.max_segment_age_s)

    def seal(self) -> int | None:
        """Sync and close the current segment (no more appends to it); returns its seq.

        The segment is closed even when its final sync fails (the error then propagates)."""
        with self._fd_lock:
            if self._fd is None:
                return None
            fd, self._fd = self._fd, None
            try:
                os.fdatasync(fd)
                if self._allocated > self._size:  # give back the unwritten rest (not synced: zeros if lost)
                    os.ftruncate(fd, self._size)
            finally:
                os.close(fd)
        return self._seq

    def write(self, records: Sequence[Record]) -> int:
        """Hand ``records`` to the kernel with one write(2), no sync; returns the segment seq.
        Once this returns they survive the death of this process (not a power loss).

        After an error the caller must ``seal()`` so a retry goes to a fresh segment and never
        lands after a half-written line."""
        return self.write_lines(encode_lines(records))

    def write_lines(self, data: bytes) -> int:
        """``write`` for records already encoded (``encode_lines``)."""
        if self._fd is None:
            self._open_next()
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, self._size)
            view = view[n:]
            self._size += n
        return self._seq

    def sync(self) -> None:
        """fdatasync the current segment: everything ``write`` returned from before this call
        is then on disk (an earlier, sealed segment was synced by ``seal``). Thread-safe."""
        with self._fd_lock:
            if self._fd is not None:
                os.fdatasync(self._fd)

    def append(self, records: Sequence[Record]) -> int:
        """``write`` then ``sync``: ``records`` are on disk when this returns; the segment seq."""
        seq = self.write(records)
        self.sync()
        return seq

    def delete(self, seq: int) -> None:
        self.path_for(seq).unlink(missing_ok=True)


def _segment_paths(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*" + SUFFIX) if p.stem.isdigit())


def _try_lock(directory: Path) -> int | None:
    """An fd holding an exclusive flock on ``directory/.lock``, or None if a live process holds it."""
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    except FileNotFoundError:  # the directory was just adopted and removed by another process
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def release_writer_dir(directory: Path, lock_fd: int) -> None:
    """Give up a writer directory: removed if it holds no segment, else left for adoption."""
    try:
        if not _segment_paths(directory):
            (directory / LOCK_NAME).unlink(missing_ok=True)
            directory.rmdir()
    except OSError as exc:  # e.g. another process recreated a lock file in it: leave it
        log.debug("ledger journal: leaving %s (%s)", directory, exc)
    finally:
        os.close(lock_fd)


def claim_writer_dir(root: str | Path) -> tuple[Path, int]:
    """Lock this process's writer directory: ``root`` itself when no live process holds it (the
    single-process case: segments lie directly in ``root``), else a new ``root/w-<id>/``. Then
    move into it, in order, the segments of every dead ``w-*`` writer."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    fd = _try_lock(root)
    own = root
    if fd is None:
        own = root / f"{WRITER_PREFIX}{uuid.uuid4().hex[:16]}"
        own.mkdir()
        fd = _try_lock(own)
        if fd is None:
            raise OSError(f"cannot lock new journal directory {own}")
    adopted: list[tuple[Path, int]] = []
    for other in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(WRITER_PREFIX)):
        other_fd = None if other == own else _try_lock(other)
        if other_fd is not None:
            adopted.append((other, other_fd))
    existing = _segment_paths(own)
    seq = int(existing[-1].stem) if existing else 0
    moved = 0
    try:
        for directory, _ in adopted:
            for path in _segment_paths(directory):
                seq += 1
                moved += 1
                os.rename(path, own / f"{seq:012d}{SUFFIX}")
        if moved:
            _fsync_dir(own)
            log.info("ledger journal: adopted %d segment(s) from writers no longer running", moved)
    finally:
        for directory, other_fd in adopted:
            release_writer_dir(directory, other_fd)
    return own, fd


def release_journal_dir(root: Path, directory: Path, lock_fd: int) -> None:
    """Release what ``claim_writer_dir`` returned (the root itself is never removed)."""
    if directory == root:
        os.close(lock_fd)
    else:
        release_writer_dir(directory, lock_fd)
