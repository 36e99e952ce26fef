"""The local tier: a directory, usually on node-local NVMe, sometimes on a shared file system.

Large objects are written with ``os.pwrite`` at planned offsets by several threads into a
``.partial`` file, fsynced, then renamed into place; small objects go through a temp file,
fsync and rename (``if_absent``: ``os.link``, which fails if the target exists). The directory
is fsynced after each rename so that the rename itself is durable.

Direct I/O (``[local] direct_io``, default ``"auto"``): a sink opens the file twice, once with
``O_DIRECT``. Of each ``write_at`` the part that is aligned to :data:`DIO_ALIGN` in file offset,
length and memory address (all of a pool slot but the file's last partial block) goes through
the direct descriptor: no page-cache copy, almost no CPU. Whatever is not aligned (the file's
tail, writes from unaligned buffers such as restore's fetch) goes through the buffered one;
the two never touch the same page. Large reads of ranges that are not in the page cache
(probed with ``mincore``) use ``O_DIRECT`` into a reused aligned bounce buffer and one copy
to the destination. A file system that refuses ``O_DIRECT`` (``EINVAL`` at open or at the
first transfer) is used buffered from then on, logged once per process; with
``direct_io = true`` the refusal is an error instead. fsync, rename and commit are the same
in both modes.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import threading
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import CheckpointNotFound, CommitConflict, CorruptCheckpoint, TierError
from .base import DataSink, ObjectInfo, Tier, check_key

__all__ = ["LocalTier", "fsync_dir", "drain_deletions", "DIO_ALIGN"]

log = logging.getLogger("tierckpt")

PARTIAL = ".partial"
TMP = ".tmp-"
TRASH = ".trash-"

DIO_ALIGN = max(4096, mmap.PAGESIZE)  # offsets, lengths and addresses of O_DIRECT transfers
DIRECT_READ_MIN = 1 << 20  # reads smaller than this stay buffered (page cache, readahead)
BOUNCE_SIZE = 8 << 20  # bytes per direct read into the bounce buffer
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
        "skip the probe)", path, e.strerror or e)


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


class _FileSink(DataSink):
    """One ``.partial`` file written at planned offsets by several threads (see the module doc).

    ``write_at`` may run on several threads at once for disjoint ranges (the flush threads,
    restore's fetch workers) and blocks until the bytes are handed to the kernel (direct
    transfers: until the device has them); ``close`` fsyncs and renames; ``abort`` unlinks.
    """

    def __init__(self, tier: "LocalTier", key: str, size: int) -> None:
        self._tier = tier
        self._final = tier._path(key)
        self._partial = self._final.with_name(self._final.name + PARTIAL)
        self._size = size
        self._closed = False
        self._aborted = False
        self._inflight = 0
        self._fd = -1
        self._dfd = -1  # the O_DIRECT descriptor, or -1 (off, refused, or nothing to write aligned)
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
            if size >= DIO_ALIGN:
                self._dfd = tier._open_direct(self._partial, os.O_WRONLY)
        except OSError as e:
            created = self._fd >= 0
            self._close_fd()
            if created:
                try:
                    os.unlink(self._partial)
                except OSError:
                    pass
            if isinstance(e, TierError):
                raise
            raise _tier_error(e, f"cannot create {self._partial}") from e

    @property
    def direct(self) -> bool:
        """Whether aligned writes currently go through ``O_DIRECT``."""
        return self._dfd >= 0 and self._tier._direct_ok is not False

    def write_at(self, offset: int, data: memoryview) -> None:
        if offset < 0 or offset + len(data) > self._size:
            raise CorruptCheckpoint(f"{self._partial}: write [{offset}, {offset + len(data)}) past size {self._size}")
        mv = memoryview(data).cast("B") if data.format != "B" or data.ndim != 1 else data
        with self._state:
            if self._aborted or self._closed:
                raise TierError(errno.ECANCELED, f"{self._partial}: write after the sink was closed or aborted")
            self._inflight += 1
        try:
            n = len(mv)
            head = (-offset) % DIO_ALIGN
            if n - head >= DIO_ALIGN and self.direct and (_address(mv) + head) % DIO_ALIGN == 0:
                mid = (n - head) // DIO_ALIGN * DIO_ALIGN
                self._pwrite(self._fd, mv[:head], offset)
                done = self._pwrite_direct(mv[head : head + mid], offset + head)
                self._pwrite(self._fd, mv[head + done :], offset + head + done)
            else:
                self._pwrite(self._fd, mv, offset)
        except TierError:
            raise
        except OSError as e:
            raise _tier_error(e, f"cannot write {self._partial}") from e
        finally:
            with self._state:
                self._inflight -= 1
                last_out = self._aborted and self._inflight == 0
            if last_out:
                self._close_fd()

    @staticmethod
    def _pwrite(fd: int, mv: memoryview, offset: int) -> None:
        while len(mv):
            n = os.pwrite(fd, mv, offset)
            mv = mv[n:]
            offset += n

    def _pwrite_direct(self, mv: memoryview, offset: int) -> int:
        """Write aligned ``mv`` through the direct descriptor; return the bytes written (the rest,
        after a refusal or an unaligned short write, is left to the buffered descriptor)."""
        done = 0
        while done < len(mv):
            try:
                n = os.pwrite(self._dfd, mv[done:], offset + done)
            except OSError as e:
                if e.errno not in _REFUSED or done % DIO_ALIGN:
                    raise
                self._tier._direct_refused(self._partial, e)  # raises with direct_io = true
                return done
            done += n
            if n <= 0 or n % DIO_ALIGN:
                break
        return done

    def _close_fd(self) -> None:
        # Only once no write is in flight: a descriptor closed under a concurrent pwrite could be
        # reused by the next open() and receive the late write.
        with self._state:
            fds = (self._fd, self._dfd)
            self._fd = self._dfd = -1
        for fd in fds:
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
                os.fsync(self._fd)  # one inode: covers the direct descriptor's writes as well
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
    """A tier rooted at a directory. ``fsync=False`` skips fsyncs (tests, tmpfs).

    ``direct_io``: ``"auto"`` (use ``O_DIRECT`` where the file system accepts it), ``True``
    (require it) or ``False`` (buffered only); see the module docstring.
    """

    name = "local"
    cheap_listing = True

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True, node_local: bool = False,
                 direct_io: bool | str = "auto", keep: int = 0, read_concurrency: int = 4) -> None:
        if direct_io not in (True, False, "auto"):
            raise ValueError(f"direct_io must be 'auto', True or False, got {direct_io!r}")
        self.root = Path(root)
        self.url = str(self.root)
        self.fsync = fsync
        self.node_local = node_local
        self.keep = keep
        self.read_concurrency = read_concurrency
        self.direct_io = direct_io
        # None: not tried yet; True: accepted; False: refused here (buffered from now on)
        self._direct_ok: bool | None = None if (direct_io and _O_DIRECT) else False
        if direct_io is True and not _O_DIRECT:
            raise TierError(errno.ENOTSUP, f"{self.root}: [local] direct_io = true, but this platform has no O_DIRECT")
        self._lock = threading.Lock()

    def _open_direct(self, path: Path, flags: int) -> int:
        """An ``O_DIRECT`` descriptor of ``path``, or -1 when direct I/O is off or refused here."""
        if self._direct_ok is False:
            return -1
        try:
            fd = os.open(path, flags | _O_DIRECT)
        except OSError as e:
            if e.errno not in _REFUSED:
                raise
            self._direct_refused(path, e)
            return -1
        if self._direct_ok is None:
            self._direct_ok = True
        return fd

    def _direct_refused(self, path: Path, e: OSError) -> None:
        """The file system under ``path`` refused ``O_DIRECT``: buffered from now on (``auto``) or
        a :class:`TierError` naming the file (``direct_io = true``)."""
        if self.direct_io is True:
            raise TierError(e.errno or errno.EINVAL,
                            f"{path}: [local] direct_io = true, but the file system refuses O_DIRECT: {e.strerror or e}")
        self._direct_ok = False
        _log_fallback(path, e)

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

    def root_id(self) -> str:
        return str(self.root.resolve())

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
        """Scatter-read one contiguous range into ``bufs``.

        Buffered: ``preadv`` straight into ``bufs`` (no intermediate copy). Direct, for ranges of
        at least :data:`DIRECT_READ_MIN` bytes whose first block is not in the page cache:
        aligned ``O_DIRECT`` reads into a reused bounce buffer, then one copy into ``bufs`` (the
        page cache is neither filled nor copied from). Called from several reader threads at once.
        """
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
            if total >= DIRECT_READ_MIN and self._direct_ok is not False and not _cached(fd, start):
                dfd = self._open_direct(path, os.O_RDONLY)
                if dfd >= 0:
                    try:
                        if self._read_direct(dfd, path, start, total, pending):
                            return
                    finally:
                        os.close(dfd)
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
        except TierError:
            raise
        except OSError as e:
            raise _tier_error(e, f"cannot read {path}") from e
        finally:
            os.close(fd)

    def _read_direct(self, dfd: int, path: Path, start: int, total: int, dests: "list[memoryview]") -> bool:
        """Read ``[start, start+total)`` with ``O_DIRECT`` into ``dests``; False (nothing
        delivered) if the file system refused the transfer, so the caller reads it buffered."""
        end = start + total
        off = start - start % DIO_ALIGN
        bounce = _bounce.take()
        _mm, bmv, barr = bounce
        di, dpos = 0, 0  # destination cursor: buffer index, offset in it
        pos = start  # file offset of the next byte to deliver
        try:
            while pos < end:
                want = min(BOUNCE_SIZE, end - off + (-(end - off)) % DIO_ALIGN)
                try:
                    n = os.preadv(dfd, [bmv[:want]], off)
                except OSError as e:
                    if e.errno not in _REFUSED or pos != start:
                        raise
                    self._direct_refused(path, e)
                    return False
                hi = min(end, off + n)
                if hi <= pos:
                    raise CorruptCheckpoint(f"{path}: unexpected end of file at {off + n}")
                src = barr[pos - off : hi - off]
                at = 0
                while at < len(src):  # scatter into the destinations
                    d = dests[di]
                    k = min(len(d) - dpos, len(src) - at)
                    np.copyto(np.frombuffer(d, dtype=np.uint8, count=k, offset=dpos), src[at : at + k])
                    at += k
                    dpos += k
                    if dpos == len(d):
                        di, dpos = di + 1, 0
                pos = hi
                off += n
                if n % DIO_ALIGN and pos < end:
                    raise CorruptCheckpoint(f"{path}: unexpected end of file at {off}")
        finally:
            _bounce.give(bounce)
        return True

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


    # ==== resumable writes, background deletions (open_resumable / wait_deletions) ===========
    # One self-contained block: the Tier methods, then the sink class right below the class.
    def open_resumable(self, key: str, size: int, *, block: int, tag: "dict | None" = None,
                       adopt: bool = False) -> "ResumableSink":
        """See :meth:`Tier.open_resumable`. ``<file>.partial`` holds the bytes, the sidecar
        ``<file>.ranges.partial`` (JSON: ``tag`` + size, block as ``range_size``, recorded blocks as
        ``done``) the record, an ``flock`` on ``.tmp-<file>.lock`` keeps other processes out."""
        if block <= 0:
            raise ValueError(f"block must be positive, got {block}")
        return _ResumableFile(self, key, size, block, dict(tag or {}), adopt)

    def wait_deletions(self, timeout_s: float = 600.0) -> None:
        """Block until the background janitor removed what deletions renamed away."""
        drain_deletions(timeout_s)


import json  # noqa: E402 - kept inside this block on purpose
from .base import ResumableSink  # noqa: E402


class _ResumableFile(ResumableSink):
    """:class:`ResumableSink` of the local tier (see :meth:`LocalTier.open_resumable`).

    Crash safety: a block is recorded in the sidecar (temp file, fsync, rename) only after its
    bytes were written and, with ``fsync``, ``fdatasync``'d; the final name appears only by the
    rename in :meth:`close`, after an fsync of the whole file.
    """

    def __init__(self, tier: LocalTier, key: str, size: int, block: int, tag: dict, adopt: bool) -> None:
        self._tier = tier
        self.size, self.block, self._tag = size, block, tag
        self._final = tier._path(key)
        self._partial = self._final.with_name(self._final.name + PARTIAL)
        self._sidecar = self._final.with_name(self._final.name + ".ranges" + PARTIAL)
        self._lockpath = self._final.with_name(f"{TMP}{self._final.name}.lock")
        self._lock = threading.Lock()
        self._fd = -1
        self._lock_fd = self._take_lock()
        try:
            self.recorded = self._start(adopt)
            self._fd = os.open(self._partial, os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(self._fd, size)
            self._save()
        except BaseException as e:
            self.suspend()
            if isinstance(e, OSError) and not isinstance(e, TierError):
                raise _tier_error(e, f"cannot start writing {self._partial}") from e
            raise

    def _take_lock(self) -> int:
        import fcntl

        while True:
            try:
                fd = open_new(self._lockpath, os.O_RDWR | os.O_CREAT)
            except OSError as e:
                raise _tier_error(e, f"cannot create {self._lockpath}") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise TierError(errno.EBUSY, f"{self._final} is being written by another process "
                                             f"(it holds {self._lockpath})") from None
            try:  # the holder before us may have removed the lock file meanwhile: lock the current one
                if os.stat(self._lockpath).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def _start(self, adopt: bool) -> set[int]:
        whole = set(range(self.blocks()))
        if adopt and self._final.is_file() and self._final.stat().st_size == self.size:
            os.replace(self._final, self._partial)
            return whole
        if self._partial.is_file() and self._partial.stat().st_size == self.size:
            try:
                doc = json.loads(self._sidecar.read_bytes())
                if (isinstance(doc, dict) and all(doc.get(k) == v for k, v in self._tag.items())
                        and doc.get("size") == self.size and doc.get("range_size") == self.block):
                    return {int(i) for i in doc.get("done", [])} & whole
            except (OSError, ValueError, TypeError):
                pass
        for p in (self._partial, self._sidecar):
            _unlink_quietly(p)
        return set()

    def _save(self) -> None:
        doc = {**self._tag, "size": self.size, "range_size": self.block, "done": sorted(self.recorded)}
        tmp = self._sidecar.with_name(f"{TMP}{uuid.uuid4().hex}-{self._sidecar.name}")
        try:
            with open(open_new(tmp), "w") as f:
                json.dump(doc, f)
                if self._tier.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self._sidecar)
        except OSError as e:
            _unlink_quietly(tmp)
            raise _tier_error(e, f"cannot write {self._sidecar}") from e

    def read_block(self, i: int, buf: memoryview) -> None:
        s, e = self.span(i)
        if len(buf) != e - s:
            raise ValueError(f"{self._partial}: block {i} has {e - s} bytes, the buffer {len(buf)}")
        try:
            n = os.preadv(self._fd, [buf], s) if len(buf) else 0
        except OSError as err:
            raise _tier_error(err, f"cannot read {self._partial}") from err
        if n != len(buf):
            raise CorruptCheckpoint(f"{self._partial}: unexpected end of file at {s + n}")

    def keep(self, blocks: "set[int]") -> None:
        with self._lock:
            self.recorded &= set(blocks)
            self._save()

    def write_block(self, i: int, data: memoryview) -> None:
        s, e = self.span(i)
        mv = memoryview(data).cast("B") if data.format != "B" or data.ndim != 1 else data
        if len(mv) != e - s:
            raise CorruptCheckpoint(f"{self._partial}: block {i} has {e - s} bytes, got {len(mv)}")
        try:
            _FileSink._pwrite(self._fd, mv, s)
            if self._tier.fsync:
                os.fdatasync(self._fd)
        except OSError as err:
            raise _tier_error(err, f"cannot write {self._partial}") from err
        with self._lock:
            self.recorded.add(i)
            self._save()

    def close(self) -> None:
        missing = self.blocks() - len(self.recorded)
        if missing:
            raise CorruptCheckpoint(f"{self._partial}: {missing} of {self.blocks()} blocks were never written")
        try:
            if self._tier.fsync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.replace(self._partial, self._final)
            if self._tier.fsync:
                fsync_dir(self._final.parent)
        except OSError as e:
            raise _tier_error(e, f"cannot commit {self._final}") from e
        _unlink_quietly(self._sidecar)
        self._unlock()

    def suspend(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1
        self._unlock()

    def abort(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1
        for p in (self._partial, self._sidecar):
            _unlink_quietly(p)
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            _unlink_quietly(self._lockpath)  # while still locked: the next holder re-checks the inode
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ==== end of the resumable-write block ===================================================


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
    """Block until directories deleted by :meth:`LocalTier.delete_prefix` are really gone (a no-op
    once the interpreter is tearing this module down)."""
    janitor = globals().get("_janitor")
    if janitor is not None:
        janitor.drain(timeout)
