"""The local tier: a directory, usually on node-local NVMe, sometimes on a shared file system.

Large objects are written with ``os.pwrite`` at planned offsets by several threads into a
``.partial`` file, fsynced, then renamed into place; small objects go through a temp file,
fsync and rename (``if_absent``: ``os.link``, which fails if the target exists). The directory
is fsynced after each rename so that the rename itself is durable.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import uuid
from pathlib import Path
from typing import Iterator

from ..errors import CheckpointNotFound, CommitConflict, CorruptCheckpoint, TierError
from .base import DataSink, ObjectInfo, Tier, check_key

__all__ = ["LocalTier", "fsync_dir", "drain_deletions"]

PARTIAL = ".partial"
TMP = ".tmp-"
TRASH = ".trash-"


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
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return os.open(path, flags, mode)
        except FileNotFoundError:
            if attempt == 7:
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


class _FileSink(DataSink):
    def __init__(self, tier: "LocalTier", key: str, size: int) -> None:
        self._tier = tier
        self._final = tier._path(key)
        self._partial = self._final.with_name(self._final.name + PARTIAL)
        self._size = size
        self._closed = False
        self._aborted = False
        self._inflight = 0
        self._fd = -1
        self._state = threading.Lock()
        try:
            self._fd = open_new(self._partial)
            if size:
                try:
                    os.posix_fallocate(self._fd, 0, size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                    os.ftruncate(self._fd, size)
        except OSError as e:
            raise _tier_error(e, f"cannot create {self._partial}") from e

    def write_at(self, offset: int, data: memoryview) -> None:
        if offset < 0 or offset + len(data) > self._size:
            raise CorruptCheckpoint(f"{self._partial}: write [{offset}, {offset + len(data)}) past size {self._size}")
        mv = memoryview(data).cast("B") if data.format != "B" or data.ndim != 1 else data
        with self._state:
            if self._aborted or self._closed:
                raise TierError(errno.ECANCELED, f"{self._partial}: write after the sink was closed or aborted")
            self._inflight += 1
        try:
            while len(mv):
                n = os.pwrite(self._fd, mv, offset)
                mv = mv[n:]
                offset += n
        except OSError as e:
            raise _tier_error(e, f"cannot write {self._partial}") from e
        finally:
            with self._state:
                self._inflight -= 1
                last_out = self._aborted and self._inflight == 0
            if last_out:
                self._close_fd()

    def _close_fd(self) -> None:
        # Only once no write is in flight: a descriptor closed under a concurrent pwrite could be
        # reused by the next open() and receive the late write.
        with self._state:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        with self._state:
            if self._closed or self._aborted:
                return
            if self._inflight:
                raise TierError(errno.EBUSY, f"{self._partial}: close() while writes are in flight")
            self._closed = True
        try:
            if self._tier.fsync:
                os.fsync(self._fd)
            self._close_fd()
            os.replace(self._partial, self._final)
            if self._tier.fsync:
                fsync_dir(self._final.parent)
        except OSError as e:
            self.abort()
            raise _tier_error(e, f"cannot commit {self._final}") from e

    def abort(self) -> None:
        with self._state:
            if self._aborted:
                return
            self._aborted = True
            idle = self._inflight == 0
        if idle:
            self._close_fd()
        try:
            os.unlink(self._partial)
        except OSError:
            pass


class LocalTier(Tier):
    """A tier rooted at a directory. ``fsync=False`` skips fsyncs (tests, tmpfs)."""

    name = "local"
    cheap_listing = True

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True, node_local: bool = False) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self.fsync = fsync
        self.node_local = node_local
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        final = self._path(key)
        tmp = final.with_name(f"{TMP}{uuid.uuid4().hex}-{final.name}")
        try:
            with open(open_new(tmp), "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            if if_absent:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    raise CommitConflict(f"{final} already exists: another writer committed it") from None
                finally:
                    os.unlink(tmp)
            else:
                os.replace(tmp, final)
            if self.fsync:
                fsync_dir(final.parent)
        except OSError as e:
            _unlink_quietly(tmp)
            if isinstance(e, CommitConflict):
                raise
            raise _tier_error(e, f"cannot write {final}") from e

    def put_volatile(self, key: str, data: bytes) -> None:
        """Atomic replace without fsync (leases: they only matter while their holder lives)."""
        final = self._path(key)
        tmp = final.with_name(f"{TMP}{uuid.uuid4().hex}-{final.name}")
        try:
            with open(open_new(tmp), "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except OSError as e:
            _unlink_quietly(tmp)
            raise _tier_error(e, f"cannot write {final}") from e

    def free_bytes(self) -> int | None:
        import shutil

        p = self.root
        while not p.exists() and p != p.parent:
            p = p.parent
        try:
            return shutil.disk_usage(p).free
        except OSError:
            return None

    def open_sink(self, key: str, size: int) -> DataSink:
        return _FileSink(self, key, size)

    def upload_file(self, key: str, path: str, *, progress=None) -> None:
        """Copy a local file into this tier (``.partial``, fsync, rename)."""
        import shutil

        final = self._path(key)
        if Path(path).resolve() == final.resolve():
            return
        tmp = final.with_name(final.name + PARTIAL)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, tmp)
            if self.fsync:
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if self.fsync:
                fsync_dir(final.parent)
        except OSError as e:
            _unlink_quietly(tmp)
            raise _tier_error(e, f"cannot copy {path} to {final}") from e
        if progress is not None:
            progress(os.path.getsize(final))

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if end is None:
                    end = size
                if start < 0 or end < start or end > size:
                    raise CorruptCheckpoint(f"{path}: range [{start}, {end}) is outside the file ({size} bytes)")
                return os.pread(f.fileno(), end - start, start) if end > start else b""
        except FileNotFoundError:
            raise CheckpointNotFound(f"{path}: no such file") from None
        except CorruptCheckpoint:
            raise
        except OSError as e:
            raise _tier_error(e, f"cannot read {path}") from e

    def read_into(self, key: str, start: int, buf: memoryview) -> None:
        self.read_ranges(key, start, [buf])

    def read_ranges(self, key: str, start: int, bufs: "list[memoryview]") -> None:
        """Scatter-read one contiguous range into ``bufs`` with ``preadv`` (no intermediate copy)."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointNotFound(f"{path}: no such file") from None
        except OSError as e:
            raise _tier_error(e, f"cannot read {path}") from e
        try:
            size = os.fstat(fd).st_size
            total = sum(len(b) for b in bufs)
            if start < 0 or start + total > size:
                raise CorruptCheckpoint(f"{path}: range [{start}, {start + total}) is outside the file ({size} bytes)")
            pending = [b.cast("B") if (b.format != "B" or b.ndim != 1) else b for b in bufs if len(b)]
            off = start
            while pending:
                batch = pending[:512]
                n = os.preadv(fd, batch, off)
                if n <= 0:
                    raise CorruptCheckpoint(f"{path}: unexpected end of file at {off}")
                off += n
                while n and pending:
                    if n >= len(pending[0]):
                        n -= len(pending[0])
                        pending.pop(0)
                    else:
                        pending[0] = pending[0][n:]
                        n = 0
        except OSError as e:
            raise _tier_error(e, f"cannot read {path}") from e
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise CheckpointNotFound(f"{self._path(key)}: no such file") from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if not self.root.is_dir():
            return
        base = self.root
        start = base
        if "/" in prefix:
            start = base.joinpath(*prefix.rsplit("/", 1)[0].split("/"))
            if not start.is_dir():
                return
        for dirpath, dirs, files in os.walk(start):
            dirs[:] = [d for d in dirs if not d.startswith(TRASH)]
            for fn in files:
                if fn.startswith(TMP):
                    continue  # a small put in progress (or killed): never an object
                # ``.partial`` files (a large object being written, or left by a crash) are listed
                # under their own name so that cleanup can see half-written checkpoints.
                full = Path(dirpath) / fn
                key = full.relative_to(base).as_posix()
                if key.startswith(prefix):
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue
                    yield ObjectInfo(key, st.st_size, st.st_mtime)

    def list_dirs(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(TRASH))

    def delete(self, key: str) -> None:
        """Unlink one file, then remove the directories it leaves empty."""
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as e:
            raise _tier_error(e, f"cannot delete {path}") from e
        self._prune(path.parent)

    def _prune(self, d: Path) -> None:
        """Remove ``d`` and its parents up to the root while they are empty. A writer that
        creates a file in one meanwhile retries its mkdir (see :func:`open_new`)."""
        while d != self.root and d.is_relative_to(self.root):
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent

    def delete_many(self, keys: "list[str]") -> int:
        """Move exactly these files into a ``.trash-*`` directory at the root (one rename each,
        cheap and atomic), remove directories left empty, and let the background janitor unlink
        the bytes (slow for large files) at background priority."""
        trash: Path | None = None
        parents: set[Path] = set()
        n = 0
        for key in keys:
            p = self._path(key)
            if trash is None:
                trash = self.root / f"{TRASH}{uuid.uuid4().hex[:8]}"
                try:
                    trash.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise _tier_error(e, f"cannot delete {p}") from e
            try:
                os.rename(p, trash / f"{n:06d}-{p.name}")
            except FileNotFoundError:
                continue
            except OSError as e:
                raise _tier_error(e, f"cannot delete {p}") from e
            n += 1
            parents.add(p.parent)
        for d in sorted(parents, key=lambda d: -len(d.parts)):
            self._prune(d)  # only when empty: a save that started since keeps its directory
        if trash is not None:
            _janitor.remove(trash)
            for old in self.root.glob(f"{TRASH}*"):
                if old != trash:
                    _janitor.remove(old)
        return n

    def delete_prefix(self, prefix: str) -> int:
        """Delete a whole checkpoint directory (leftover ``.partial``/temp files included).

        The directory is renamed away (``.trash-*``, invisible to listings) at once and removed
        by a background thread: unlinking gigabytes takes seconds on some file systems, and the
        commit path should not wait for it. Leftover trash from an earlier process is removed too.
        """
        if not prefix.endswith("/"):
            raise ValueError(f"delete_prefix needs a prefix ending with '/', got {prefix!r}")
        d = self._path(prefix.rstrip("/"))
        if not d.is_dir():
            return 0
        n = sum(len(files) for _p, _d, files in os.walk(d))
        trash = d.with_name(f"{TRASH}{d.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(d, trash)
        except OSError as e:
            raise _tier_error(e, f"cannot delete {d}") from e
        _janitor.remove(trash)
        for old in d.parent.glob(f"{TRASH}*"):
            if old != trash:
                _janitor.remove(old)
        return n


class _Janitor:
    """One background thread removing renamed-away directories."""

    def __init__(self) -> None:
        self._q: "queue.Queue[Path]" = queue.Queue()
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
    """Block until directories deleted by :meth:`LocalTier.delete_prefix` are really gone."""
    _janitor.drain(timeout)
