"""``SegmentTracker``: when a journal segment may be deleted.

A segment is deleted only once it is sealed (no more appends: the journal writer moved on)
and every record written to it is committed to the database (the syncer applied it). The
journal writer reports what it wrote and sealed, the syncer what it applied; whichever report
completes a segment deletes it. Thread-safe; imports nothing from the gateway.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Segment:
    written: int = 0
    applied: int = 0
    sealed: bool = False


class SegmentTracker:
    def __init__(self, delete: Callable[[int], None]) -> None:
        self._delete = delete  # removes the segment file with that seq
        self._lock = threading.Lock()
        self._segments: dict[int, _Segment] = {}

    def reset(self, delete: Callable[[int], None]) -> None:
        """Forget every segment (a new start) and delete through ``delete`` from now on."""
        with self._lock:
            self._segments.clear()
            self._delete = delete

    def replayed(self, seg: int, records: int) -> None:
        """A segment left by an earlier run: sealed, ``records`` of it still to apply."""
        with self._lock:
            self._segments[seg] = _Segment(written=records, sealed=True)
        self._maybe_delete(seg)

    def wrote(self, seg: int, records: int) -> None:
        with self._lock:  # (per journal write, on the event loop: no _Segment built unless it is new)
            state = self._segments.get(seg)
            if state is None:
                state = self._segments[seg] = _Segment()
            state.written += records

    def sealed(self, seg: int) -> None:
        with self._lock:
            self._segments.setdefault(seg, _Segment()).sealed = True
        self._maybe_delete(seg)

    def applied(self, seg: int, records: int) -> None:
        with self._lock:
            self._segments.setdefault(seg, _Segment()).applied += records
        self._maybe_delete(seg)

    def open_segments(self) -> list[int]:
        """Segments not deleted yet, oldest first."""
        with self._lock:
            return sorted(self._segments)

    def _maybe_delete(self, seg: int) -> None:
        with self._lock:
            state = self._segments.get(seg)
            if state is None or not state.sealed or state.applied < state.written:
                return
            del self._segments[seg]
        self._delete(seg)
