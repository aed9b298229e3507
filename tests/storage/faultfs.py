"""A fault-injecting, in-memory `FileSystem` for crash, fsync-failure and disk-full tests.

It has the interface of `storage.fs.FileSystem` and keeps every file in memory.
Each file (an inode) holds two images:

- `data`: what the page cache holds, what reads see, what survives kill -9;
- `durable`: what is on the platter, what survives a power loss.

Every write goes to `data` at once and is recorded as *pending* until the file
is synced; a sync applies the pending writes to `durable`. Directory changes
(create, rename, remove) are likewise pending until `sync_dir` of their
directory; `sync_filesystem` (syncfs) makes everything pending durable at once.
The composite operations (`create_segment`, `create_pack`, `write_file_atomic`,
`remove`, `rename`, `makedirs`, `remove_tree`) are built from these primitives
in exactly the order the real `FileSystem` uses them, so a crash can fall
between any two of their steps.

Crash points. Every file, directory and file-system sync is a *sync point*
(numbered from 1 in `syncs`); every segment or file write is a *write point*
(`writes`). A pack file (`create_pack`, `open_pack`) is one file many streams' slots share:
each of its writes is pending by its byte range, so a crash keeps or loses each slot's apart.
A test can

- raise `Crash` at sync point k or write point k (`crash_at_sync`, `crash_at_write`);
- run a hook at each point (`on_sync`, `on_write`) that snapshots the post-crash
  state with `crashed_copy` and lets the workload go on (SQLite's approach,
  many crash states from one run);
- make sync point k fail (`fail_at_sync`), as an fsync returning EIO: the
  file's pending writes are then lost for good (fsyncgate) while `data` keeps them;
- switch the disk to full (`disk_full`, or `capacity_bytes`), so segment creation
  and atomic file writes raise `DiskFullError` as the real file system does.

`crashed_copy(rng, mode)` builds the state a restart would find, as a new FaultFS:

- "process" (kill -9): the page cache survives; every write and directory change is kept;
  with `torn_inflight`, a write that was under way keeps a random prefix; with
  `written_back=False`, what was pending stays pending (the restart came before the kernel
  wrote the dirty pages back: a power loss after it may still take them).
- "power": each pending write is kept, dropped, garbled (random bytes) or torn at
  512-byte sector boundaries (a random subset of the sectors it touches reaches the
  disk); pending directory changes are applied up to a random point (journal order).
- "lost": nothing pending survives (the worst power loss, deterministic).

`boot_id()` is "process" mode's after a crash, and a new one after "power" and "lost" (the
machine went down with its page cache).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from storage.errors import CorruptionError, DiskFullError, DurabilityError
from storage.fs import SEGMENT_MIN_BYTES

SECTOR_BYTES = 512
FATES = ("keep", "drop", "garble", "torn")


class Crash(BaseException):
    """Raised at an armed crash point. A BaseException, so no `except Exception` in the engine eats it."""


@dataclass(frozen=True, slots=True)
class PendingWrite:
    """One write not yet synced, as a crash `fate` callback sees it."""

    path: str  # the file's path when it was written
    inode: int  # serial number of the file
    index: int  # position among the writes pending on this file
    pos: int
    data: bytes
    resize: bool = False  # a preallocation (file size change), never garbled or torn


class _Inode:
    __slots__ = ("data", "durable", "pending", "serial")

    def __init__(self, serial: int, content: bytes = b"") -> None:
        self.serial = serial
        self.data = bytearray(content)
        self.durable = bytearray(content)
        self.pending: list[tuple[str, int, bytes, bool]] = []  # (path, pos, data, resize)


class _Dir:
    __slots__ = ("durable", "entries", "serial")

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self.entries: dict[str, _Inode | _Dir] = {}  # live
        self.durable: dict[str, _Inode | _Dir] = {}  # as of its last sync


def _apply(buf: bytearray, pos: int, data: bytes | bytearray) -> None:
    if pos > len(buf):
        buf.extend(bytes(pos - len(buf)))
    buf[pos : pos + len(data)] = data


def _resize(buf: bytearray, size: int) -> None:
    if size > len(buf):
        buf.extend(bytes(size - len(buf)))
    else:
        del buf[size:]


def _make_durable(inode: _Inode) -> None:
    """A sync of the file: its pending writes and size changes reach `durable`."""
    for _, pos, data, resize in inode.pending:
        if resize:
            _resize(inode.durable, pos)
        else:
            _apply(inode.durable, pos, data)
    inode.pending.clear()


class FaultSegmentFile:
    """The SegmentFile of FaultFS: read, write, sync, close, size, path."""

    def __init__(self, fs: FaultFS, inode: _Inode, path: Path, writable: bool) -> None:
        self._fs = fs
        self._inode = inode
        self.path = path
        self.size = len(inode.data)
        self.reserved = self.size  # memory has no sparse files: every byte of it is there
        self.writable = writable
        self.closed = False
        self.mapped = True  # as a mapped file: its close goes to the cache's closer thread
        self._serial = fs._new_serial()

    # Deterministic set order: the engine keeps dirty files in a set, and the order of
    # syncs must not depend on memory addresses, or crash point k would move between runs.
    def __hash__(self) -> int:
        return self._serial

    def _check(self) -> None:
        if self.closed:
            raise ValueError(f"I/O on closed segment file {self.path}")

    def read(self, pos: int, length: int) -> bytes:
        self._check()
        return bytes(self._inode.data[pos : pos + length])

    def write(self, pos: int, data: bytes) -> None:
        self._check()
        if not self.writable:
            raise TypeError("mmap can't modify a readonly memory map.")
        if pos < 0 or pos + len(data) > self.size:
            raise IndexError("mmap slice assignment is wrong size")
        self._fs._write(self._inode, self.path, pos, bytes(data))

    def reserve(self, size: int) -> None:
        self._check()
        if size > self.size:
            self._fs._grow(self._inode, self.path, size)
            self.size = self.reserved = size

    def sync(self) -> None:
        if self.closed:
            return  # as the real one: a closed (deleted) segment needs nothing
        try:
            self._fs._sync_inode(self._inode, self.path)
        except OSError as exc:
            raise DurabilityError(f"fdatasync of {self.path} failed: {exc}") from exc

    def close(self) -> None:
        self.closed = True


class FaultAppendFile:
    """An O_APPEND file of a FaultFS: each append a write point, pending until synced."""

    def __init__(self, fs: FaultFS, inode: _Inode, path: Path) -> None:
        self._fs, self._inode, self._path = fs, inode, path

    def append(self, data: bytes) -> None:
        fs = self._fs
        with fs._lock:
            fs._check_space(len(data), f"write {self._path.name}")
            fs._write(self._inode, self._path, len(self._inode.data), data)

    def sync(self) -> None:
        try:
            self._fs._sync_inode(self._inode, self._path)
        except OSError as exc:
            raise DurabilityError(f"fdatasync of {self._path} failed: {exc}") from exc

    def close(self) -> None:
        pass


class FaultPackFile:
    """The PackFile of a FaultFS: each write a write point, pending by byte range until a sync,
    so a crash keeps or loses each slot's writes apart from its neighbours' in the same file."""

    def __init__(self, fs: FaultFS, inode: _Inode, path: Path) -> None:
        self._fs = fs
        self._inode = inode
        self.path = path
        self.size = len(inode.data)

    def read(self, pos: int, length: int) -> bytes:
        with self._fs._lock:
            return bytes(self._inode.data[pos : pos + length])

    def write(self, pos: int, data: bytes | bytearray) -> None:
        if pos + len(data) > self.size:
            raise DurabilityError(f"write past the end of pack {self.path.name}")
        self._fs._write(self._inode, self.path, pos, bytes(data))

    def grow(self, size: int) -> None:
        if size > self.size:
            self._fs._grow(self._inode, self.path, size)  # DiskFullError: nothing changed
            self.size = size

    def sync(self) -> None:
        try:
            self._fs._sync_inode(self._inode, self.path)
        except OSError as exc:
            raise DurabilityError(f"fdatasync of {self.path} failed: {exc}") from exc

    def close(self) -> None:
        pass


class FaultFS:
    """In-memory file system with crash, fsync-failure and disk-full injection (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._serials = 0
        self.root = self._new_dir()
        self._pending_dirs: list[tuple[_Dir, tuple[tuple[str, _Inode | _Dir | None], ...]]] = []
        self._inflight: tuple[_Inode, int, bytes] | None = None
        self.syncs = 0
        self.writes = 0
        self.written: list[Path] = []  # the file of each write, in order
        self.crash_at_sync: int | None = None
        self.crash_at_write: int | None = None
        self.fail_at_sync: int | None = None
        self.failed_syncs = 0
        self.on_sync: Callable[[FaultFS], None] | None = None
        self.on_write: Callable[[FaultFS], None] | None = None
        self.disk_full = False
        self.capacity_bytes: int | None = None
        self.boot = 0  # boot_id()'s number: a power loss is a new boot

    # ------------------------------------------------------------------ internals

    def _new_serial(self) -> int:
        self._serials += 1
        return self._serials

    def _new_dir(self) -> _Dir:
        return _Dir(self._new_serial())

    def _lookup(self, path: Path) -> _Inode | _Dir | None:
        node: _Inode | _Dir | None = self.root
        for part in PurePosixPath(path).parts[1:]:
            if not isinstance(node, _Dir):
                return None
            node = node.entries.get(part)
        return node

    def _dir(self, path: Path) -> _Dir:
        node = self._lookup(path)
        if not isinstance(node, _Dir):
            raise FileNotFoundError(errno.ENOENT, "no such directory", str(path))
        return node

    def _file(self, path: Path) -> _Inode:
        node = self._lookup(path)
        if not isinstance(node, _Inode):
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        return node

    def _dir_op(self, directory: _Dir, *changes: tuple[str, _Inode | _Dir | None]) -> None:
        """Change live entries now; the change is durable once the directory is synced."""
        for name, node in changes:
            if node is None:
                directory.entries.pop(name, None)
            else:
                directory.entries[name] = node
        self._pending_dirs.append((directory, changes))

    def _sync_point(self, what: str) -> None:
        """Count a sync point; crash or fail there if armed. Called before the sync takes effect."""
        self.syncs += 1
        if self.on_sync is not None:
            self.on_sync(self)
        if self.crash_at_sync == self.syncs:
            raise Crash(f"crash at sync point {self.syncs} ({what})")
        if self.fail_at_sync == self.syncs:
            self.failed_syncs += 1
            raise OSError(errno.EIO, f"injected I/O error at sync point {self.syncs}", what)

    def _write(self, inode: _Inode, path: Path, pos: int, data: bytes) -> None:
        with self._lock:
            self.writes += 1
            self.written.append(path)
            self._inflight = (inode, pos, data)
            try:
                if self.on_write is not None:
                    self.on_write(self)
                if self.crash_at_write == self.writes:
                    raise Crash(f"crash at write point {self.writes} ({path}, {len(data)} bytes at {pos})")
            finally:
                self._inflight = None
            _apply(inode.data, pos, data)
            inode.pending.append((str(path), pos, data, False))

    def _grow(self, inode: _Inode, path: Path, size: int) -> None:
        """posix_fallocate past the end: the new length is pending until the file is synced."""
        with self._lock:
            self._check_space(size - len(inode.data), f"grow segment {path.name}")
            _resize(inode.data, size)
            inode.pending.append((str(path), size, b"", True))

    def _sync_inode(self, inode: _Inode, path: Path) -> None:
        with self._lock:
            try:
                self._sync_point(f"fsync {path}")
            except OSError:
                inode.pending.clear()  # fsyncgate: the dirty pages are dropped, never written
                raise
            _make_durable(inode)

    def _used_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        stack: list[_Inode | _Dir] = [self.root]
        while stack:
            node = stack.pop()
            if isinstance(node, _Dir):
                stack.extend(node.entries.values())
            elif node.serial not in seen:
                seen.add(node.serial)
                total += len(node.data)
        return total

    def _check_space(self, nbytes: int, what: str) -> None:
        if self.disk_full or (
            self.capacity_bytes is not None and self._used_bytes() + nbytes > self.capacity_bytes
        ):
            raise DiskFullError(f"no space to {what} ({nbytes} bytes)")

    # ------------------------------------------------------------------ the FileSystem interface

    def create_segment(
        self, path: Path, size: int, header: bytes, *, durable: bool = True
    ) -> FaultSegmentFile:
        with self._lock:
            return FaultSegmentFile(
                self, self._create_reserved(path, size, header, durable), path, writable=True
            )

    def _create_reserved(self, path: Path, size: int, header: bytes, durable: bool) -> _Inode:
        """A new file of `size` allocated bytes starting with `header`, as the real one makes a
        segment or a pack (`durable`: file and directory synced)."""
        parent = self._dir(path.parent)
        if path.name in parent.entries:
            raise FileExistsError(errno.EEXIST, "file exists", str(path))
        self._check_space(size, f"create {path.name}")
        inode = _Inode(self._new_serial())
        self._dir_op(parent, (path.name, inode))  # O_CREAT | O_EXCL
        _resize(inode.data, size)  # posix_fallocate
        inode.pending.append((str(path), size, b"", True))
        self._write(inode, path, 0, bytes(header))  # pwrite of the header
        if durable:
            self._sync_inode(inode, path)  # os.fsync
            self.sync_dir(path.parent)
        return inode

    def create_pack(self, path: Path, size: int, header: bytes) -> FaultPackFile:
        with self._lock:
            return FaultPackFile(self, self._create_reserved(path, size, header, durable=True), path)

    def open_pack(self, path: Path) -> FaultPackFile:
        with self._lock:
            try:
                inode = self._file(path)
            except FileNotFoundError as exc:  # as the real one: open(2) fails
                raise DurabilityError(f"cannot open pack {path.name}: {exc}") from exc
            return FaultPackFile(self, inode, path)

    def read_head(self, path: Path, length: int) -> bytes:
        with self._lock:
            return bytes(self._file(path).data[:length])

    def open_segment(self, path: Path, writable: bool) -> FaultSegmentFile:
        with self._lock:
            inode = self._file(path)
            if len(inode.data) < SEGMENT_MIN_BYTES:
                raise CorruptionError(f"segment {path.name} is shorter than its header")
            return FaultSegmentFile(self, inode, path, writable)

    def write_file_atomic(
        self,
        path: Path,
        data: bytes | Iterable[bytes],
        *,
        head: Callable[[int], bytes] | None = None,
    ) -> None:
        parts = (data,) if isinstance(data, bytes | bytearray | memoryview) else data
        with self._lock:
            parent = self._dir(path.parent)
            tmp = path.with_name(path.name + ".tmp")
            inode = _Inode(self._new_serial())
            self._dir_op(parent, (tmp.name, inode))  # O_CREAT | O_TRUNC
            try:
                size = len(head(0)) if head is not None else 0
                for part in parts:  # each a write(2) as it comes, as the real one
                    self._check_space(len(part), f"write {path.name}")
                    self._write(inode, tmp, size, bytes(part))
                    size += len(part)
                if head is not None:
                    first = head(size)
                    self._check_space(len(first), f"write {path.name}")
                    self._write(inode, tmp, 0, first)
                self._sync_inode(inode, tmp)
            except Exception:
                self._dir_op(parent, (tmp.name, None))  # as the real one: unlink the temporary file
                raise
            self._dir_op(parent, (path.name, inode), (tmp.name, None))  # os.replace
            self.sync_dir(path.parent)

    def write_file(self, path: Path, data: bytes) -> None:
        with self._lock:
            parent = self._dir(path.parent)
            self._check_space(len(data), f"write {path.name}")
            inode = _Inode(self._new_serial())
            self._dir_op(parent, (path.name, inode))  # O_CREAT | O_TRUNC
            self._write(inode, path, 0, bytes(data))

    def overwrite_file(self, path: Path, data: bytes) -> None:
        with self._lock:
            inode = self._lookup(path)
            if not isinstance(inode, _Inode):
                parent = self._dir(path.parent)
                self._check_space(len(data), f"write {path.name}")
                inode = _Inode(self._new_serial())
                self._dir_op(parent, (path.name, inode))  # O_CREAT
            self._write(inode, path, 0, bytes(data))

    def write_at(self, path: Path, pos: int, data: bytes) -> None:
        with self._lock:
            try:
                inode = self._file(path)
            except FileNotFoundError as exc:  # as the real one: open(2) fails
                raise DurabilityError(f"cannot write {path.name}: {exc}") from exc
            if pos + len(data) > len(inode.data):
                raise DurabilityError(f"write past the end of {path.name}")
            self._write(inode, path, pos, bytes(data))

    def commit_file(self, src: Path, dst: Path) -> None:
        with self._lock:
            parent = self._dir(src.parent)
            inode = self._file(src)
            try:
                self._sync_inode(inode, src)  # fsync
            except OSError as exc:
                raise DurabilityError(f"cannot commit {src.name}: {exc}") from exc
            self._dir_op(parent, (dst.name, inode), (src.name, None))  # os.replace

    def sync_file(self, path: Path) -> None:
        with self._lock:
            try:
                self._sync_inode(self._file(path), path)
            except (OSError, FileNotFoundError) as exc:
                raise DurabilityError(f"fdatasync of {path} failed: {exc}") from exc

    def boot_id(self) -> str:
        return f"boot-{self.boot}"

    def create_append(self, path: Path, head: bytes) -> FaultAppendFile:
        with self._lock:
            parent = self._dir(path.parent)
            self._check_space(len(head), f"write {path.name}")
            inode = _Inode(self._new_serial())
            self._dir_op(parent, (path.name, inode))  # O_CREAT | O_TRUNC
            self._write(inode, path, 0, head)
            return FaultAppendFile(self, inode, path)

    def create_marker(self, path: Path) -> None:
        with self._lock:
            parent = self._dir(path.parent)
            if path.name not in parent.entries:
                self._dir_op(parent, (path.name, _Inode(self._new_serial())))  # O_CREAT, no sync

    def read_file(self, path: Path) -> bytes:
        with self._lock:
            return bytes(self._file(path).data)

    def exists(self, path: Path) -> bool:
        with self._lock:
            return self._lookup(path) is not None

    def listdir(self, path: Path) -> list[str]:
        with self._lock:
            node = self._lookup(path)
            return sorted(node.entries) if isinstance(node, _Dir) else []

    def entries(self, path: Path) -> set[str]:
        return set(self.listdir(path))

    def makedirs(self, path: Path, *, durable: bool = True) -> None:
        with self._lock:
            if isinstance(self._lookup(path), _Dir):
                return
            node = self.root
            for part in PurePosixPath(path).parts[1:]:
                child = node.entries.get(part)
                if child is None:
                    child = self._new_dir()
                    self._dir_op(node, (part, child))
                elif not isinstance(child, _Dir):
                    raise FileExistsError(errno.EEXIST, "not a directory", str(path))
                node = child
            if durable:
                self.sync_dir(path.parent)

    def remove(self, path: Path) -> None:
        with self._lock:
            parent = self._lookup(path.parent)
            if isinstance(parent, _Dir) and path.name in parent.entries:
                self._dir_op(parent, (path.name, None))
            self.sync_dir(path.parent)

    def rename(self, src: Path, dst: Path) -> None:
        with self._lock:
            self._replace(src, dst)
            self.sync_dir(dst.parent)

    def _replace(self, src: Path, dst: Path) -> None:
        if src.parent != dst.parent:
            raise NotImplementedError("FaultFS renames within one directory only")
        parent = self._dir(src.parent)
        node = parent.entries.get(src.name)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(src))
        self._dir_op(parent, (dst.name, node), (src.name, None))  # os.replace

    def remove_tree(self, path: Path) -> None:
        with self._lock:
            node = self._lookup(path)
            if isinstance(node, _Dir):
                for name in sorted(node.entries):
                    self._dir_op(node, (name, None))
                self._dir_op(self._dir(path.parent), (path.name, None))
            self.sync_dir(path.parent)

    def sync_dir(self, path: Path) -> None:
        with self._lock:
            directory = self._dir(path)
            self._sync_point(f"sync_dir {path}")
            directory.durable = dict(directory.entries)
            self._pending_dirs = [op for op in self._pending_dirs if op[0] is not directory]

    def replace(self, src: Path, dst: Path) -> None:
        with self._lock:
            try:
                self._replace(src, dst)  # no sync
            except FileNotFoundError as exc:
                raise DurabilityError(f"cannot rename {src.name}: {exc}") from exc

    def sync_filesystem(self, path: Path) -> None:
        """syncfs(2): one sync point after which every inode's and directory's pending state is
        durable (this FaultFS is one file system). A crash at it keeps what a power loss keeps of
        each pending change; a failure (EIO) makes nothing durable (which files' pages the kernel
        dropped syncfs does not say: the engine counts every file of the batch lost)."""
        with self._lock:
            self._dir(path)
            try:
                self._sync_point(f"syncfs {path}")
            except OSError as exc:
                raise DurabilityError(f"syncfs of {path} failed: {exc}") from exc
            for inode in self._all_inodes():
                _make_durable(inode)
            for directory in self._all_dirs():
                directory.durable = dict(directory.entries)
            self._pending_dirs = []

    # ------------------------------------------------------------------ helpers for tests

    def prepare_dir(self, path: Path) -> None:
        """Create a directory and its parents durably, outside the counts: a data directory that exists."""
        with self._lock:
            node = self.root
            for part in PurePosixPath(path).parts[1:]:
                child = node.entries.get(part)
                if child is None:
                    child = node.entries[part] = self._new_dir()
                    node.durable[part] = child
                node = child

    def load(self, source: Path, path: Path) -> None:
        """Copy the real directory tree `source` to `path` here, durably and outside the counts.

        The inverse of `export`: a data directory that was on disk before the process started.
        """
        with self._lock:
            self.prepare_dir(path)
            for directory, subdirs, files in os.walk(source):
                here = path / Path(directory).relative_to(source)
                for name in subdirs:
                    self.prepare_dir(here / name)
                parent = self._dir(here)
                for name in files:
                    inode = _Inode(self._new_serial(), (Path(directory) / name).read_bytes())
                    parent.entries[name] = parent.durable[name] = inode

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Hold every file operation of every thread until the block ends.

        A crash image taken inside (`crashed_copy`) stays the last state: no write or sync
        can happen after it, or its acknowledgement reach a client, while the block runs.
        """
        with self._lock:
            yield

    def export(self, path: Path, dest: Path) -> None:
        """Write the live tree under `path` into the real directory `dest` (for offline tools)."""
        with self._lock:
            stack = [(self._dir(path), dest)]
            while stack:
                directory, target = stack.pop()
                target.mkdir(parents=True, exist_ok=True)
                for name, node in directory.entries.items():
                    if isinstance(node, _Dir):
                        stack.append((node, target / name))
                    else:
                        (target / name).write_bytes(bytes(node.data))

    def file_bytes(self, path: Path) -> bytes:
        """The live content of a file."""
        with self._lock:
            return bytes(self._file(path).data)

    def poke(self, path: Path, pos: int, data: bytes) -> None:
        """Overwrite bytes of a file durably, outside any accounting (to simulate media damage)."""
        with self._lock:
            inode = self._file(path)
            _apply(inode.data, pos, data)
            _apply(inode.durable, pos, data)

    def pending_growths(self) -> int:
        """Files grown (a segment's growth step) whose new length is not yet synced."""
        with self._lock:
            return sum(any(p[3] for p in inode.pending) for inode in self._all_inodes())

    def pending_writes(self) -> int:
        with self._lock:
            return sum(len(inode.pending) for inode in self._all_inodes())

    def _all_inodes(self) -> list[_Inode]:
        out: dict[int, _Inode] = {}
        stack: list[_Inode | _Dir] = [self.root]
        for directory, changes in self._pending_dirs:
            stack.append(directory)
            stack.extend(node for _, node in changes if node is not None)
        seen_dirs: set[int] = set()
        while stack:
            node = stack.pop()
            if isinstance(node, _Dir):
                if node.serial in seen_dirs:
                    continue
                seen_dirs.add(node.serial)
                stack.extend(node.entries.values())
                stack.extend(node.durable.values())
            else:
                out[node.serial] = node
        return [out[k] for k in sorted(out)]

    # ------------------------------------------------------------------ crashes

    def crashed_copy(
        self,
        rng: random.Random | None = None,
        mode: str = "power",
        *,
        fate: Callable[[PendingWrite], str] | None = None,
        dir_ops_kept: int | None = None,
        weights: tuple[float, float, float, float] = (0.45, 0.35, 0.1, 0.1),
        torn_inflight: bool = False,
        written_back: bool = True,
    ) -> FaultFS:
        """The state a restart finds after a crash now, as a new FaultFS (this one is untouched).

        mode: "process" (everything written survives), "power" (each pending write is kept,
        dropped, garbled or torn, at random or as `fate` says; a prefix of the pending
        directory changes survives, `dir_ops_kept` long or random), or "lost" (nothing pending
        survives). `torn_inflight` (process mode): a write under way keeps a random prefix.
        `written_back=False` (process mode): the pending writes and directory changes stay
        pending in the copy, over the durable state they had.
        """
        if mode not in ("process", "power", "lost"):
            raise ValueError(f"unknown crash mode {mode!r}")
        rng = rng or random.Random(0)
        with self._lock:
            # Directory entries after the crash, per directory object.
            if mode == "process":
                tables = {id(d): dict(d.entries) for d in self._all_dirs()}
            else:
                tables = {id(d): dict(d.durable) for d in self._all_dirs()}
                pending = self._pending_dirs
                if mode == "lost":
                    kept = 0
                elif dir_ops_kept is not None:
                    kept = min(dir_ops_kept, len(pending))
                else:
                    kept = rng.randint(0, len(pending))
                for directory, changes in pending[:kept]:
                    table = tables[id(directory)]
                    for name, node in changes:
                        if node is None:
                            table.pop(name, None)
                        else:
                            table[name] = node
            # File contents after the crash, per inode.
            contents: dict[int, bytearray] = {}
            for inode in self._all_inodes():
                if mode == "process":
                    content = bytearray(inode.data)
                    if torn_inflight and self._inflight is not None and self._inflight[0] is inode:
                        _, pos, data = self._inflight
                        _apply(content, pos, data[: rng.randint(0, len(data))])
                else:
                    content = bytearray(inode.durable)
                    if mode == "power":
                        for index, (path, pos, data, resize) in enumerate(inode.pending):
                            write = PendingWrite(path, inode.serial, index, pos, data, resize)
                            self._apply_fate(content, write, fate, rng, weights)
                contents[inode.serial] = content
            clone = FaultFS()
            clone.boot = self.boot if mode == "process" else self.boot + 1
            made: dict[int, _Inode | _Dir] = {}

            def build(node: _Inode | _Dir) -> _Inode | _Dir:
                key = node.serial
                if key in made:
                    return made[key]
                if isinstance(node, _Inode):
                    made[key] = new = _Inode(clone._new_serial(), bytes(contents[key]))
                    if keep_pending:
                        new.durable, new.pending = bytearray(node.durable), list(node.pending)
                    return new
                new_dir = clone.root if node is self.root else clone._new_dir()
                made[key] = new_dir
                for name, child in sorted(tables[id(node)].items()):
                    new_dir.entries[name] = build(child)
                if keep_pending:
                    new_dir.durable = {name: build(child) for name, child in sorted(node.durable.items())}
                else:
                    new_dir.durable = dict(new_dir.entries)
                return new_dir

            keep_pending = mode == "process" and not written_back
            build(self.root)
            if keep_pending:
                clone._pending_dirs = [
                    (build(directory), tuple((name, None if n is None else build(n)) for name, n in changes))
                    for directory, changes in self._pending_dirs
                ]
            return clone

    def _all_dirs(self) -> list[_Dir]:
        out: dict[int, _Dir] = {}
        stack: list[_Inode | _Dir] = [self.root]
        for directory, changes in self._pending_dirs:
            stack.append(directory)
            stack.extend(node for _, node in changes if node is not None)
        while stack:
            node = stack.pop()
            if isinstance(node, _Dir) and node.serial not in out:
                out[node.serial] = node
                stack.extend(node.entries.values())
                stack.extend(node.durable.values())
        return [out[k] for k in sorted(out)]

    @staticmethod
    def _apply_fate(
        content: bytearray,
        write: PendingWrite,
        fate: Callable[[PendingWrite], str] | None,
        rng: random.Random,
        weights: tuple[float, float, float, float],
    ) -> None:
        choice = fate(write) if fate is not None else rng.choices(FATES, weights)[0]
        if choice not in FATES:
            raise ValueError(f"unknown fate {choice!r}")
        if write.resize:
            if choice != "drop":
                _resize(content, write.pos)
            return
        if choice == "keep":
            _apply(content, write.pos, write.data)
        elif choice == "garble":
            _apply(content, write.pos, rng.randbytes(len(write.data)))
        elif choice == "torn":
            pos, data = write.pos, write.data
            first, last = pos // SECTOR_BYTES, (pos + len(data) - 1) // SECTOR_BYTES
            for sector in range(first, last + 1):
                if rng.random() < 0.5:
                    lo = max(pos, sector * SECTOR_BYTES)
                    hi = min(pos + len(data), (sector + 1) * SECTOR_BYTES)
                    _apply(content, lo, data[lo - pos : hi - pos])
