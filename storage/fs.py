"""File-system access for the engine, behind one small interface.

Everything the engine does to disk goes through a `FileSystem`, so tests can
swap in a fault-injecting implementation that records writes and simulates a
crash or power loss at any sync point. Segment bytes are written only through
`SegmentFile.write`, never by touching a mapping directly.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import ctypes.util
import errno
import functools
import itertools
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from storage.errors import CorruptionError, DiskFullError, DurabilityError
from storage.layout import TMP_SUFFIX

SEGMENT_MIN_BYTES = 64  # a segment header; anything shorter is a file whose creation a crash cut short
# A new segment this small (a new stream's first page) is written through with pwrite, not mapped:
# a mapping costs five system calls (fstat, dup, mmap, munmap, close) and a page fault per stream.
UNMAPPED_BYTES = 4096
# What a stream's reopening reads (its directory, meta file, markers, segments) is opened without
# an access-time update. Under `relatime` (the usual mount) the first read of a file or directory
# written since it was last read updates its atime, which dirties its inode: the inode's table
# block, if the kernel let it go from its cache, is then read from disk, queued behind what a
# syncfs is writing back (tens to hundreds of ms under a load: a reopen's tail, issue 17).
# O_NOATIME is for the file's owner (or CAP_FOWNER): another's file is opened without it.
_NOATIME = getattr(os, "O_NOATIME", 0)


class SyncTimes:
    """How long every file sync took, as cumulative histogram buckets (for the fsync latency metric)."""

    BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, math.inf)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * len(self.BUCKETS_S)
        self.total_s = 0.0
        self.count = 0

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                self._counts[bisect.bisect_left(self.BUCKETS_S, elapsed)] += 1
                self.total_s += elapsed
                self.count += 1

    def buckets(self) -> list[tuple[float, int]]:
        """(upper bound in seconds, syncs that took at most that long), Prometheus style."""
        with self._lock:
            return list(zip(self.BUCKETS_S, itertools.accumulate(self._counts), strict=True))


def _reserve(fd: int, path: Path, start: int, length: int) -> None:
    """Allocate the file's blocks in [start, start+length) (and extend it), so that a write into
    a mapping of them never meets a full disk: a full disk is DiskFullError here, not SIGBUS later."""
    try:
        os.posix_fallocate(fd, start, length)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"no space for {path.name} to reach {start + length} bytes") from exc
        raise DurabilityError(f"cannot reserve space in {path.name}: {exc}") from exc


def _allocated(fd: int, stat: os.stat_result) -> bool:
    """Whether the file has its blocks for every byte: no hole by the file system's account
    (SEEK_HOLE; one that cannot tell says the end) nor by its block count."""
    if stat.st_blocks * 512 < stat.st_size:
        return False
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) >= stat.st_size
    except OSError:
        return False


class SegmentFile:
    """A file mapped into memory: write at a position, read a range, grow, sync.

    It keeps no descriptor of its own: Python's mmap holds a duplicate of the one it was
    mapped from, so that one is closed at once and an open segment costs one descriptor,
    not two (a thousand open streams stay under the process's limit). Growing and syncing
    open the file for the call.

    A new file of at most UNMAPPED_BYTES (`content` given: its bytes) is not mapped until it
    grows past them: it keeps its descriptor (still one) and a copy of its bytes, which reads
    come from and writes go through to the file (pwrite).
    """

    def __init__(
        self,
        path: Path,
        fd: int,
        size: int,
        writable: bool,
        times: SyncTimes,
        reserved: int = 0,
        content: bytearray | None = None,
    ) -> None:
        self.path = path
        self.size = size
        self.reserved = reserved  # bytes known allocated on disk (reserve)
        self.writable = writable
        self._times = times
        self.closed = False
        self._map: mmap.mmap  # (absent while `_copy` stands for it)
        self._copy = content  # while not mapped: the file's bytes, written through with pwrite
        self._fd: int | None = fd if content is not None else None
        if content is not None:
            return
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        try:
            self._map = mmap.mmap(fd, size, access=access)
        finally:
            os.close(fd)

    @property
    def mapped(self) -> bool:
        """Whether the file is mapped (not a first page written through): its close unmaps it."""
        return self._copy is None

    def read(self, pos: int, length: int) -> bytes:
        copy = self._copy
        if copy is None:
            return self._map[pos : pos + length]
        return bytes(copy[pos : pos + length])

    def write(self, pos: int, data: bytes) -> None:
        copy = self._copy
        if copy is None:
            self._map[pos : pos + len(data)] = data
            return
        fd = self._fd
        if fd is None:
            raise DurabilityError(f"segment {self.path.name} is closed")
        try:
            os.pwrite(fd, data, pos)  # into blocks `reserve` allocated: a full disk cannot fail it
        except OSError as exc:
            raise DurabilityError(f"cannot write segment {self.path.name}: {exc}") from exc
        copy[pos : pos + len(data)] = data

    def reserve(self, size: int) -> None:
        """Make sure bytes [0, size) are allocated on disk and mapped, growing the file if needed.

        Blocks are reserved before they are mapped, so a write into the mapping never meets a
        full disk (SIGBUS): a full disk is DiskFullError here. A file opened from disk with a
        hole is reserved again from 0 before its first write, as a copy (cp, a restore) may have
        made its unwritten tail sparse (`FileSystem.open_segment`). The new length becomes
        durable with the next sync (fdatasync writes the size a read needs); a power loss before
        it leaves the shorter file, whose tail the recovery scan treats as unwritten.
        """
        if size <= self.reserved:
            return
        if self._copy is not None:
            self._grow_unmapped(size)
            return
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError as exc:
            raise DurabilityError(f"cannot open segment {self.path.name} to grow it: {exc}") from exc
        try:
            _reserve(fd, self.path, self.reserved, size - self.reserved)
        finally:
            os.close(fd)
        if size > self.size:
            self._map.resize(size)  # its ftruncate to the reserved length changes nothing
            self.size = size
        self.reserved = size

    def _grow_unmapped(self, size: int) -> None:
        """Reserve up to `size` with the file's own descriptor, then map the file (the copy's
        bytes are the file's: every write went through)."""
        fd = self._fd
        if fd is None:
            raise DurabilityError(f"segment {self.path.name} is closed")
        _reserve(fd, self.path, self.reserved, size - self.reserved)
        self.size = max(self.size, size)
        self.reserved = size
        try:
            self._map = mmap.mmap(fd, self.size, access=mmap.ACCESS_WRITE)
        except OSError as exc:
            raise DurabilityError(f"cannot map segment {self.path.name}: {exc}") from exc
        os.close(fd)
        self._fd = self._copy = None

    def sync(self) -> None:
        """Make every write so far durable; the GIL is released while it waits."""
        if self.closed:
            return  # the segment was deleted or replaced: nothing of it needs to last
        try:
            _fdatasync(self.path, self._times)
        except FileNotFoundError as exc:
            if self.closed:
                return  # deleted while this sync began (it was closed first)
            raise DurabilityError(f"segment {self.path} is gone: {exc}") from exc
        except OSError as exc:
            raise DurabilityError(f"cannot open {self.path} to sync it: {exc}") from exc

    def close(self) -> None:
        if self._copy is None:
            self._map.close()  # closing twice is harmless
        elif self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.closed = True


class AppendFile:
    """A file written only at its end (O_APPEND), each append one write(2), synced on demand.

    Its blocks are allocated APPEND_STEP bytes ahead, past its size (fallocate's KEEP_SIZE: the
    size stays what was written), so an append allocates none: ext4 allocates a delayed block
    under the file's i_data_sem, which the file's own write-back holds while it allocates, and a
    round's syncfs writes the file back behind the disk's queue (the catalog journal's appends,
    one per reopen and per close: tens of ms in D state, issue 17)."""

    APPEND_STEP = 1 << 20

    def __init__(self, fd: int, end: int) -> None:
        self._fd = fd
        self._end = end  # the file's size
        self._allocated = end  # blocks allocated up to here (at least)

    def append(self, data: bytes) -> None:
        end = self._end + len(data)
        if end > self._allocated:
            self._allocated = end + self.APPEND_STEP
            _allocate_ahead(self._fd, self._end, self._allocated - self._end)
        _write_all(self._fd, data)
        self._end = end

    def sync(self) -> None:
        """fdatasync: what was appended survives a power loss."""
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            raise DurabilityError(f"fdatasync of an append file failed: {exc}") from exc

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PackFile:
    """A file of slots shared by many streams (storage/packs.py): read and write at a position,
    grow, sync. It keeps its descriptor: a pack is written by every stream it holds."""

    def __init__(self, path: Path, fd: int, size: int, times: SyncTimes) -> None:
        self.path = path
        self.size = size  # bytes allocated (the file's length)
        self._fd = fd
        self._times = times

    def read(self, pos: int, length: int) -> bytes:
        """The bytes at [pos, pos+length), fewer past the file's end."""
        try:
            return os.pread(self._fd, length, pos)
        except OSError as exc:
            raise DurabilityError(f"cannot read pack {self.path.name}: {exc}") from exc

    def write(self, pos: int, data: bytes | bytearray) -> None:
        """One pwrite within the allocated length (`grow` made room: a full disk cannot fail it)."""
        if pos + len(data) > self.size:
            raise DurabilityError(f"write past the end of pack {self.path.name}")
        try:
            if os.pwrite(self._fd, data, pos) != len(data):
                raise OSError(errno.EIO, "short write")
        except OSError as exc:
            raise DurabilityError(f"cannot write pack {self.path.name}: {exc}") from exc

    def grow(self, size: int) -> None:
        """Allocate the file's blocks up to `size` (DiskFullError, the file unchanged, when the
        disk is full); the new length is durable with the next sync."""
        if size > self.size:
            _reserve(self._fd, self.path, self.size, size - self.size)
            self.size = size

    def sync(self) -> None:
        """fdatasync the file (the GIL is released while it waits)."""
        try:
            with self._times.timed():
                os.fdatasync(self._fd)
        except OSError as exc:
            raise DurabilityError(f"fdatasync of {self.path} failed: {exc}") from exc

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class FileSystem:
    """The real file system. Paths are `pathlib.Path` objects."""

    def __init__(self) -> None:
        self.sync_times = SyncTimes()
        self._boot_id: str | None = None

    def create_segment(self, path: Path, size: int, header: bytes, *, durable: bool = True) -> SegmentFile:
        """Create, preallocate and write the header of a segment, durably (unless not `durable`:
        a new stream's first segment, which its creation's commit syncs, storage/creation.py).

        Preallocation makes a full disk fail here and not as SIGBUS later. The
        header is synced with the file, so a segment that exists after a crash
        always names its base offset.
        """
        fd = self._create_reserved(path, size, header, durable)
        content = None
        if size <= UNMAPPED_BYTES:
            content = bytearray(size)
            content[: len(header)] = header
        return SegmentFile(path, fd, size, True, self.sync_times, reserved=size, content=content)

    def create_pack(self, path: Path, size: int, header: bytes) -> PackFile:
        """Create a pack file of `size` allocated bytes starting with `header`, durably (file and
        directory synced: a pack is made once per gigabyte of slots). A full disk is DiskFullError
        with no file left."""
        return PackFile(path, self._create_reserved(path, size, header, durable=True), size, self.sync_times)

    def _create_reserved(self, path: Path, size: int, header: bytes, durable: bool) -> int:
        """A descriptor of a new file of `size` allocated bytes starting with `header` (`durable`:
        file and directory synced); on any failure, no file is left."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _reserve(fd, path, 0, size)
            os.pwrite(fd, header, 0)
            if durable:
                os.fsync(fd)
        except (OSError, DiskFullError, DurabilityError) as exc:
            os.close(fd)
            os.unlink(path)
            if isinstance(exc, DiskFullError | DurabilityError):
                raise
            raise DurabilityError(f"cannot create {path.name}: {exc}") from exc
        if durable:
            self.sync_dir(path.parent)
        return fd

    def open_pack(self, path: Path) -> PackFile:
        """Open a pack file to read and write its slots; one with a hole is reserved again from 0
        (DiskFullError if it cannot be), so no slot write ever meets a full disk."""
        try:
            fd = _open_to_read(path, os.O_RDWR)
        except OSError as exc:
            raise DurabilityError(f"cannot open pack {path.name}: {exc}") from exc
        stat = os.fstat(fd)
        if not _allocated(fd, stat):  # copied sparse (cp, a restore): reserved again, as segments are
            try:
                _reserve(fd, path, 0, stat.st_size)
            except (DiskFullError, DurabilityError):
                os.close(fd)
                raise
        return PackFile(path, fd, stat.st_size, self.sync_times)

    def open_segment(self, path: Path, writable: bool) -> SegmentFile:
        """Map a segment. One with no hole counts as reserved: its first write after a reopen
        then needs no `posix_fallocate`, which waits for the file system's journal (behind
        any other stream's sync) to change nothing."""
        fd = _open_to_read(path, os.O_RDWR if writable else os.O_RDONLY)
        stat = os.fstat(fd)
        size = stat.st_size
        if size < SEGMENT_MIN_BYTES:
            os.close(fd)
            raise CorruptionError(f"segment {path.name} is {size} bytes, shorter than its header")
        reserved = size if writable and _allocated(fd, stat) else 0
        return SegmentFile(path, fd, size, writable, self.sync_times, reserved)

    def write_file_atomic(
        self,
        path: Path,
        data: bytes | Iterable[bytes],
        *,
        head: Callable[[int], bytes] | None = None,
    ) -> None:
        """Replace `path` with `data` so that a crash leaves either the old or the new file.

        `data` may come in parts, written as they come, so a big file is never whole in
        memory. `head(size)` gives the file's first bytes when they depend on its size
        (a segment header; its length must not): room is left for it before the parts,
        and it is written last. An exception from the parts leaves `path` as it was.
        """
        tmp = path.with_name(path.name + TMP_SUFFIX)
        parts = (data,) if isinstance(data, bytes | bytearray | memoryview) else data
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            size = len(head(0)) if head is not None else 0
            os.lseek(fd, size, os.SEEK_SET)
            for part in parts:
                _write_all(fd, part)
                size += len(part)
            if head is not None:
                os.lseek(fd, 0, os.SEEK_SET)
                _write_all(fd, head(size))
            os.fsync(fd)
        except BaseException as exc:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFullError(f"no space to write {path.name}") from exc
                raise DurabilityError(f"cannot write {path.name}: {exc}") from exc
            raise
        os.close(fd)
        os.replace(tmp, path)
        self.sync_dir(path.parent)

    def write_file(self, path: Path, data: bytes) -> None:
        """Create `path` holding `data`, with no sync (a new stream's meta file: storage/creation.py)."""
        self._write_unsynced(path, data, os.O_TRUNC)

    def overwrite_file(self, path: Path, data: bytes) -> None:
        """Write `data` at the start of `path` (created if need be) in place, with no truncation
        and no sync: a small record of fixed size (a stream's SYNCED marker) that its checksum
        guards against a torn write. Cheaper than O_TRUNC, which makes the file system drop and
        reallocate the file's blocks."""
        self._write_unsynced(path, data, 0)

    def write_at(self, path: Path, pos: int, data: bytes) -> None:
        """Write `data` at `pos` of an existing file, in place, with no sync (a segment's SYNCED
        slot, storage/cleanmark.py, written by path: the segment may be closed by then)."""
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(fd, data, pos)
            finally:
                os.close(fd)
        except OSError as exc:
            raise DurabilityError(f"cannot write {path.name}: {exc}") from exc

    def _write_unsynced(self, path: Path, data: bytes, flags: int) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(f"no space to write {path.name}") from exc
            raise DurabilityError(f"cannot write {path.name}: {exc}") from exc

    def commit_file(self, src: Path, dst: Path) -> None:
        """Sync `src`, then rename it to `dst` (the rename is durable with the directory's next sync)."""
        try:
            fd = os.open(src, os.O_RDONLY)
            try:
                with self.sync_times.timed():
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(src, dst)
        except OSError as exc:
            raise DurabilityError(f"cannot commit {src.name}: {exc}") from exc

    def create_append(self, path: Path, head: bytes) -> AppendFile:
        """A new file (replacing any there) holding `head`, open for appends; nothing synced."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        try:
            _write_all(fd, head)
        except OSError:
            os.close(fd)
            raise
        return AppendFile(fd, len(head))

    def boot_id(self) -> str:
        """The kernel's id of this boot: what was written under another one may not have survived
        (the page cache is lost with the machine, not with a process)."""
        if self._boot_id is None:
            self._boot_id = BOOT_ID.read_text().strip()
        return self._boot_id

    def create_marker(self, path: Path) -> None:
        """Create an empty file whose existence is the message; not synced (the caller's ordering
        makes it safe to lose)."""
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))

    def read_file(self, path: Path) -> bytes:
        """The file's bytes, read with the descriptor alone (a buffered file object costs four
        more system calls: a reopen reads a marker this way)."""
        fd = _open_to_read(path, os.O_RDONLY)
        try:
            want = os.fstat(fd).st_size + 1  # one read to its end, one to see the end
            chunks = []
            while chunk := os.read(fd, want):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def read_head(self, path: Path, length: int) -> bytes:
        fd = _open_to_read(path, os.O_RDONLY)
        try:
            return os.pread(fd, length, 0)
        finally:
            os.close(fd)

    def exists(self, path: Path) -> bool:
        return path.exists()

    def listdir(self, path: Path) -> list[str]:
        """The names in a directory, sorted; none if it is not there (no stat)."""
        try:
            fd = _open_to_read(path, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            return []
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def entries(self, path: Path) -> set[str]:
        """The names in a directory, unordered (the streams directory: a million, not sorted)."""
        try:
            return set(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def makedirs(self, path: Path, *, durable: bool = True) -> None:
        """Create `path` and missing parents, each made durable in its own parent (unless not
        `durable`: a new stream's directory, which its creation's commit syncs)."""
        if not durable:
            try:
                os.mkdir(path)  # one call for a new stream's directory, whose parent exists
                return
            except (FileExistsError, FileNotFoundError):
                pass  # the general way below
        missing = []
        while not path.is_dir():
            missing.append(path)
            path = path.parent
        for directory in reversed(missing):
            directory.mkdir(exist_ok=True)
            if durable:
                self.sync_dir(directory.parent)

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self.sync_dir(path.parent)

    def rename(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)
        self.sync_dir(dst.parent)

    def remove_tree(self, path: Path) -> None:
        """Remove a stream directory: its files, then itself."""
        for name in self.listdir(path):
            (path / name).unlink(missing_ok=True)
        if path.is_dir():
            path.rmdir()
        self.sync_dir(path.parent)

    def sync_file(self, path: Path) -> None:
        """fdatasync a file by its path (a segment closed since it was written: its dirty pages
        outlive its mapping in the page cache)."""
        try:
            _fdatasync(path, self.sync_times)
        except OSError as exc:
            raise DurabilityError(f"cannot open {path} to sync it: {exc}") from exc

    def replace(self, src: Path, dst: Path) -> None:
        """Rename `src` to `dst`, synced by nothing (durable with a later sync of the directory or
        of the file system: storage/handoff.py's batch)."""
        try:
            os.replace(src, dst)
        except OSError as exc:
            raise DurabilityError(f"cannot rename {src.name}: {exc}") from exc

    def sync_filesystem(self, path: Path) -> None:
        """syncfs(2) the file system holding `path`: every file's and directory's writes on it
        become durable, other processes' included (one call for many closed streams' fsyncs,
        storage/handoff.py). Linux only; DurabilityError if it fails."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise DurabilityError(f"cannot open {path} to sync its file system: {exc}") from exc
        try:
            with self.sync_times.timed():
                if _libc().syncfs(fd) != 0:
                    code = ctypes.get_errno()
                    raise DurabilityError(f"syncfs of {path} failed: {os.strerror(code)}")
        finally:
            os.close(fd)

    def sync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with self.sync_times.timed():
                os.fsync(fd)
        except OSError as exc:
            raise DurabilityError(f"fsync of directory {path} failed: {exc}") from exc
        finally:
            os.close(fd)


def _fdatasync(path: Path, times: SyncTimes) -> None:
    """fdatasync a file by its path, timed; OSError if it cannot be opened, DurabilityError if the
    sync fails (the GIL is released while it waits)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with times.timed():
            os.fdatasync(fd)
    except OSError as exc:
        raise DurabilityError(f"fdatasync of {path} failed: {exc}") from exc
    finally:
        os.close(fd)


def _open_to_read(path: Path, flags: int) -> int:
    """A descriptor opened with O_NOATIME if the file is ours (see _NOATIME), else without."""
    if _NOATIME:
        try:
            return os.open(path, flags | _NOATIME)
        except PermissionError:  # (EPERM: not the owner)
            pass
    return os.open(path, flags)


def _allocate_ahead(fd: int, start: int, length: int) -> None:
    """Allocate blocks for [start, start+length) without changing the file's size; where the file
    system cannot (no space, no such call), the writes allocate them as they go."""
    _libc().fallocate(fd, FALLOC_FL_KEEP_SIZE, start, length)


FALLOC_FL_KEEP_SIZE = 1


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, for the calls Python's os lacks (syncfs, fallocate with a mode); errno kept
    for the caller."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.syncfs.argtypes = [ctypes.c_int]
    libc.syncfs.restype = ctypes.c_int
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    libc.fallocate.restype = ctypes.c_int
    return libc


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    written = os.write(fd, data)  # (all of it, but for a signal or a full disk's last blocks)
    if written < len(data):
        view = memoryview(data)[written:]
        while view:
            view = view[os.write(fd, view) :]
