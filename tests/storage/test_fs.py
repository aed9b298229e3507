"""The real file system's small-file reads (storage/fs.py): a reopen reads its stream's marker
with `read_file`, straight from the descriptor, and touches no access time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage import AppendBatch, Engine, EngineConfig
from storage.errors import DurabilityError
from storage.fs import AppendFile, FileSystem
from storage.layout import stream_directory
from tests.storage.conftest import SMALL


@pytest.mark.parametrize("size", [0, 1, 100, 4096, 70_000])
def test_read_file_returns_the_whole_file(tmp_path, size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    (tmp_path / "f").write_bytes(data)
    assert FileSystem().read_file(tmp_path / "f") == data


def test_read_file_of_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        FileSystem().read_file(tmp_path / "missing")


def test_sync_filesystem_syncs_the_file_system_of_a_directory_and_says_when_it_cannot(tmp_path):
    fs = FileSystem()
    count = fs.sync_times.count
    fs.sync_filesystem(tmp_path)  # a real syncfs(2): timed as a sync
    assert fs.sync_times.count == count + 1
    with pytest.raises(DurabilityError, match="cannot open"):
        fs.sync_filesystem(tmp_path / "missing")


def _age_access_times(paths: list[Path]) -> dict[Path, int]:
    """Set each path's atime an hour before its mtime (so `relatime` would update it on a read)."""
    aged = {}
    for path in paths:
        stat = path.stat()
        aged[path] = stat.st_mtime_ns - 3600 * 10**9
        os.utime(path, ns=(aged[path], stat.st_mtime_ns))
    return aged


def test_a_reopened_stream_reads_its_directory_and_files_without_updating_their_access_times(tmp_path):
    """An atime update dirties the inode, whose table block may have to be read from disk behind
    a syncfs's write-back: a reopen (its listing, meta, markers, segment mappings) makes none."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    _age_access_times([probe])
    before = probe.stat().st_atime_ns
    probe.read_bytes()
    if probe.stat().st_atime_ns == before:
        pytest.skip("this file system does not update access times (mounted noatime): nothing to see")
    # (SMALL: no background thread; off: a directory and its files, not a slot)
    config = EngineConfig(**SMALL, max_open_streams=1, small_streams="off")
    with Engine(tmp_path / "data", config) as engine:
        engine.append("h" * 250, AppendBatch([b"1", b"2"]))  # a hashed name: its meta file is read too
        engine.append("b", AppendBatch([b"3"]))  # closes the first
        engine.sync()
        directory = stream_directory(tmp_path / "data", "h" * 250)
        aged = _age_access_times([directory, *directory.iterdir()])
        assert [e.payload for e in engine.read("h" * 250, 0, 10).entries()] == [b"1", b"2"]  # reopened
        assert {path: path.stat().st_atime_ns for path in aged} == aged


def test_an_append_file_has_its_blocks_allocated_ahead_of_its_size_and_holds_exactly_what_was_appended(
    tmp_path,
):
    """The catalog journal's appends allocate no block of their own (a delayed allocation waits for
    the file's write-back by a syncfs): the blocks come ahead, in steps, and the size stays the data's."""
    path = tmp_path / "journal"
    file = FileSystem().create_append(path, b"head")
    records = [bytes([i % 251]) * (1000 + i) for i in range(1500)]  # about 2.6 MB: past a step
    ahead = []  # bytes allocated past the file's end, after each append
    try:
        for record in records:
            file.append(record)
            stat = path.stat()
            ahead.append(stat.st_blocks * 512 - stat.st_size)
    finally:
        file.close()
    assert min(ahead) >= 0 and max(ahead) >= AppendFile.APPEND_STEP  # a step ahead, not a block
    assert path.read_bytes() == b"head" + b"".join(records)  # the size is the data's


def test_an_append_file_writes_the_rest_of_a_short_write(tmp_path, monkeypatch):
    """write(2) may write less than asked (a signal, a full disk's last blocks): an append goes on
    with the rest, so a record is whole or not written."""
    path = tmp_path / "journal"
    file = FileSystem().create_append(path, b"head")
    real_write = os.write
    calls = []

    def short_write(fd: int, data: bytes) -> int:
        calls.append(len(data))
        return real_write(fd, bytes(data)[:7])  # at most 7 bytes a call

    monkeypatch.setattr("storage.fs.os.write", short_write)
    try:
        file.append(b"a record of thirty bytes .....")
    finally:
        file.close()
    assert path.read_bytes() == b"head" + b"a record of thirty bytes ....."
    assert calls == [30, 23, 16, 9, 2]
