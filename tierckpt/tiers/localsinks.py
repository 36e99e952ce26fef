"""The local tier's sinks: :class:`_FileSink` (a large object written at offsets by several threads,
direct I/O where aligned) and :class:`_ResumableFile` (block-wise, resumable writes for fetch,
direct I/O where aligned, progress recorded every :data:`RECORD_EVERY` bytes).
Created only by :class:`~tierckpt.tiers.local.LocalTier`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Protocol

from ..errors import CorruptCheckpoint, TierError
from . import localfs
from .base import DataSink, ResumableSink
from .localfs import _REFUSED, DIO_ALIGN, PARTIAL, TMP, _address, _tier_error, _unlink_quietly, fsync_dir, open_new

log = logging.getLogger("tierckpt")


class LocalFiles(Protocol):
    """What a sink needs of the tier that opened it: paths, fsync and the direct-I/O state (the
    members of :class:`~tierckpt.tiers.local.LocalTier` the sinks use; naming them here rather
    than importing ``LocalTier`` keeps ``local`` -> ``localsinks`` the only import between them)."""

    _direct_ok: bool | None
    direct_io: bool | str
    fsync: bool

    def _path(self, key: str) -> Path: ...

    def _open_direct(self, path: Path, flags: int) -> int: ...

    def _direct_refused(self, path: Path, e: OSError) -> None: ...


class _FileSink(DataSink):
    """One ``.partial`` file written at planned offsets by several threads (see the module doc).

    Direct I/O only for a file of at least :data:`~.localfs.DIRECT_WRITE_MIN` bytes (any size
    under ``direct_io = true``): a smaller one is written buffered and stays in the page cache.

    ``write_at`` may run on several threads at once for disjoint ranges (the flush threads,
    restore's fetch workers) and blocks until the bytes are handed to the kernel (direct
    transfers: until the device has them); ``close`` fsyncs and renames; ``abort`` unlinks.
    """

    def __init__(self, tier: LocalFiles, key: str, size: int, exclusive: bool = False) -> None:
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
            flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
            self._fd = open_new(self._partial, flags)
            if size:
                try:
                    os.posix_fallocate(self._fd, 0, size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                    os.ftruncate(self._fd, size)
            if size >= DIO_ALIGN and (size >= localfs.DIRECT_WRITE_MIN or tier.direct_io is True):
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
        return _pwrite_direct(self._tier, self._dfd, self._partial, mv, offset)

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


RECORD_EVERY = 256 << 20
"""Bytes a :class:`_ResumableFile` writes between two durable records of its progress: a crash
loses at most this much download per file (never correctness: resumed blocks are re-checked)."""


class _ResumableFile(ResumableSink):
    """:class:`ResumableSink` of the local tier (see :meth:`LocalTier.open_resumable`).

    Durability is proportional to the work: blocks are written with ``O_DIRECT`` where the file
    system allows it (the aligned part of each block, from a page-aligned buffer; buffered
    otherwise, e.g. on tmpfs) and are *recorded* in the sidecar (temp file, fsync, rename) in
    batches: after every :data:`RECORD_EVERY` bytes, the file is ``fdatasync``'d and every block
    landed so far recorded at once; :meth:`suspend` (an interruption) does the same for all
    landed blocks. So a recorded block is always durable; a crash loses at most the blocks
    written since the last record. The final name appears only by the rename in :meth:`close`,
    after one fsync of the whole file.

    ``recorded`` (the in-memory set) holds every block that landed, recorded durably or not yet.
    """

    def __init__(self, tier: LocalFiles, key: str, size: int, block: int, tag: dict, adopt: bool) -> None:
        self._tier = tier
        self.size, self.block, self._tag = size, block, tag
        self._final = tier._path(key)
        self._partial = self._final.with_name(self._final.name + PARTIAL)
        self._sidecar = self._final.with_name(self._final.name + ".ranges" + PARTIAL)
        self._lockpath = self._final.with_name(f"{TMP}{self._final.name}.lock")
        self._lock = threading.Lock()  # recorded, _unsaved
        self._record_lock = threading.Lock()  # one sync + sidecar write at a time, in order
        self._fd = -1
        self._dfd = -1
        self._unsaved = 0  # bytes landed since the last durable record
        self._lock_fd = self._take_lock()
        try:
            self.recorded = self._start(adopt)
            self._fd = os.open(self._partial, os.O_RDWR | os.O_CREAT, 0o644)
            if os.fstat(self._fd).st_size != size:
                os.ftruncate(self._fd, size)
            if size:
                try:  # contiguous extents: direct writes then need no allocation on the way
                    os.posix_fallocate(self._fd, 0, size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
            if size >= DIO_ALIGN:
                self._dfd = tier._open_direct(self._partial, os.O_WRONLY)
            self._save(self.recorded)
        except BaseException as e:
            self.suspend()
            if isinstance(e, OSError) and not isinstance(e, TierError):
                raise _tier_error(e, f"cannot start writing {self._partial}") from e
            raise

    @property
    def direct(self) -> bool:
        """Whether aligned block writes currently go through ``O_DIRECT``."""
        return self._dfd >= 0 and self._tier._direct_ok is not False

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
                raise TierError(
                    errno.EBUSY, f"{self._final} is being written by another process (it holds {self._lockpath})"
                ) from None
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
                if (
                    isinstance(doc, dict)
                    and all(doc.get(k) == v for k, v in self._tag.items())
                    and doc.get("size") == self.size
                    and doc.get("range_size") == self.block
                ):
                    return {int(i) for i in doc.get("done", [])} & whole
            except (OSError, ValueError, TypeError):
                pass
        for p in (self._partial, self._sidecar):
            _unlink_quietly(p)
        return set()

    def _save(self, blocks: set[int]) -> None:
        doc = {**self._tag, "size": self.size, "range_size": self.block, "done": sorted(blocks)}
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

    def _record(self) -> None:
        """Make every landed block durable, then record them all in the sidecar."""
        with self._record_lock:
            with self._lock:
                blocks = set(self.recorded)
                self._unsaved = 0
            if self._tier.fsync:
                os.fdatasync(self._fd)  # one inode: covers the direct descriptor's writes too
            self._save(blocks)

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

    def keep(self, blocks: set[int]) -> None:
        with self._record_lock:
            with self._lock:
                self.recorded &= set(blocks)
                kept = set(self.recorded)
            self._save(kept)

    def write_block(self, i: int, data: memoryview) -> None:
        """Write block ``i`` (from any thread; a page-aligned ``data`` goes through ``O_DIRECT``).
        It is recorded durably with the next batch (see the class docstring)."""
        s, e = self.span(i)
        mv = memoryview(data).cast("B") if data.format != "B" or data.ndim != 1 else data
        if len(mv) != e - s:
            raise CorruptCheckpoint(f"{self._partial}: block {i} has {e - s} bytes, got {len(mv)}")
        try:
            n = len(mv)
            aligned = n // DIO_ALIGN * DIO_ALIGN if s % DIO_ALIGN == 0 else 0
            done = 0
            if aligned and self.direct and _address(mv) % DIO_ALIGN == 0:
                done = self._pwrite_direct(mv[:aligned], s)
            _FileSink._pwrite(self._fd, mv[done:], s + done)
        except TierError:
            raise
        except OSError as err:
            raise _tier_error(err, f"cannot write {self._partial}") from err
        with self._lock:
            self.recorded.add(i)
            self._unsaved += n
            due = self._unsaved >= RECORD_EVERY
        if due:
            try:
                self._record()
            except OSError as err:
                raise _tier_error(err, f"cannot make {self._partial} durable") from err

    def _pwrite_direct(self, mv: memoryview, offset: int) -> int:
        return _pwrite_direct(self._tier, self._dfd, self._partial, mv, offset)

    def close(self) -> None:
        missing = self.blocks() - len(self.recorded)
        if missing:
            raise CorruptCheckpoint(f"{self._partial}: {missing} of {self.blocks()} blocks were never written")
        try:
            if self._tier.fsync:
                os.fsync(self._fd)
            self._close_fds()
            os.replace(self._partial, self._final)
            if self._tier.fsync:
                fsync_dir(self._final.parent)
        except OSError as e:
            raise _tier_error(e, f"cannot commit {self._final}") from e
        _unlink_quietly(self._sidecar)
        self._unlock()

    def suspend(self) -> None:
        """Record every landed block (durably), then release. Never raises: a failure to record
        only loses progress (logged)."""
        if self._fd >= 0 and self._lock_fd >= 0:
            try:
                with self._lock:
                    pending = self._unsaved > 0
                if pending:
                    self._record()
            except OSError as e:
                log.warning(
                    "%s: cannot record the download progress (%s); the next fetch re-downloads what was not recorded",
                    self._partial,
                    e,
                )
        self._release(discard=False)

    def abort(self) -> None:
        self._release(discard=True)

    def _close_fds(self) -> None:
        for fd in (self._fd, self._dfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd = self._dfd = -1

    def _release(self, discard: bool) -> None:
        """Close the file and drop the lock; ``discard``: remove the partial file and its sidecar."""
        self._close_fds()
        if discard:
            for p in (self._partial, self._sidecar):
                _unlink_quietly(p)
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            _unlink_quietly(self._lockpath)  # while still locked: the next holder re-checks the inode
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ==== end of the resumable-write block ===================================================


def _pwrite_direct(tier: LocalFiles, dfd: int, path, mv: memoryview, offset: int) -> int:  # noqa: ANN001
    """Write aligned ``mv`` at ``offset`` through the direct descriptor ``dfd`` of ``path``; return
    the bytes written (the rest, after a refusal or an unaligned short write, is left to the
    caller's buffered descriptor). A refusal is reported to ``tier`` (which raises with
    ``direct_io = true``)."""
    done = 0
    while done < len(mv):
        try:
            n = os.pwrite(dfd, mv[done:], offset + done)
        except OSError as e:
            if e.errno not in _REFUSED or done % DIO_ALIGN:
                raise
            tier._direct_refused(path, e)
            return done
        done += n
        if n <= 0 or n % DIO_ALIGN:
            break
    return done
