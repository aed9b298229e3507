"""The real file system's small-file reads (storage/fs.py): a reopen reads its stream's marker
with `read_file`, straight from the descriptor."""

from __future__ import annotations

import pytest

from storage.errors import DurabilityError
from storage.fs import FileSystem


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
