"""Promotion into the S3 tier: :meth:`S3Tier.copy_from <.tier.S3Tier.copy_from>` as a pipeline.

One thread (the caller's, the replicator's) reads the source object part by part into reused
page-aligned buffers with ``src.read_into`` (the local tier then reads with ``O_DIRECT`` straight
into the buffer: no page-cache churn, no copy), computes each part's CRC32C on the buffer
(zero-copy, :func:`crc32c_b64`) and hands it to the tier's upload pool; while parts ``N``,
``N-1``, ... upload, part ``N+1`` is being read. Memory is bounded: at most
``cfg.concurrency + 1`` buffers of one part each exist per tier (shared by concurrent copies;
created on first use, because touching fresh memory is slow, and kept until :meth:`close`).

The parts go out through the same request layer as every other upload (``UploadPart`` with the
CRC32C header the server verifies, botocore's retries, this package's own retries, error
mapping and redaction); on any failure the remaining parts are not read, running ones are
awaited and the multipart upload is aborted, so nothing becomes visible under the key.
"""

from __future__ import annotations

import mmap
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ...errors import TierError
from ..base import Tier
from .multipart import ViewReader, crc32c_b64, effective_part_size

if TYPE_CHECKING:
    from .writes import S3Writes


class PartBuffers:
    """A bounded pool of page-aligned anonymous mappings of one size (``part_size`` bytes).

    :meth:`take` blocks while ``limit`` buffers are out; :meth:`give` returns one. Buffers of
    another size (an object so large that its parts grow, see
    :func:`~.multipart.effective_part_size`) are made for the call and dropped afterwards, still
    counted against ``limit``. Thread-safe.
    """

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = max(1, limit)
        self._free: list[mmap.mmap] = []
        self._out = 0
        self._cond = threading.Condition()
        self._closed = False

    def take(self, size: int) -> mmap.mmap:
        """A buffer of at least ``size`` bytes (blocks while ``limit`` buffers are in use)."""
        with self._cond:
            while self._out >= self.limit and not self._closed:
                self._cond.wait()
            if self._closed:
                raise TierError("the S3 tier is closed")
            self._out += 1
            if size <= self.size and self._free:
                return self._free.pop()
        try:
            return _anonymous(max(size, self.size))
        except BaseException:
            with self._cond:
                self._out -= 1
                self._cond.notify()
            raise

    def give(self, buf: mmap.mmap) -> None:
        """Return ``buf`` (kept for reuse when it has the pool's size, else released)."""
        with self._cond:
            self._out -= 1
            if len(buf) == self.size and not self._closed:
                self._free.append(buf)
                buf = None  # type: ignore[assignment]
            self._cond.notify()
        if buf is not None:
            _release(buf)

    def close(self) -> None:
        """Release the free buffers; buffers still out are released when given back."""
        with self._cond:
            self._closed = True
            free, self._free = self._free, []
            self._cond.notify_all()
        for b in free:
            _release(b)


def _anonymous(size: int) -> mmap.mmap:
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:  # fewer, larger device requests for the direct reads into it
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return mm


def _release(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # a view of it is still alive somewhere (a botocore retry): let GC free it
        pass


def copy_into(tier: S3Writes, buffers: PartBuffers, src: Tier, key: str) -> int:
    """Copy object ``key`` of ``src`` into ``tier`` under the same key; return its size.

    Called by :meth:`S3Tier.copy_from <.tier.S3Tier.copy_from>` (the replicator's thread, one
    file at a time per rank); blocks until the object is complete on S3 or the upload failed and
    was aborted (the error is raised). Objects smaller than one part go in one ``PutObject``.
    """
    size = src.size(key)
    full = tier._full(key)
    url = tier._url_of(full)
    if size < tier.cfg.part_size:
        data = src.get(key, 0, size) if size else b""
        tier.put(key, data)
        return size
    ps = effective_part_size(size, tier.cfg.part_size)
    nparts = -(-size // ps)
    pool = tier._executor()
    upload_id = tier._create_upload(full)
    failed = threading.Event()
    parts: list[dict[str, Any]] = []
    futures: list[tuple[Future[dict[str, Any]], mmap.mmap]] = []
    lock = threading.Lock()

    def send(pn: int, buf: mmap.mmap, n: int, crc: str) -> dict[str, Any]:
        try:
            if failed.is_set():
                raise TierError(f"upload part {pn}/{nparts} of {url}: skipped, an earlier part failed")
            entry = tier._upload_part(full, upload_id, pn, nparts, ViewReader(memoryview(buf)[:n]), crc)
            with lock:
                parts.append(entry)
            return entry
        except BaseException:
            failed.set()
            raise
        finally:
            buffers.give(buf)

    try:
        for pn in range(1, nparts + 1):
            if failed.is_set():
                break
            off = (pn - 1) * ps
            n = min(ps, size - off)
            buf = buffers.take(n)
            try:
                view = memoryview(buf)[:n]
                src.read_into(key, off, view)
                crc = crc32c_b64(view)
                del view
                futures.append((pool.submit(send, pn, buf, n, crc), buf))
            except BaseException:
                buffers.give(buf)
                raise
        for f, _b in futures:
            f.result()
        tier._complete_upload(full, upload_id, parts, size)
    except BaseException:
        failed.set()
        for f, b in futures:
            if f.cancel():  # never ran: its buffer is still ours to give back
                buffers.give(b)
        for f, _b in futures:
            if not f.cancelled():
                try:
                    f.exception()
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass
        tier._abort_upload(full, upload_id)
        raise
    return size
