"""Reads from the S3 tier: ranged GETs streamed into the caller's buffer, resumed from the first
missing byte (with ``If-Match`` on the first response's ETag) when a body breaks."""

from __future__ import annotations

import bisect
import time
from typing import Any

from ...config.redact import redact
from ...errors import CheckpointNotFound, CorruptCheckpoint, TierError
from .client import (
    _READ_CHUNK,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    S3Requests,
    Urllib3HTTPError,
    _backoff,
    _is_conflict,
    log,
)
from .multipart import byte_view


class _Scatter:
    """Consecutive byte buffers seen as one range: :meth:`window` is the writable piece at a
    range offset, within one buffer (a response body is read into the pieces in turn)."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._starts: list[int] = []
        at = 0
        for v in views:
            self._starts.append(at)
            at += len(v)

    def window(self, pos: int, n: int) -> memoryview:
        """At most ``n`` bytes from range offset ``pos`` on, inside the buffer holding ``pos``."""
        i = bisect.bisect_right(self._starts, pos) - 1
        v = self._views[i]
        off = pos - self._starts[i]
        return v[off : off + n]


class S3Reads(S3Requests):
    """The reading half of :class:`~.tier.S3Tier` (see the module docstring)."""

    def _open_range(
        self, full: str, start: int, end: int | None, if_match: str | None = None
    ) -> tuple[Any, int, int | None, str | None]:
        """GET ``[start, end)`` (``end=None``: to the end), only if the ETag is still ``if_match``
        when given. Returns (body, length, total size if known, ETag)."""
        url = self._url_of(full)
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full}
        if start > 0 or end is not None:
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if if_match:
            kwargs["IfMatch"] = if_match
        try:
            resp = self._retrying(lambda: self._client.get_object(**kwargs), "get", url, own_retry=False)
        except ClientError as e:
            if if_match and _is_conflict(e):
                raise TierError(f"get {url}: the object changed while it was being read") from e
            raise self._client_error(e, "get", url) from e
        total: int | None = None
        cr = resp.get("ContentRange")
        if cr and "/" in cr and not cr.endswith("/*"):
            total = int(cr.rsplit("/", 1)[1])
        elif "Range" not in kwargs:
            total = int(resp["ContentLength"])
        return resp["Body"], int(resp["ContentLength"]), total, resp.get("ETag")

    def _fetch(
        self, key: str, start: int, end: int | None, dest: memoryview | list[memoryview] | None
    ) -> bytearray | None:
        """Read ``[start, end)`` of ``key`` into ``dest`` (or a new bytearray, returned); a list
        of buffers is filled one after the other (a scatter read: no temporary buffer).

        A body that breaks while streaming is resumed from the first missing byte (with
        ``If-Match`` on the first response's ETag), at most :attr:`_own_attempts` times in all.
        """
        full = self._full(key)
        url = self._url_of(full)
        if start < 0 or (end is not None and end < start):
            raise CorruptCheckpoint(f"{url}: invalid range [{start}, {end})")
        want: int | None = None if end is None else end - start
        out: _Scatter | None = None if dest is None else _Scatter(dest if isinstance(dest, list) else [dest])
        result: bytearray | None = None
        got = 0
        attempt = 0
        etag: str | None = None  # resumed requests must read the same object version
        while True:
            try:
                body, length, total, tag = self._open_range(full, start + got, end, etag)
                etag = etag or tag
            except CorruptCheckpoint:
                if end is None and got == 0:
                    head = self._head(full)
                    if head is not None and head[0] == start:  # [size, size) is an empty, valid range
                        return bytearray() if dest is None else None
                raise CorruptCheckpoint(
                    f"{url}: range [{start}, {end if end is not None else 'end'}) is outside the object"
                ) from None
            try:
                if want is None:
                    want = length
                if got + length != want:
                    raise CorruptCheckpoint(
                        f"{url}: range [{start}, {start + want}) is outside the object"
                        + (f" ({total} bytes)" if total is not None else "")
                    )
                if out is None:
                    result = bytearray(want)
                    out = _Scatter([memoryview(result)])
                while got < want:
                    n = body.readinto(out.window(got, min(want - got, _READ_CHUNK)))
                    if not n:
                        raise IncompleteReadError(actual_bytes=got, expected_bytes=want)
                    got += n
                return result
            except (HTTPClientError, IncompleteReadError, Urllib3HTTPError, ConnectionError) as e:
                attempt += 1
                if attempt >= self._own_attempts:
                    raise TierError(
                        f"get {url} [{start}, {start + (want or 0)}): the download broke {attempt} times, "
                        f"last at byte {start + got}: {type(e).__name__}: {redact(e)}"
                    ) from e
                delay = _backoff(attempt)
                log.debug(
                    "get %s: body broke at byte %d (%s); resuming in %.2fs", url, start + got, type(e).__name__, delay
                )
                time.sleep(delay)
            finally:
                try:
                    body.close()
                except Exception:  # noqa: BLE001 - closing a broken stream
                    pass

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key`` with one ranged GET (resumed if the body breaks).

        An empty range returns ``b""`` without a request. Raises :class:`CheckpointNotFound` if
        the key does not exist and :class:`CorruptCheckpoint` if the range goes past the end.
        """
        if end is not None and end == start and start >= 0:
            self._full(key)
            return b""
        data = self._fetch(key, start, end, None)
        return bytes(data) if data is not None else b""

    def read_head(self, key: str, n: int) -> tuple[bytes, int, float]:
        """The first ``min(n, size)`` bytes of ``key``, its size and modification time, with one
        ranged GET (S3 answers a range past the end with what there is)."""
        full = self._full(key)
        url = self._url_of(full)
        kwargs = {"Bucket": self.bucket, "Key": full, "Range": f"bytes=0-{max(0, n - 1)}"}
        try:
            resp = self._retrying(lambda: self._client.get_object(**kwargs), "get", url, own_retry=False)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") == "InvalidRange":  # an empty object
                return b"", 0, 0.0
            raise self._client_error(e, "get", url) from e
        try:
            data = resp["Body"].read()
        finally:
            resp["Body"].close()
        total = len(data)
        cr = resp.get("ContentRange")
        if cr and "/" in cr and not cr.endswith("/*"):
            total = int(cr.rsplit("/", 1)[1])
        modified = resp.get("LastModified")
        return bytes(data[:n]), total, modified.timestamp() if modified is not None else 0.0

    def read_into(self, key: str, start: int, buf: memoryview) -> None:
        """Fill ``buf`` with bytes ``[start, start+len(buf))`` of ``key``, streamed straight into it."""
        mv = byte_view(buf)
        if not len(mv):
            self._full(key)
            return
        self._fetch(key, start, start + len(mv), mv)

    def read_ranges(self, key: str, start: int, bufs: list[memoryview]) -> None:
        """Fill consecutive ``bufs`` from ``start`` on with one ranged GET streamed into them in
        turn (no temporary buffer of the whole range, no second copy)."""
        views = [v for v in (byte_view(b) for b in bufs) if len(v)]
        if len(views) <= 1:
            self.read_into(key, start, views[0] if views else memoryview(b""))
            return
        self._fetch(key, start, start + sum(len(v) for v in views), views)

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists (HeadObject)."""
        return self._head(self._full(key)) is not None

    def size(self, key: str) -> int:
        """Size of ``key`` (HeadObject); :class:`CheckpointNotFound` if absent."""
        full = self._full(key)
        head = self._head(full)
        if head is None:
            raise CheckpointNotFound(f"{self._url_of(full)}: no such object")
        return head[0]
