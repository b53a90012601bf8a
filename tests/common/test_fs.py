"""`common/fs.py`: `fsync` flushes a file's data or a folder's entries (what makes a rename durable)."""

from __future__ import annotations

import os

import pytest

from rlstream.common.fs import fsync


def test_fsync_accepts_a_file_and_a_folder_and_leaves_them_as_they_were(tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(b"abc")
    fsync(f)
    fsync(str(tmp_path))
    tmp = tmp_path / "x.tmp"
    tmp.write_bytes(b"new")
    fsync(tmp)
    os.replace(tmp, f)
    fsync(tmp_path)  # the rename is durable once the folder is flushed
    assert f.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"]


def test_fsync_of_a_missing_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        fsync(tmp_path / "missing")
