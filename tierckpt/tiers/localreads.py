"""Reads of the local tier: whole objects, ranges and scattered ranges, with ``O_DIRECT`` where the
file system accepts it (page-aligned bounce buffers, reads in place into aligned destinations) and
buffered reads otherwise. A load that announces its reads (:meth:`LocalReads.prefetch`) and is
small has them prefetched into the page cache and reads them buffered.

:class:`LocalReads` is a base of :class:`~tierckpt.tiers.local.LocalTier` (as the S3 tier's reads
are of ``S3Tier``); the tier owns the paths and the direct-I/O state (:class:`~.localsinks.LocalFiles`).
Callers: the read engine's threads, any number at once.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CheckpointNotFound, CorruptCheckpoint, TierError
from .localfs import (
    _REFUSED,
    BOUNCE_SIZE,
    DIO_ALIGN,
    DIRECT_READ_MIN,
    INPLACE_STEP,
    PREFETCH_MAX,
    _address,
    _bounce,
    _cached,
    _tier_error,
    willneed,
)

__all__ = ["LocalReads"]


class LocalReads:
    """``get``, ``read_into`` and ``read_ranges`` of the local tier (see the module docstring)."""

    _direct_ok: bool | None
    _prefetched: frozenset[str] = frozenset()  # keys of the announced load (read buffered)
    _prefetch_stop: threading.Event | None = None

    if TYPE_CHECKING:  # the tier's own (LocalTier), named for the type checker

        def _path(self, key: str) -> Path: ...

        def _open_direct(self, path: Path, flags: int) -> int: ...

        def _direct_refused(self, path: Path, e: OSError) -> None: ...

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
        except (FileNotFoundError, NotADirectoryError):  # a path component that is a file: no such key
            raise CheckpointNotFound(f"{path}: no such file") from None
        except CorruptCheckpoint:
            raise
        except OSError as e:
            raise _tier_error(e, f"cannot read {path}") from e

    def prefetch(self, ranges: dict[str, list[tuple[int, int]]]) -> int:
        """Announce one load's reads: ``ranges`` maps keys to ``(start, end)`` byte ranges.

        When they total at most :data:`PREFETCH_MAX` bytes, a background thread asks the kernel
        to read them into the page cache (``POSIX_FADV_WILLNEED``, see
        :func:`~.localfs.willneed`) while the caller goes on (DCP's planning round), and
        :meth:`read_ranges` reads these keys buffered, from the page cache, until
        :meth:`end_prefetch`. Such a load is over before ``O_DIRECT`` pays: its cold reads
        would need fresh bounce buffers (4 x 8 MiB of huge pages: faulting them in took
        100-320 ms of system CPU in a fresh process on the test host, while reading the 37 MiB they
        were for takes 45 ms buffered), and the page cache it fills is small. When the first and
        last page of every key's ranges are cached already (a small file is written buffered,
        :data:`~.localfs.DIRECT_WRITE_MIN`), no prefetch thread is started. A larger load
        is not prefetched (returns 0): its cold ranges are read with ``O_DIRECT``. Replaces
        the previous announcement; absent keys are skipped (the reads report them). Returns
        the bytes announced.
        """
        self.end_prefetch()
        total = sum(max(0, b - a) for spans in ranges.values() for a, b in spans)
        if not total or total > PREFETCH_MAX or not hasattr(os, "posix_fadvise"):
            return 0
        self._prefetched = frozenset(ranges)
        paths = {self._path(k): v for k, v in ranges.items()}
        if self.cached(ranges):
            return total  # already in the page cache (written buffered, read lately): no thread to start
        stop = threading.Event()
        self._prefetch_stop = stop
        threading.Thread(target=willneed, args=(paths, stop), name="tierckpt-prefetch", daemon=True).start()
        return total

    def cached(self, ranges: dict[str, list[tuple[int, int]]]) -> bool:
        """Whether ``ranges`` (as for :meth:`prefetch`) look in the page cache: the first and the
        last page of every key's ranges are (``mincore``; a file ending in a partial page: its last
        whole page). A hint, no promise: pages in between may have been evicted (the reads then
        take longer, nothing else). False for an absent file or when it cannot be told."""
        return bool(ranges) and all(_ends_cached(self._path(k), v) for k, v in ranges.items())

    def end_prefetch(self) -> None:
        """Forget the announced load (its keys are read as any others again); stops its prefetch."""
        if self._prefetch_stop is not None:
            self._prefetch_stop.set()
            self._prefetch_stop = None
        self._prefetched = frozenset()

    def read_into(self, key: str, start: int, buf: memoryview) -> None:
        self.read_ranges(key, start, [buf])

    def read_ranges(self, key: str, start: int, bufs: list[memoryview]) -> None:
        """Scatter-read one contiguous range into ``bufs``.

        Buffered: ``preadv`` straight into ``bufs`` (no intermediate copy). Direct, for ranges of
        at least :data:`DIRECT_READ_MIN` bytes of a key not announced by :meth:`prefetch` whose
        first block is not in the page cache:
        aligned ``O_DIRECT`` reads into a reused bounce buffer, then one copy into ``bufs`` (the
        page cache is neither filled nor copied from). Called from several reader threads at once.
        """
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFound(f"{path}: no such file") from None
        except OSError as e:
            raise _tier_error(e, f"cannot read {path}") from e
        try:
            size = os.fstat(fd).st_size
            total = sum(len(b) for b in bufs)
            if start < 0 or start + total > size:
                raise CorruptCheckpoint(f"{path}: range [{start}, {start + total}) is outside the file ({size} bytes)")
            pending = [b.cast("B") if (b.format != "B" or b.ndim != 1) else b for b in bufs if len(b)]
            if (
                total >= DIRECT_READ_MIN
                and self._direct_ok is not False
                and key not in self._prefetched
                and not _cached(fd, start)
            ):
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

    def _read_direct(self, dfd: int, path: Path, start: int, total: int, dests: list[memoryview]) -> bool:
        """Read ``[start, start+total)`` with ``O_DIRECT`` into ``dests``; False (nothing
        delivered) if the file system refused the transfer, so the caller reads it buffered.

        One page-aligned destination at an aligned file offset (promotion's part buffers) is
        read into in place, with no bounce copy, up to its last whole block; the rest, and every
        other shape of destination, goes through a reused bounce buffer and one copy."""
        end = start + total
        if len(dests) == 1 and start % DIO_ALIGN == 0 and _address(dests[0]) % DIO_ALIGN == 0:
            body = total - total % DIO_ALIGN
            got = self._read_direct_inplace(dfd, path, start, dests[0][:body])
            if got < 0:
                return False
            if got == total:
                return True
            start, total, dests = start + got, total - got, [dests[0][got:]]
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

    def _read_direct_inplace(self, dfd: int, path: Path, start: int, dest: memoryview) -> int:
        """``O_DIRECT`` reads of ``[start, start+len(dest))`` straight into ``dest`` (offset,
        length and address aligned to :data:`DIO_ALIGN`). Returns the bytes read (fewer at the end
        of the file), or -1 if the file system refused the first transfer (nothing delivered)."""
        got = 0
        while got < len(dest):
            try:
                n = os.preadv(dfd, [dest[got : got + INPLACE_STEP]], start + got)
            except OSError as e:
                if e.errno not in _REFUSED or got:
                    raise
                self._direct_refused(path, e)
                return -1
            got += n
            if n == 0 or n % DIO_ALIGN:
                break
        return got


def _ends_cached(path: Path, spans: list[tuple[int, int]]) -> bool:
    """Whether the first and the last page of ``spans`` (byte ranges of ``path``) are in the page
    cache (:func:`~.localfs._cached`; of a file ending in a partial page, its last whole page);
    False when unknown or the file cannot be opened."""
    live = [(a, b) for a, b in spans if b > a]
    if not live:
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        first, last = min(a for a, _ in live), max(b for _, b in live) - 1
        whole = os.fstat(fd).st_size // DIO_ALIGN * DIO_ALIGN  # mincore never reports a partial last page
        if last >= whole:
            last = max(first, whole - 1)
        return _cached(fd, first) and _cached(fd, last)
    finally:
        os.close(fd)
