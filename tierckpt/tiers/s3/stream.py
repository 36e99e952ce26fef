"""The S3 tier's :class:`~tierckpt.tiers.streams.StreamSink`: a multipart upload assembled front
to back, with ``UploadPartCopy`` for bytes that another object of the tier already holds.

Appended bytes collect in a part buffer of ``part_size`` (grown so that ``size_hint`` fits in
10,000 parts); a full buffer is uploaded on the tier's pool (at most ``concurrency`` parts in
flight) with its CRC32C, as every upload of this tier. :meth:`S3Stream.append_copy` of a range
of at least 5 MiB becomes ``UploadPartCopy`` parts (the server copies, nothing is sent): S3
wants every part but the last to be at least 5 MiB, so a part buffer holding less is first
topped up with the range's first bytes (read with a GET), and a range too short to make a part
of its own is read and appended. A server that refuses ``UploadPartCopy`` (not implemented)
makes this tier instance read and append instead (logged once). An object that ends below one
part is written with one ``PutObject`` at :meth:`S3Stream.close`. Nothing is visible under the
key until ``close`` completes the upload; on failure it is aborted.

Copies are not trusted: a source that is missing, shorter than the range or unreadable raises
:class:`~tierckpt.tiers.streams.CopySourceError` naming it (from the failed part, or from
``close``, whose completion checks the object's size: a server may clip a range past the end of
its source instead of refusing it). Whether the copied bytes are the right ones is the caller's
to check (:func:`tierckpt.codec.hop.copy_encoded` reads them back).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from ...errors import TierckptError
from ..streams import CopySourceError, StreamSink
from .client import ClientError, _err_code, log
from .multipart import MAX_PARTS, Uploads, ViewReader, crc32c_b64, effective_part_size

_T = TypeVar("_T")


class StreamTier(Uploads, Protocol):
    """What an :class:`S3Stream` needs of the :class:`~tierckpt.tiers.s3.tier.S3Tier` that opened
    it (named here, not imported: the tier imports this module to open streams)."""

    bucket: str
    url: str
    _client: Any
    _part_copy: bool

    def _call(self, fn: Callable[[], _T], what: str, url: str, *, own_retry: bool = False) -> _T: ...

    def _executor(self) -> ThreadPoolExecutor: ...

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None: ...

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes: ...

    def _head(self, full: str) -> tuple[int, str] | None: ...


MIN_PART = 5 << 20
MAX_COPY = 5 << 30
_NO_COPY = ("NotImplemented", "InvalidRequest", "MethodNotAllowed")


class S3Stream(StreamSink):
    """See the module docstring. One writer thread; parts upload on the tier's pool."""

    def __init__(self, tier: StreamTier, key: str, size_hint: int = 0) -> None:
        self._tier = tier
        self._key = key
        self._full = tier._full(key)
        self._url = tier._url_of(self._full)
        self._ps = effective_part_size(max(size_hint, 1), tier.cfg.part_size)
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._pn = 0
        self._parts: list[dict[str, Any]] = []
        self._futures: list[Future[dict[str, Any]]] = []
        self._lock = threading.Lock()
        self.size = 0
        self.uploaded = 0
        self.copied = 0
        self._sources: set[str] = set()  # URLs of the objects copied from
        self._source_sizes: dict[str, int] = {}  # full key -> size, of the objects copied from server-side

    # -- parts --------------------------------------------------------------------------------
    def _start(self) -> str:
        if self._upload_id is None:
            self._upload_id = self._tier._create_upload(self._full)
        return self._upload_id

    def _submit(self, fn, *args) -> None:  # noqa: ANN001
        while len(self._futures) >= self._tier.cfg.concurrency:
            self._futures.pop(0).result()
        self._futures.append(self._tier._executor().submit(fn, *args))

    def _flush(self) -> None:
        if not self._buf:
            return
        body, self._buf = self._buf, bytearray()
        uid = self._start()
        self._pn += 1
        pn = self._pn
        self.uploaded += len(body)

        def send() -> dict[str, Any]:
            entry = self._tier._upload_part(self._full, uid, pn, 0, ViewReader(memoryview(body)), crc32c_b64(body))
            with self._lock:
                self._parts.append(entry)
            return entry

        self._submit(send)

    def _copy_part(self, src_full: str, start: int, end: int) -> None:
        uid = self._start()
        self._pn += 1
        pn = self._pn
        tier = self._tier
        self.copied += end - start

        src_url = tier._url_of(src_full)

        def copy() -> dict[str, Any]:
            try:
                resp = tier._call(
                    lambda: tier._client.upload_part_copy(
                        Bucket=tier.bucket,
                        Key=self._full,
                        UploadId=uid,
                        PartNumber=pn,
                        CopySource={"Bucket": tier.bucket, "Key": src_full},
                        CopySourceRange=f"bytes={start}-{end - 1}",
                    ),
                    f"copy part {pn} from {src_url} into",
                    self._url,
                    own_retry=True,
                )
            except TierckptError as e:
                cause = e.__cause__
                if isinstance(cause, ClientError) and _err_code(cause) in _NO_COPY and tier._part_copy:
                    log.warning(
                        "%s refuses UploadPartCopy (%s): unchanged parts are uploaded again from now on",
                        tier.url,
                        _err_code(cause),
                    )
                    tier._part_copy = False
                raise CopySourceError(
                    f"copy of bytes [{start}, {end}) of {src_url} into part {pn} of {self._url}: {e}"
                ) from e
            res = resp.get("CopyPartResult", {})
            entry = {"PartNumber": pn, "ETag": res["ETag"]}
            if res.get("ChecksumCRC32C"):
                entry["ChecksumCRC32C"] = res["ChecksumCRC32C"]
            with self._lock:
                self._parts.append(entry)
            return entry

        self._submit(copy)

    # -- the StreamSink contract --------------------------------------------------------------
    def append(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        while len(view):
            room = self._ps - len(self._buf)
            self._buf += view[:room]
            view = view[room:]
            if len(self._buf) >= self._ps:
                self._flush()

    def _read_append(self, key: str, start: int, end: int) -> None:
        step = self._ps
        self._sources.add(self._tier._url_of(self._tier._full(key)))
        while start < end:
            n = min(step, end - start)
            try:
                data = self._tier.get(key, start, start + n)
            except TierckptError as e:
                raise CopySourceError(
                    f"read of bytes [{start}, {start + n}) of {self._tier.url}/{key} to copy them into {self._url}: {e}"
                ) from e
            if len(data) != n:
                raise CopySourceError(
                    f"read of bytes [{start}, {start + n}) of {self._tier.url}/{key} to copy them into "
                    f"{self._url}: {len(data)} bytes came back"
                )
            self.append(memoryview(data))
            start += n

    def append_copy(self, key: str, start: int, end: int) -> None:
        """Append bytes ``[start, end)`` of ``key`` (an object of this tier), copied by the server
        where the range allows a part of at least 5 MiB (see the module docstring)."""
        if end - start <= 0:
            return
        if not getattr(self._tier, "_part_copy", True) or self._pn >= MAX_PARTS - 1000:
            # refused by the server, or a file cut into so many runs that S3's 10,000 parts are near:
            # read and upload (parts then grow by part_size, never past the limit)
            self._read_append(key, start, end)
            return
        if len(self._buf) >= MIN_PART:
            self._flush()
        elif self._buf:
            need = MIN_PART - len(self._buf)
            if end - start - need < MIN_PART:
                self._read_append(key, start, end)
                return
            self._read_append(key, start, start + need)
            start += need
            self._flush()
        if end - start < MIN_PART:
            self._read_append(key, start, end)
            return
        src_full = self._tier._full(key)
        self._check_source(src_full, end)
        self.size += end - start
        while start < end:
            n = end - start
            if n > MAX_COPY:
                n = MAX_COPY if n - MAX_COPY >= MIN_PART else n - MIN_PART
            self._copy_part(src_full, start, start + n)
            start += n

    def _check_source(self, src_full: str, end: int) -> None:
        """Before the first server-side copy from ``src_full``: one HEAD, so that a missing or
        short source is refused here, naming it (a server may clip a range past the end of its
        source instead of refusing it). :meth:`close` checks the size of the result again."""
        src_url = self._tier._url_of(src_full)
        self._sources.add(src_url)
        if src_full not in self._source_sizes:
            try:
                head = self._tier._head(src_full)
            except TierckptError as e:
                raise CopySourceError(f"copy source {src_url} of {self._url}: {e}") from e
            if head is None:
                raise CopySourceError(f"copy source {src_url} of {self._url}: no such object")
            self._source_sizes[src_full] = head[0]
        if self._source_sizes[src_full] < end:
            raise CopySourceError(
                f"copy source {src_url} of {self._url}: {self._source_sizes[src_full]} bytes, "
                f"bytes [.., {end}) were to be copied from it"
            )

    def close(self) -> int:
        try:
            if self._upload_id is None:
                self._tier.put(self._key, bytes(self._buf))
                self.uploaded += len(self._buf)
                return self.size
            self._flush()
            for f in self._futures:
                f.result()
            try:
                self._tier._complete_upload(self._full, self._upload_id, self._parts, self.size)
            except TierckptError as e:
                if not self.copied:
                    raise
                # every uploaded part was checked by its CRC32C: a copied part came out wrong (a
                # short source clipped: the wrong size, or a part under S3's 5 MiB minimum)
                raise CopySourceError(f"{e}; its copied parts came from {', '.join(sorted(self._sources))}") from e
            return self.size
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        for f in self._futures:
            f.cancel()
        for f in self._futures:
            if not f.cancelled():
                try:
                    f.exception()
                except BaseException:  # noqa: BLE001
                    pass
        self._futures = []
        if self._upload_id is not None:
            self._tier._abort_upload(self._full, self._upload_id)
            self._upload_id = None
