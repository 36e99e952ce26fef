"""Multipart upload pieces of the S3 tier: checksums, part sizing, zero-copy part bodies and
the :class:`S3Sink` that assembles ``write_at`` calls into parts.

Part size: S3 allows at most 10,000 parts, so for an object larger than ``10000 * part_size`` the
effective part size is grown to the smallest multiple of 1 MiB that fits (see
:func:`effective_part_size`). Memory: a sink buffers at most one ``part_size`` per part that has
been partly written.
"""

from __future__ import annotations

import base64
import hashlib
import io
import mmap
import os
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

from ...checksum import crc32c
from ...config import S3_MAX_PART, MiB, S3Config
from ...config.redact import redact
from ...errors import CorruptCheckpoint, TierckptError, TierError
from ..base import DataSink
from .client import ClientError, log


class Uploads(Protocol):
    """What an :class:`S3Sink` needs of the tier that opened it: the requests of
    :class:`~tierckpt.tiers.s3.writes.S3Writes` (named here, not imported: ``writes`` imports this
    module for the sink and the part arithmetic, and nothing imports back)."""

    cfg: S3Config

    def _full(self, key: str) -> str: ...

    def _url_of(self, full: str) -> str: ...

    def _client_error(self, e: ClientError, what: str, url: str) -> TierckptError: ...

    def _put_object(
        self, full: str, body: bytes, crc: str, *, if_none_match: bool = False, tries: list[int] | None = None
    ) -> Any: ...

    def _create_upload(self, full: str) -> str: ...

    def _upload_part(self, full: str, upload_id: str, pn: int, nparts: int, body: Any, crc: str) -> dict[str, Any]: ...

    def _complete_upload(self, full: str, upload_id: str, parts: list[dict[str, Any]], size: int) -> None: ...

    def _abort_upload(self, full: str, upload_id: str) -> bool: ...


MAX_PARTS = 10_000
"""S3's limit on the number of parts of one multipart upload."""


def crc32c_b64(data: bytes | bytearray | memoryview | mmap.mmap) -> str:
    """Base64 of the big-endian CRC32C of ``data``: the value of ``x-amz-checksum-crc32c``.

    Computed straight on the caller's buffer (no copy), the GIL released
    (:func:`tierckpt.checksum.crc32c`).
    """
    return base64.b64encode(crc32c(data).to_bytes(4, "big")).decode("ascii")


def effective_part_size(size: int, part_size: int) -> int:
    """The part size used for an object of ``size`` bytes.

    ``part_size`` itself when the object fits in :data:`MAX_PARTS` parts; otherwise the smallest
    multiple of 1 MiB that does. Raises :class:`TierError` if that exceeds S3's 5 GiB part limit
    (an object larger than about 48 TiB, far beyond S3's 5 TiB object limit).
    """
    if size <= part_size * MAX_PARTS:
        return part_size
    need = -(-size // MAX_PARTS)
    grown = -(-need // MiB) * MiB
    if grown > S3_MAX_PART:
        raise TierError(f"object of {size} bytes needs parts of {grown} bytes, above S3's 5GiB part limit")
    return grown


def multipart_etag(etags: Iterable[str]) -> str:
    """The ETag S3 gives a completed multipart upload: md5 of the parts' md5s, ``-N``."""
    digests = [bytes.fromhex(t.strip('"')) for t in etags]
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


class ViewReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview: lets botocore send and re-send (on retry) a
    caller's buffer without copying it. ``read`` returns memoryview slices of the buffer (the
    HTTP layer only hands them to ``socket.sendall``), valid while the buffer is."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._mv = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._mv)

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._mv)}[whence]
        self._pos = max(0, min(len(self._mv), base + offset))
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self._mv) - self._pos)
        memoryview(b).cast("B")[:n] = self._mv[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> memoryview:  # type: ignore[override]
        end = len(self._mv) if size is None or size < 0 else min(len(self._mv), self._pos + size)
        out = self._mv[self._pos : end]
        self._pos = end
        return out


def byte_view(data: Any) -> memoryview:
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def pread_exact(fd: int, n: int, off: int, path: str, url: str) -> bytes:
    """Exactly ``n`` bytes of ``fd`` at ``off``; :class:`CorruptCheckpoint` if the file is shorter."""
    try:
        data = os.pread(fd, n, off)
        if len(data) < n:
            chunks = [data]
            got = len(data)
            while got < n:
                more = os.pread(fd, n - got, off + got)
                if not more:
                    raise CorruptCheckpoint(f"{path}: file shrank while uploading it to {url}")
                chunks.append(more)
                got += len(more)
            data = b"".join(chunks)
        return data
    except OSError as e:
        raise TierError(e.errno or 0, f"cannot read {path} to upload it to {url}: {e.strerror or e}") from e


# -- the multipart sink ----------------------------------------------------------------------


class S3Sink(DataSink):
    """A multipart upload assembled from ``write_at`` calls.

    Part ``n`` (0-based here, ``n+1`` on the wire) covers ``[n*ps, min((n+1)*ps, size))`` with
    ``ps = effective_part_size(size, cfg.part_size)``. ``write_at`` copies its bytes into the
    part's buffer (the caller may reuse its buffer afterwards); the thread whose write completes
    a part uploads it before returning. A write that covers a whole part is uploaded straight
    from the caller's buffer, without a copy. Ranges must be disjoint (each byte written once).

    Objects smaller than ``cfg.part_size`` are buffered whole and written with one PutObject at
    ``close``. Any failed part makes the sink failed: later calls raise, ``close`` aborts.
    """

    def __init__(self, tier: Uploads, key: str, size: int) -> None:
        self._tier = tier
        self._full = tier._full(key)
        self._url = tier._url_of(self._full)
        if size < 0:
            raise CorruptCheckpoint(f"{self._url}: negative object size {size}")
        self._size = size
        self._lock = threading.Condition()
        self._state = "open"  # open | failed | closed | aborted
        self._error: BaseException | None = None
        self._abort_confirmed = False
        self._inflight = 0
        self._single: bytearray | None = None
        self._single_filled = 0
        self._upload_id: str | None = None
        self._bufs: dict[int, bytearray] = {}
        self._filled: dict[int, int] = {}
        self._parts: dict[int, dict[str, Any]] = {}
        if size < tier.cfg.part_size:
            self._ps = max(size, 1)
            self._nparts = 1
            self._single = bytearray(size)
        else:
            self._ps = effective_part_size(size, tier.cfg.part_size)
            self._nparts = -(-size // self._ps)
            self._upload_id = tier._create_upload(self._full)

    @property
    def part_size(self) -> int:
        """The effective part size of this object."""
        return self._ps

    def _usable(self) -> None:
        if self._state != "open":
            detail = f": {self._error}" if self._error is not None else ""
            raise TierError(f"{self._url}: the upload is {self._state}{detail}")

    def write_at(self, offset: int, data: memoryview) -> None:
        """Copy ``data`` to ``[offset, offset+len(data))``; upload every part this completes."""
        mv = byte_view(data)
        n = len(mv)
        if offset < 0 or offset + n > self._size:
            raise CorruptCheckpoint(f"{self._url}: write [{offset}, {offset + n}) past size {self._size}")
        with self._lock:
            self._usable()
        if not n:
            return
        if self._upload_id is None:
            single = self._single
            if single is None:  # aborted concurrently
                raise TierError(f"{self._url}: the upload is {self._state}")
            single[offset : offset + n] = mv
            with self._lock:
                self._single_filled += n
            return
        ps = self._ps
        i = 0
        while i < n:
            pos = offset + i
            part = pos // ps
            pstart = part * ps
            plen = min(ps, self._size - pstart)
            take = min(n - i, pstart + plen - pos)
            chunk = mv[i : i + take]
            if take == plen:
                self._upload(part, ViewReader(chunk), crc32c_b64(chunk))
            else:
                with self._lock:
                    self._usable()
                    buf = self._bufs.get(part)
                    if buf is None:
                        buf = self._bufs[part] = bytearray(plen)
                        self._filled[part] = 0
                buf[pos - pstart : pos - pstart + take] = chunk
                with self._lock:
                    self._filled[part] += take
                    done = self._filled[part] == plen
                    if done:
                        del self._bufs[part]
                if done:
                    self._upload(part, buf, crc32c_b64(buf))
                    del buf
            i += take

    def _upload(self, part: int, body: Any, crc: str) -> None:
        with self._lock:
            self._usable()
            self._inflight += 1
        assert self._upload_id is not None
        try:
            entry = self._tier._upload_part(self._full, self._upload_id, part + 1, self._nparts, body, crc)
        except BaseException as e:
            with self._lock:
                if self._state == "open":
                    self._state = "failed"
                    self._error = e
            raise
        finally:
            with self._lock:
                self._inflight -= 1
                self._lock.notify_all()
        with self._lock:
            self._parts[part + 1] = entry

    def close(self) -> None:
        """Complete the upload (parts sorted, with their CRC32Cs) or PutObject a small object.

        Raises :class:`TierError` if a part failed, if bytes are missing, or if completion fails;
        the upload is then aborted.
        """
        with self._lock:
            if self._state == "closed":
                return
            self._usable()
        try:
            if self._single is not None:
                if self._single_filled != self._size:
                    raise TierError(
                        f"{self._url}: close() after {self._single_filled} of {self._size} bytes were written"
                    )
                body = bytes(self._single)
                self._single = None
                try:
                    self._tier._put_object(self._full, body, crc32c_b64(body))
                except ClientError as e:
                    raise self._tier._client_error(e, "put", self._url) from e
            else:
                with self._lock:
                    missing = [pn for pn in range(1, self._nparts + 1) if pn not in self._parts]
                    parts = list(self._parts.values())
                if missing:
                    raise TierError(
                        f"{self._url}: close() before all bytes were written: "
                        f"{len(missing)} of {self._nparts} parts incomplete (first: part {missing[0]})"
                    )
                assert self._upload_id is not None
                self._tier._complete_upload(self._full, self._upload_id, parts, self._size)
        except BaseException as e:
            with self._lock:
                if self._state == "open":
                    self._state = "failed"
                    self._error = e
            self.abort()
            raise
        with self._lock:
            self._state = "closed"

    def abort(self) -> None:
        """Discard everything: refuse further writes, let in-flight parts finish (bounded by the
        read timeout) and abort the multipart upload. Never raises.

        If the server could not be reached (the abort was not confirmed), a later call tries
        again, so a caller can abort once more after an outage; otherwise it is a no-op.
        """
        try:
            with self._lock:
                if self._state == "closed" or self._abort_confirmed:
                    return
                self._state = "aborted"
                self._bufs.clear()
                self._single = None
                deadline = time.monotonic() + self._tier.cfg.read_timeout
                while self._inflight and time.monotonic() < deadline:
                    self._lock.wait(timeout=max(0.0, deadline - time.monotonic()))
            confirmed = True
            if self._upload_id is not None:
                confirmed = self._tier._abort_upload(self._full, self._upload_id)
            with self._lock:
                self._abort_confirmed = confirmed
        except Exception as e:  # noqa: BLE001 - abort never raises
            log.warning("abort %s: %s: %s", self._url, type(e).__name__, redact(e))
