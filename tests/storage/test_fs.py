"""The real file system's small-file reads (storage/fs.py): a reopen reads its stream's marker
with `read_file`, straight from the descriptor."""

from __future__ import annotations

import pytest

from storage.fs import FileSystem


@pytest.mark.parametrize("size", [0, 1, 100, 4096, 70_000])
def test_read_file_returns_the_whole_file(tmp_path, size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    (tmp_path / "f").write_bytes(data)
    assert FileSystem().read_file(tmp_path / "f") == data


def test_read_file_of_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        FileSystem().read_file(tmp_path / "missing")
