"""Reads from the S3 tier: ranged GETs streamed into the caller's buffer, resumed from the first
missing byte (with ``If-Match`` on the first response's ETag) when a body breaks."""

from __future__ import annotations

import time
from typing import Any

from ...errors import CheckpointNotFound, CorruptCheckpoint, TierError
from ...redact import redact
from .client import (
    _OWN_ATTEMPTS,
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

    def _fetch(self, key: str, start: int, end: int | None, dest: memoryview | None) -> bytearray | None:
        """Read ``[start, end)`` of ``key`` into ``dest`` (or a new bytearray, returned).

        A body that breaks while streaming is resumed from the first missing byte (with
        ``If-Match`` on the first response's ETag), at most ``_OWN_ATTEMPTS`` times in all.
        """
        full = self._full(key)
        url = self._url_of(full)
        if start < 0 or (end is not None and end < start):
            raise CorruptCheckpoint(f"{url}: invalid range [{start}, {end})")
        want: int | None = None if end is None else end - start
        out: memoryview | None = dest
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
                    out = memoryview(result)
                while got < want:
                    n = body.readinto(out[got : min(want, got + _READ_CHUNK)])
                    if not n:
                        raise IncompleteReadError(actual_bytes=got, expected_bytes=want)
                    got += n
                return result
            except (HTTPClientError, IncompleteReadError, Urllib3HTTPError, ConnectionError) as e:
                attempt += 1
                if attempt >= _OWN_ATTEMPTS:
                    raise TierError(
                        f"get {url} [{start}, {start + (want or 0)}): the download broke {attempt} times, "
                        f"last at byte {start + got}: {type(e).__name__}: {redact(e)}"
                    ) from e
                delay = _backoff(attempt)
                log.debug("get %s: body broke at byte %d (%s); resuming in %.2fs", url, start + got, type(e).__name__, delay)
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

    def read_into(self, key: str, start: int, buf: memoryview) -> None:
        """Fill ``buf`` with bytes ``[start, start+len(buf))`` of ``key``, streamed straight into it."""
        mv = byte_view(buf)
        if not len(mv):
            self._full(key)
            return
        self._fetch(key, start, start + len(mv), mv)

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
