"""Journal segments are preallocated and written in place (no write(2) changes a file's size,
so none waits for the file system's journal commit a concurrent fdatasync forces); a sealed
segment is truncated to what was written, and reading a segment a crash left (zeros after its
last line, or a zero hole before later lines) returns every intact record."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.ledger import LedgerEntry, new_entry_id
from gateway.ledger.journal import Journal, encode_line, read_segment
from gateway.providers.base import Usage

SEGMENT = 1 << 20


def entry(i: int) -> LedgerEntry:
    return LedgerEntry(id=new_entry_id(), request_id=f"req-{i}", tenant_id="t1", key_id="k1", stage="direct",
                       tier="low", model="demo-moe", usage=Usage(prompt_tokens=i, completion_tokens=2 * i),
                       cost_nanos=500_000_000, baseline_cost_nanos=1_000_000_000)


def _journal(directory: Path, max_segment_bytes: int = SEGMENT) -> Journal:
    journal = Journal(directory, max_segment_bytes=max_segment_bytes)
    journal.existing_segments()
    return journal


def test_a_segment_is_preallocated_written_in_place_and_truncated_when_sealed(tmp_path: Path) -> None:
    journal = _journal(tmp_path / "j")
    records = [entry(i) for i in range(5)]
    journal.write(records[:2])
    path = journal.path_for(journal.last_seq)
    assert path.stat().st_size == SEGMENT  # preallocated: the writes did not grow it
    journal.write(records[2:])
    assert path.stat().st_size == SEGMENT
    assert [r.id for r in read_segment(path).records] == [r.id for r in records]  # the zeros after them are no line
    assert read_segment(path).skipped_lines == 0
    journal.seal()
    assert path.stat().st_size == sum(len(encode_line(r)) for r in records)
    assert [r.id for r in read_segment(path).records] == [r.id for r in records]


def test_a_zero_hole_before_later_lines_loses_only_what_it_covers(tmp_path: Path) -> None:
    # After a power loss a later page can reach the disk while an earlier one did not.
    journal = _journal(tmp_path / "j")
    records = [entry(i) for i in range(3)]
    journal.write(records)
    journal.sync()
    path = journal.path_for(journal.last_seq)
    lines = [encode_line(r) for r in records]
    with path.open("r+b") as f:
        f.seek(len(lines[0]) + 5)  # zero the middle line from its 6th byte
        f.write(b"\0" * (len(lines[1]) - 5))
    contents = read_segment(path)
    assert [r.id for r in contents.records] == [records[0].id, records[2].id]
    assert contents.skipped_lines == 1  # the torn middle line, counted


def test_a_torn_last_line_in_a_preallocated_segment_is_counted(tmp_path: Path) -> None:
    journal = _journal(tmp_path / "j")
    journal.write([entry(1)])
    path = journal.path_for(journal.last_seq)
    with path.open("r+b") as f:
        f.seek(len(encode_line(entry(1))))
        f.write(b'0badc0de {"t": "e", "id": "half-writ')  # a crash mid-line, zeros after it
    contents = read_segment(path)
    assert len(contents.records) == 1 and contents.skipped_lines == 1


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.process
def test_without_room_for_a_whole_segment_it_is_written_unpreallocated(tiny_fs: Path) -> None:
    journal = _journal(tiny_fs / "j", max_segment_bytes=SEGMENT)  # 1 MiB does not fit in 256 KiB
    records = [entry(i) for i in range(4)]
    journal.write(records)
    path = journal.path_for(journal.last_seq)
    written = sum(len(encode_line(r)) for r in records)
    assert path.stat().st_size == written  # nothing was left allocated by the failed attempt
    assert os.statvfs(tiny_fs).f_bfree * os.statvfs(tiny_fs).f_bsize > 128 * 1024
    journal.seal()
    assert [r.id for r in read_segment(path).records] == [r.id for r in records]
