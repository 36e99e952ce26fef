"""File-system helpers of the local tier: durable creates and renames, ``O_DIRECT`` alignment and
bounce buffers, page-cache probing, and the background janitor that removes deleted directories.
See :mod:`tierckpt.tiers.local` for the tier itself.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import threading
from pathlib import Path

import numpy as np

from ..errors import TierError

__all__ = ["fsync_dir", "open_new", "drain_deletions", "willneed", "DIO_ALIGN", "PARTIAL", "TMP", "TRASH"]

log = logging.getLogger("tierckpt")

PARTIAL = ".partial"
TMP = ".tmp-"
TRASH = ".trash-"

DIO_ALIGN = max(4096, mmap.PAGESIZE)  # offsets, lengths and addresses of O_DIRECT transfers
DIRECT_READ_MIN = 1 << 20  # reads smaller than this stay buffered (page cache, readahead)
BOUNCE_SIZE = 8 << 20  # bytes per direct read into the bounce buffer
INPLACE_STEP = 64 << 20  # bytes per O_DIRECT read straight into an aligned destination (no bounce)
PREFETCH_MAX = 256 << 20  # a load announcing at most this much is prefetched and read buffered (LocalReads.prefetch)
DIRECT_WRITE_MIN = PREFETCH_MAX
"""Under ``direct_io = "auto"``, a data file smaller than this is written buffered (the sink opens
no ``O_DIRECT`` descriptor): it stays in the page cache, so a resume on this node soon after (a
restarted job, a load in the saving process) reads it from memory, as a framework's default
``torch.save`` file is. It is the size the loader reads buffered anyway (:data:`PREFETCH_MAX`), so
the page cache a save leaves is what its load would take. Larger files, and every file under
``direct_io = true``, go through ``O_DIRECT``. Read when a sink is opened (tests lower it)."""
PREFETCH_STEP = 2 << 20  # bytes per POSIX_FADV_WILLNEED call: Linux reads at most one readahead window per call
PREFETCH_GAP = 256 << 10  # announced ranges this close are prefetched as one
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOTTY)
_O_DIRECT = getattr(os, "O_DIRECT", 0)

_fallback_lock = threading.Lock()
_fallback_logged = False


def _log_fallback(path: Path, e: OSError) -> None:
    """The one log line per process saying direct I/O is off for a file system."""
    global _fallback_logged
    with _fallback_lock:
        first, _fallback_logged = not _fallback_logged, True
    (log.warning if first else log.debug)(
        "local tier: %s refuses O_DIRECT (%s): using buffered I/O there (set [local] direct_io = false to "
        "skip the probe)",
        path,
        e.strerror or e,
    )


def _address(mv: memoryview) -> int:
    """The memory address of a contiguous buffer's first byte."""
    return int(np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0])


class _Bounce:
    """Reused page-aligned buffers for direct reads (fresh memory is slow to touch: keep them)."""

    def __init__(self) -> None:
        self._free: list[tuple[mmap.mmap, memoryview, np.ndarray]] = []
        self._lock = threading.Lock()

    def take(self) -> tuple[mmap.mmap, memoryview, np.ndarray]:
        with self._lock:
            if self._free:
                return self._free.pop()
        mm = mmap.mmap(-1, BOUNCE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # Huge pages: a direct read then needs a few large device requests instead of one
            # per megabyte of 4 KiB pages (measured: ~2.5 vs ~1.2 GiB/s cold on a virtio disk).
            try:
                mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        return mm, memoryview(mm), np.frombuffer(mm, dtype=np.uint8)

    def give(self, b: tuple[mmap.mmap, memoryview, np.ndarray]) -> None:
        with self._lock:
            if len(self._free) < 16:
                self._free.append(b)
                return
        b[1].release()
        del b


_bounce = _Bounce()


def willneed(ranges: dict[Path, list[tuple[int, int]]], stop: threading.Event) -> None:
    """Ask the kernel to read ``ranges`` (per file, ``(start, end)`` byte ranges) into the page
    cache: ``POSIX_FADV_WILLNEED`` over the merged ranges (neighbours up to :data:`PREFETCH_GAP`
    apart taken as one), :data:`PREFETCH_STEP` bytes per call, since one call reads at most the
    device's readahead window. Each call submits reads and returns without waiting for them.
    Stops early once ``stop`` is set. A file that is absent or refuses the advice is skipped:
    prefetching is a hint, the reads that follow report what is wrong."""
    for path, spans in ranges.items():
        merged: list[list[int]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1] + PREFETCH_GAP:
                merged[-1][1] = max(merged[-1][1], b)
            elif b > a:
                merged.append([a, b])
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            for a, b in merged:
                for off in range(a, b, PREFETCH_STEP):
                    if stop.is_set():
                        return
                    os.posix_fadvise(fd, off, min(PREFETCH_STEP, b - off), os.POSIX_FADV_WILLNEED)
        except OSError as e:
            log.debug("prefetching %s: %s", path, e)
        finally:
            os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory, making renames and creations in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_new(path: Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode: int = 0o644) -> int:
    """``os.open`` a file to create, making its parent directories first. Deletions prune
    directories they leave empty, so one may vanish between the mkdir and the open: retried."""
    for attempt in range(8):
        try:
            # mkdir(exist_ok=True) itself raises FileExistsError when the directory it found
            # existing is pruned before it checks it: retried like a vanished directory
            path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(path, flags, mode)
        except (FileNotFoundError, FileExistsError) as e:
            if attempt == 7 or (isinstance(e, FileExistsError) and e.filename == str(path)):
                raise
    raise AssertionError("unreachable")


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _tier_error(e: OSError, what: str) -> TierError:
    hint = ""
    if e.errno == errno.ENOSPC:
        hint = " (disk full)"
    elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        hint = " (not writable)"
    err = TierError(e.errno or 0, f"{what}: {e.strerror or e}{hint}")
    return err


_mincore = None


def _libc_mincore():
    """libc's ``mincore`` through ctypes, or None where unavailable."""
    global _mincore
    if _mincore is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).mincore
            fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
            fn.restype = ctypes.c_int
            _mincore = fn
        except (OSError, AttributeError):
            _mincore = False
    return _mincore or None


def _cached(fd: int, offset: int) -> bool:
    """Whether the page of ``fd`` at ``offset`` is in the page cache (``mincore`` on a one-page
    private mapping: no I/O, no readahead, nothing cached as a side effect). Unknown: False."""
    import ctypes

    fn = _libc_mincore()
    if fn is None:
        return False
    page = mmap.PAGESIZE
    try:
        mm = mmap.mmap(fd, page, access=mmap.ACCESS_COPY, offset=offset - offset % mmap.ALLOCATIONGRANULARITY)
    except (OSError, ValueError):
        return False
    try:
        view = (ctypes.c_char * page).from_buffer(mm)  # the address only: no page is touched
        vec = ctypes.c_ubyte(0)
        rc = fn(ctypes.addressof(view), page, ctypes.byref(vec))
        del view
        return rc == 0 and bool(vec.value & 1)
    finally:
        mm.close()


class _Janitor:
    """One background thread removing renamed-away directories."""

    def __init__(self) -> None:
        self._q: queue.Queue[Path] = queue.Queue()
        self._pending: set[Path] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def remove(self, path: Path) -> None:
        with self._lock:
            if path in self._pending:
                return
            self._pending.add(path)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tierckpt-janitor", daemon=True)
                self._thread.start()
        self._q.put(path)

    def _run(self) -> None:
        import shutil

        if hasattr(os, "setpriority"):  # unlinking gigabytes is background work
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 10))
            except OSError:
                pass
        while True:
            path = self._q.get()
            shutil.rmtree(path, ignore_errors=True)
            with self._lock:
                self._pending.discard(path)

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every queued directory is gone (tests, shutdown)."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return
            time.sleep(0.01)


_janitor = _Janitor()


def drain_deletions(timeout: float = 600.0) -> None:
    """Block until directories deleted by :meth:`LocalTier.delete_prefix` are really gone (a no-op
    once the interpreter is tearing this module down)."""
    janitor = globals().get("_janitor")
    if janitor is not None:
        janitor.drain(timeout)
