"""The segment files of streams the open-stream cache closed, let go on a thread of their own
(issue 17).

Unmapping a segment and closing its descriptor is system work that the call which needed the
room should not wait for: `munmap` flushes the mapping from every core's TLB (an interrupt to
the other cores, slow on a virtual machine whose other core is busy), and it was the largest
share of what remained of a call to a closed stream's tail. The cache's close
(storage/engine.py) hands the stream's files over here once the stream is closed in every
other sense (synced or handed to the round, storage/handoff.py; its figures in the catalog);
a thread unmaps and closes them. A reopening meanwhile maps the files afresh: a shared
mapping's pages are the page cache's, the same for both. Files none of which is mapped (a small
stream's first page, written through) are closed at once: a close(2) each costs the caller less
than waking the thread, whose hand-over of the GIL cost about ten futex calls per stream.

At most BACKLOG closes wait, and one is being done: past that the caller closes its own, so
descriptors and mappings stay within `max_open_streams` plus BACKLOG + 1 streams' worth.
Without background threads (`EngineConfig.background` off: tests, tools) files are closed at
once.
"""

from __future__ import annotations

import logging
import queue
import threading

from storage.fs import SegmentFile

log = logging.getLogger("streamlog.storage")

BACKLOG = 8  # closed streams whose files may wait for the thread


class FileCloser:
    def __init__(self, threaded: bool) -> None:
        self._waiting: queue.Queue[list[SegmentFile] | None] = queue.Queue(BACKLOG)
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="streamlog-closer", daemon=True)
            self._thread.start()

    def close(self, files: list[SegmentFile]) -> None:
        """Unmap and close a closed stream's segment files, on the thread if one is mapped and the
        thread has room."""
        if self._thread is not None and any(file.mapped for file in files):
            try:
                self._waiting.put_nowait(files)
                return
            except queue.Full:
                pass
        _close_all(files)

    def stop(self) -> None:
        """Close every file waiting, then end the thread (the engine's close)."""
        if self._thread is not None:
            self._waiting.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (files := self._waiting.get()) is not None:
            _close_all(files)


def _close_all(files: list[SegmentFile]) -> None:
    for file in files:
        try:
            file.close()
        except OSError as exc:  # nothing of the stream depends on it: its data is in the page cache
            log.error("segment %s did not close: %s", file.path.name, exc)
