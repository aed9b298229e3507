"""Where a data directory keeps things: file names, the directory layout, a stream's meta file.

    DATA/LOCK                                held while an engine has the directory open
    DATA/streams/<encoded name>/             one stream (storage/names.py encodes the name)
        stream.meta                          name, first offset, config (below); none while they are
                                             the name its directory encodes, 0 and the default config
        stream.meta.new                      a new stream's with a hashed name, until its first sync,
                                             and a format-2 creation's (storage/creation.py)
        <20-digit base offset>.seg           segment files (storage/segment.py)
        producers.snap                       the idempotent-append table (storage/dedup.py)
        epochs                               leader-epoch history and incarnation (storage/epochs.py)
        TRUNCATING                           a truncation under way (storage/truncation.py)
        SYNCED                               the SYNCED marker of a last segment without a slot for it
                                             (storage/cleanmark.py; formats 3 and 4 kept it here always)
        CLEAN                                format 2's marker of a clean close, removed before the next write
        *.tmp                                a file being replaced; a crash may leave one behind
        *.seg.damaged                        a segment with nothing readable, kept for the operator
    DATA/streams/<encoded name>.deleted/     a stream whose deletion a crash interrupted
    DATA/groups/<encoded name>               the stream has consumer groups (storage/groupregistry.py)
    DATA/packs/<5-digit pack id>.pack        small streams' slots (format 6, small_streams
                                             "slots", the default: storage/packs.py)

The consumer groups' files beside the segments are named in storage/grouplog.py.
docs/FORMAT.md has the byte layout of each file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from crc32c import crc32c

from storage.config import StreamConfig
from storage.errors import CorruptionError
from storage.names import dirname_for, name_of_dirname

if TYPE_CHECKING:  # fs.py names its temporary files with TMP_SUFFIX from here
    from storage.fs import FileSystem

LOCK_FILE = "LOCK"
STREAMS_DIR = "streams"
PACKS_DIR = "packs"
PACK_SUFFIX = ".pack"
DELETED_SUFFIX = ".deleted"
META_FILE = "stream.meta"
META_NEW = "stream.meta.new"  # a new stream's meta file until its creation is durable (storage/creation.py)
CLEAN_MARKER = "CLEAN"
PRODUCERS_FILE = "producers.snap"
EPOCHS_FILE = "epochs"
TRUNCATE_MARKER = "TRUNCATING"
SEGMENT_SUFFIX = ".seg"
TMP_SUFFIX = ".tmp"
DAMAGED_SUFFIX = ".damaged"
_META_MAGIC = b"SLMT"


def streams_root(data_dir: Path) -> Path:
    return data_dir / STREAMS_DIR


def stream_directory(data_dir: Path, name: str) -> Path:
    return streams_root(data_dir) / dirname_for(name)


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}{SEGMENT_SUFFIX}"


def pack_name(pack_id: int) -> str:
    return f"{pack_id:05d}{PACK_SUFFIX}"


def pack_id_of(name: str) -> int | None:
    """The id a pack file's name gives, or None for any other name."""
    stem = name.removesuffix(PACK_SUFFIX)
    if len(stem) != 5 or not stem.isascii() or not stem.isdigit() or stem == name:
        return None
    return int(stem)


def segment_base(filename: str) -> int:
    """The base offset a segment file's name gives."""
    return int(filename.split(".")[0])


def encode_meta(name: str, first_offset: int, config: StreamConfig) -> bytes:
    body = json.dumps({"name": name, "first_offset": first_offset, "config": config.to_dict()}).encode()
    return _META_MAGIC + struct.pack("<I", crc32c(body)) + body


def write_meta(fs: FileSystem, directory: Path, name: str, first_offset: int, config: StreamConfig) -> None:
    """Replace the stream's meta file, atomically and durably."""
    fs.write_file_atomic(directory / META_FILE, encode_meta(name, first_offset, config))


def read_meta(
    fs: FileSystem, directory: Path, files: Collection[str] | None = None
) -> tuple[str, int, StreamConfig]:
    """A stream's name, first offset and config: its meta file's, a new stream's `stream.meta.new`,
    or without either, what a stream created without one has (storage/creation.py): the name its
    directory encodes, first offset 0, the default config. CorruptionError if there is no name.
    `files`: the directory's listing, when the caller has it (no attempt to open what is not there)."""
    for meta in (META_FILE, META_NEW):
        if files is not None and meta not in files:
            continue
        try:
            return decode_meta(fs.read_file(directory / meta))
        except FileNotFoundError:
            continue
    name = name_of_dirname(directory.name)
    if name is None:
        raise CorruptionError(f"stream directory {directory.name} has no meta file")
    return name, 0, StreamConfig()


def decode_meta(raw: bytes) -> tuple[str, int, StreamConfig]:
    if raw[:4] != _META_MAGIC or len(raw) < 8:
        raise CorruptionError("stream metadata has a bad magic")
    body = raw[8:]
    if struct.unpack_from("<I", raw, 4)[0] != crc32c(body):
        raise CorruptionError("stream metadata CRC mismatch")
    data = json.loads(body)
    return data["name"], int(data["first_offset"]), StreamConfig.from_dict(data["config"])
