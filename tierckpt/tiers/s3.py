"""The S3 tier: an S3-compatible object store (AWS S3, SeaweedFS, MinIO, moto) through boto3.

Layout: every key is stored as ``<prefix>/<key>`` in ``cfg.bucket`` (just ``<key>`` when the
prefix is empty); :attr:`S3Tier.url` is ``s3://bucket/prefix``. Keys pass
:func:`~tierckpt.tiers.base.check_key`.

Writes:

* :meth:`S3Tier.put` is one ``PutObject`` carrying a CRC32C of the body that the server verifies.
  ``if_absent=True`` adds ``If-None-Match: *`` (the commit primitive); a server that rejects the
  header as not implemented switches this tier instance to HEAD-then-put (racy, logged once).
* :meth:`S3Tier.open_sink` returns a multipart sink: ``write_at`` calls from several threads are
  assembled into parts of ``part_size`` bytes (part *n* covers ``[n*ps, (n+1)*ps)``), and each
  part is uploaded, with its CRC32C, in the thread that completes it, as soon as it is complete.
  Objects smaller than one part are buffered and written with one ``PutObject`` at ``close``.
* :meth:`S3Tier.upload_file` uploads a local file with ``cfg.concurrency`` parts in flight on a
  thread pool owned by the tier, reading each part with ``os.pread`` (s3transfer is not used).

Part size: S3 allows at most 10,000 parts, so for an object larger than ``10000 * part_size`` the
effective part size is grown to the smallest multiple of 1 MiB that fits (see
:func:`effective_part_size`). Memory: a sink buffers at most one ``part_size`` per part that has
been partly written; ``upload_file`` holds at most ``concurrency`` parts.

Retries: botocore's ``standard`` retry mode (``cfg.max_attempts``) retries throttling, 5xx and
connection errors of every request. On top of it this module retries, with exponential backoff
and jitter and a few bounded attempts, only what botocore cannot: a GET body that breaks while
streaming (resumed from the first missing byte), and an ``UploadPart``/``PutObject`` whose
connection errors outlived botocore's attempts. A retried conditional put that comes back with
412 is checked against the stored bytes, so that our own earlier (lost-reply) attempt is not
reported as a conflict; a retried ``CompleteMultipartUpload`` that comes back with
``NoSuchUpload`` is checked against the multipart ETag computed from the parts.

Errors: missing objects raise :class:`~tierckpt.errors.CheckpointNotFound`, bad ranges
:class:`~tierckpt.errors.CorruptCheckpoint`, an unreachable endpoint (after retries)
:class:`~tierckpt.errors.TierUnavailable`, refused credentials or permissions (``AccessDenied``,
unknown access key, wrong secret key, expired token, no credentials; an authentication failure
is never retried, by botocore or here) :class:`~tierckpt.errors.TierAccessDenied`, everything
else :class:`~tierckpt.errors.TierError`; messages name the ``s3://`` url of the key (and the
part). Credentials come only from boto3's standard chain and are never part of a message, a log
line or a repr: every text from botocore, urllib3 or the server goes through
:func:`tierckpt.redact.redact` (botocore's connection errors quote the full request URL).

Server notes (checked with moto 5.2 and SeaweedFS 4.48): both honour ``If-None-Match: *`` on
``PutObject`` (412 ``PreconditionFailed``); SeaweedFS verifies ``x-amz-checksum-crc32c`` on
``PutObject`` and ``UploadPart`` (400 ``BadDigest``), moto stores but does not verify it;
SeaweedFS keeps empty "directories" as common prefixes after their objects are deleted, which
:meth:`S3Tier.list_dirs` filters out and :meth:`S3Tier.delete_prefix` cleans up.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from typing import Any, Callable, Iterable, Iterator, TypeVar

import google_crc32c

from ..config import MiB, S3_MAX_PART, S3Config, check_endpoint_url
from ..errors import (
    CheckpointNotFound,
    CommitConflict,
    ConfigError,
    CorruptCheckpoint,
    TierAccessDenied,
    TierckptError,
    TierError,
    TierUnavailable,
)
from ..redact import redact, redact_url
from .base import DataSink, ObjectInfo, Tier, check_key

try:  # boto3 is a hard dependency; keep the import error readable if it is missing.
    import boto3
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        HTTPClientError,
        IncompleteReadError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError
    from urllib3.exceptions import HTTPError as Urllib3HTTPError

    _IMPORT_ERROR: ImportError | None = None
except ImportError as _e:  # pragma: no cover - exercised only without boto3
    _IMPORT_ERROR = _e

__all__ = ["S3Tier", "effective_part_size", "crc32c_b64", "MAX_PARTS"]

log = logging.getLogger(__name__)

MAX_PARTS = 10_000
"""S3's limit on the number of parts of one multipart upload."""

_OWN_ATTEMPTS = 4
"""Tries (first one included) of this module's own retry loop, on top of botocore's."""
_BACKOFF_BASE_S = 0.2
_BACKOFF_MAX_S = 5.0
_READ_CHUNK = 8 * MiB
_CRC_CHUNK = 4 * MiB
_DELETE_BATCH = 1000

_T = TypeVar("_T")


# -- small helpers ---------------------------------------------------------------------------


def crc32c_b64(data: bytes | bytearray | memoryview) -> str:
    """Base64 of the big-endian CRC32C of ``data``: the value of ``x-amz-checksum-crc32c``.

    google-crc32c only takes ``bytes``; other buffers are fed through it in small copied slices
    so that a large part is never duplicated whole.
    """
    if isinstance(data, bytes):
        crc = google_crc32c.value(data)
    else:
        mv = memoryview(data).cast("B")
        crc = 0
        for i in range(0, len(mv), _CRC_CHUNK):
            crc = google_crc32c.extend(crc, bytes(mv[i : i + _CRC_CHUNK]))
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


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


def _backoff(attempt: int) -> float:
    """Delay before retry ``attempt`` (1-based): exponential, capped, with +-50% jitter."""
    return min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * (2 ** (attempt - 1))) * (0.5 + random.random())


def _err_code(e: "ClientError") -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _err_status(e: "ClientError") -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _err_retried(e: "ClientError") -> int:
    """How many times botocore retried the request that finally failed with ``e``."""
    return int(e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)


def _err_message(e: "ClientError") -> str:
    """The server's message of ``e``, redacted and cut to one short line."""
    text = " ".join(redact(str(e.response.get("Error", {}).get("Message", "")) or redact(e)).split())
    return text if len(text) <= 300 else text[:297] + "..."


_DENIED: dict[str, str] = {
    "AccessDenied": "the credentials in use are not allowed to do this (check the bucket policy and IAM permissions)",
    "AllAccessDisabled": "all access to the bucket is disabled",
    "AccountProblem": "a problem with the account prevents this operation",
    "InvalidAccessKeyId": "the server does not know the access key id in use (check AWS_ACCESS_KEY_ID or the profile)",
    "SignatureDoesNotMatch": "the secret access key does not match the access key id "
                             "(check AWS_SECRET_ACCESS_KEY or the profile)",
    "InvalidSecurity": "the security credentials are invalid",
    "ExpiredToken": "the session token has expired (refresh the credentials)",
    "TokenRefreshRequired": "the session token has expired (refresh the credentials)",
    "InvalidToken": "the session token is malformed or invalid",
}
"""S3 error codes that mean "the credentials were refused or lack permission", with a hint each."""


def _is_denied(e: "ClientError") -> bool:
    """Whether ``e`` is an authentication or authorization failure (never worth a retry)."""
    code = _err_code(e)
    return code in _DENIED or (_err_status(e) in (401, 403) and code in ("", "401", "403", "Forbidden", "Unauthorized"))


def _is_not_found(e: "ClientError") -> bool:
    return _err_code(e) in ("NoSuchKey", "404", "NotFound") or (_err_status(e) == 404 and _err_code(e) != "NoSuchBucket")


def _is_conflict(e: "ClientError") -> bool:
    return _err_code(e) in ("PreconditionFailed", "ConditionalRequestConflict") or _err_status(e) in (412, 409)


def _rejects_conditional(e: "ClientError") -> bool:
    """Whether the server refused ``If-None-Match`` as unsupported (rather than failing it)."""
    code, status = _err_code(e), _err_status(e)
    if status == 501 or code == "NotImplemented":
        return True
    if code in ("InvalidArgument", "InvalidRequest", "InvalidHeader"):
        err = e.response.get("Error", {})
        text = f"{err.get('Message', '')} {err.get('ArgumentName', '')}".lower()
        return "if-none-match" in text or "ifnonematch" in text
    return False


def _multipart_etag(etags: Iterable[str]) -> str:
    """The ETag S3 gives a completed multipart upload: md5 of the parts' md5s, ``-N``."""
    digests = [bytes.fromhex(t.strip('"')) for t in etags]
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


class _ViewReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview: lets botocore send and re-send (on retry) a
    caller's buffer without copying it whole."""

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

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._mv) if size is None or size < 0 else min(len(self._mv), self._pos + size)
        out = bytes(self._mv[self._pos : end])
        self._pos = end
        return out


def _byte_view(data: Any) -> memoryview:
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def make_client(cfg: S3Config) -> Any:
    """A boto3 S3 client for ``cfg``: standard retries, timeouts, a connection pool larger than
    ``cfg.concurrency`` and path-style addressing for custom endpoints.

    Credentials come from boto3's standard chain (environment, shared files, instance role).
    A fresh :class:`boto3.session.Session` is used because sessions are not thread-safe while
    clients are. Raises :class:`ConfigError` for an endpoint URL or region botocore refuses
    (the message shows the URL redacted).
    """
    if _IMPORT_ERROR is not None:  # pragma: no cover
        raise TierUnavailable(f"the S3 tier needs boto3: {_IMPORT_ERROR}")
    s3_opts: dict[str, Any] = {}
    if cfg.endpoint_url:
        s3_opts["addressing_style"] = "path"
    conf = BotoConfig(
        region_name=cfg.region or None,
        retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        max_pool_connections=max(cfg.concurrency + 4, 10),
        tcp_keepalive=True,
        s3=s3_opts or None,
        # We send our own CRC32C headers; never let botocore add its default CRC32 (or demand awscrt).
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        user_agent_extra="tierckpt",
    )
    check_endpoint_url(cfg.endpoint_url)
    try:
        session = boto3.session.Session()
        return session.client("s3", endpoint_url=cfg.endpoint_url or None, region_name=cfg.region or None, config=conf)
    except ValueError as e:  # botocore refuses an endpoint or region our checks let through
        raise ConfigError(f"[s3] endpoint_url/region: botocore refuses {redact_url(cfg.endpoint_url)!r} / "
                          f"{cfg.region!r}: {redact(e)}") from None
    except BotoCoreError as e:
        raise TierUnavailable(f"cannot create the S3 client for {redact_url(cfg.endpoint_url) or 'AWS'}: "
                              f"{type(e).__name__}: {redact(e)}") from None


# -- the tier --------------------------------------------------------------------------------


class S3Tier(Tier):
    """A tier in an S3 bucket under ``cfg.prefix``.

    Args:
        cfg: the ``[s3]`` settings (validated here).
        client: a boto3 S3 client to use instead of building one from ``cfg`` (tests); the tier
            does not close a client it was given.

    Thread safety: every method may be called from several threads at once.
    """

    name = "s3"

    def __init__(self, cfg: S3Config, *, client: Any = None) -> None:
        cfg.validate()
        prefix = cfg.prefix.strip("/")
        if prefix:
            try:
                check_key(prefix)
            except CorruptCheckpoint:
                raise ConfigError(f"[s3] prefix: {cfg.prefix!r} is not a valid key prefix") from None
        self.cfg = cfg
        self.bucket = cfg.bucket
        self.prefix = prefix
        self._root = f"{prefix}/" if prefix else ""
        self.url = f"s3://{cfg.bucket}/{prefix}" if prefix else f"s3://{cfg.bucket}"
        self._own_client = client is None
        self._client = make_client(cfg) if client is None else client
        self._conditional = cfg.conditional_commit
        self.conditional_create = cfg.conditional_commit
        self.read_range = cfg.part_size
        self.read_concurrency = cfg.concurrency
        self.keep = cfg.keep
        self.keep_every = cfg.keep_every
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    # -- naming ---------------------------------------------------------------------------
    def _full(self, key: str) -> str:
        return self._root + check_key(key)

    def _url_of(self, full: str) -> str:
        return f"s3://{self.bucket}/{full}"

    def _check_prefix(self, prefix: str) -> str:
        if prefix:
            check_key(prefix[:-1] if prefix.endswith("/") else prefix)
        return self._root + prefix

    @property
    def client(self) -> Any:
        """The boto3 client (for tests and tools)."""
        return self._client

    # -- error handling -------------------------------------------------------------------
    def _client_error(self, e: "ClientError", what: str, url: str) -> TierckptError:
        code, status = _err_code(e), _err_status(e)
        if _is_not_found(e):
            return CheckpointNotFound(f"{url}: no such object")
        if code == "NoSuchBucket":
            return TierUnavailable(f"{what} {url}: bucket {self.bucket!r} does not exist")
        if code == "InvalidRange" or status == 416:
            return CorruptCheckpoint(f"{url}: requested range is outside the object ({what})")
        if _is_denied(e):
            hint = _DENIED.get(code, "the credentials were refused or lack permission for this operation")
            name = f"{code}, HTTP {status}" if code and not code.isdigit() else f"HTTP {status}"
            return TierAccessDenied(f"{what} {url}: access denied ({name}): {hint}")
        return TierError(f"{what} {url} failed: {redact(code) or 'error'} (HTTP {status}): {_err_message(e)}")

    @staticmethod
    def _transport_error(e: BaseException, what: str, url: str) -> TierError:
        """A tierckpt error for a botocore/urllib3 error that is not a ``ClientError`` (redacted:
        botocore's messages carry the full request URL, endpoint user information included)."""
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return TierAccessDenied(
                f"{what} {url}: no usable S3 credentials ({type(e).__name__}): set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, a profile (AWS_PROFILE) or an instance role"
            )
        if isinstance(e, BotoConnectionError):
            return TierUnavailable(f"{what} {url}: cannot reach the S3 endpoint after retries: {type(e).__name__}: {redact(e)}")
        retried = isinstance(e, (HTTPClientError, IncompleteReadError))
        return TierError(f"{what} {url} failed{' after retries' if retried else ''}: {type(e).__name__}: {redact(e)}")

    def _retrying(self, fn: Callable[[], _T], what: str, url: str, *, own_retry: bool) -> _T:
        """Run ``fn`` (one boto3 call, already retried by botocore).

        ``ClientError`` propagates unchanged for the caller to classify. Connection-level errors
        that outlived botocore's attempts are retried here ``_OWN_ATTEMPTS`` times in all when
        ``own_retry`` (for idempotent uploads), then raised as :class:`TierError`.
        """
        attempt = 0
        while True:
            try:
                return fn()
            except ClientError:
                raise
            except (BotoConnectionError, HTTPClientError, IncompleteReadError) as e:
                attempt += 1
                if not own_retry or attempt >= _OWN_ATTEMPTS:
                    raise self._transport_error(e, what, url) from e
                delay = _backoff(attempt)
                log.debug("%s %s: %s; retrying in %.2fs", what, url, type(e).__name__, delay)
                time.sleep(delay)
            except BotoCoreError as e:
                raise self._transport_error(e, what, url) from e

    def _call(self, fn: Callable[[], _T], what: str, url: str, *, own_retry: bool = False) -> _T:
        """:meth:`_retrying` with ``ClientError`` mapped to tierckpt errors."""
        try:
            return self._retrying(fn, what, url, own_retry=own_retry)
        except ClientError as e:
            raise self._client_error(e, what, url) from e

    # -- writes ---------------------------------------------------------------------------
    def _put_object(
        self, full: str, body: bytes, crc: str, *, if_none_match: bool = False, tries: list[int] | None = None
    ) -> Any:
        """One PutObject with our CRC32C; ``ClientError`` propagates. ``tries[0]`` counts the
        requests this module sent (botocore's own retries come on top)."""
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": full,
            "Body": body,
            "ChecksumAlgorithm": "CRC32C",
            "ChecksumCRC32C": crc,
        }
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"

        def call() -> Any:
            if tries is not None:
                tries[0] += 1
            return self._client.put_object(**kwargs)

        return self._retrying(call, "put", self._url_of(full), own_retry=True)

    def _same_content(self, full: str, body: bytes) -> bool:
        """Whether ``full`` exists and holds exactly ``body`` (best effort; False on any error)."""
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=full)
            try:
                return bool(resp["Body"].read() == body)
            finally:
                resp["Body"].close()
        except (ClientError, BotoCoreError, Urllib3HTTPError, OSError):
            return False

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Store ``data`` at ``key`` with one PutObject (server-verified CRC32C).

        ``if_absent=True`` uses ``If-None-Match: *``: a 412/409 raises :class:`CommitConflict`,
        unless the request had been retried (by botocore or here) and the stored bytes equal ``data`` (our own
        earlier attempt landed and only its reply was lost; two writers putting identical bytes
        are indistinguishable from that and both succeed). A server that rejects the header as
        unsupported switches this instance to HEAD-then-put, which is not atomic.
        """
        full = self._full(key)
        url = self._url_of(full)
        body = data if isinstance(data, bytes) else bytes(data)
        crc = crc32c_b64(body)
        if if_absent and self._conditional:
            tries = [0]
            try:
                self._put_object(full, body, crc, if_none_match=True, tries=tries)
                return
            except ClientError as e:
                if _is_conflict(e):
                    if (_err_retried(e) > 0 or tries[0] > 1) and self._same_content(full, body):
                        log.debug("put %s: 412 after a retry, but the stored bytes are ours", url)
                        return
                    raise CommitConflict(f"{url} already exists: another writer committed it") from None
                if not _rejects_conditional(e):
                    raise self._client_error(e, "put", url) from e
                with self._lock:
                    if self._conditional:
                        self._conditional = False
                        log.warning(
                            "%s: the server does not support If-None-Match on PutObject (%s); "
                            "falling back to check-then-put, which is not atomic",
                            self.url,
                            _err_code(e) or _err_status(e),
                        )
        if if_absent and self._head(full) is not None:
            raise CommitConflict(f"{url} already exists: another writer committed it")
        try:
            self._put_object(full, body, crc)
        except ClientError as e:
            raise self._client_error(e, "put", url) from e

    def open_sink(self, key: str, size: int) -> DataSink:
        """A multipart sink for an object of exactly ``size`` bytes (see :class:`_S3Sink`)."""
        return _S3Sink(self, key, size)

    def _create_upload(self, full: str) -> str:
        url = self._url_of(full)
        resp = self._call(
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=full, ChecksumAlgorithm="CRC32C"),
            "create multipart upload for",
            url,
        )
        return str(resp["UploadId"])

    def _upload_part(self, full: str, upload_id: str, pn: int, nparts: int, body: Any, crc: str) -> dict[str, Any]:
        """Upload part ``pn`` (``body``: bytes, bytearray or a seekable reader); return the
        ``Parts`` entry for CompleteMultipartUpload."""
        url = self._url_of(full)
        what = f"upload part {pn}/{nparts} of"

        def call() -> Any:
            if hasattr(body, "seek"):
                body.seek(0)
            return self._client.upload_part(
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                PartNumber=pn,
                Body=body,
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=crc,
            )

        resp = self._call(call, what, url, own_retry=True)
        echoed = resp.get("ChecksumCRC32C")
        if echoed and echoed != crc:
            raise TierError(f"{what} {url}: server stored CRC32C {echoed}, we sent {crc}")
        return {"PartNumber": pn, "ETag": resp["ETag"], "ChecksumCRC32C": crc}

    def _complete_upload(self, full: str, upload_id: str, parts: list[dict[str, Any]], size: int) -> None:
        url = self._url_of(full)
        parts = sorted(parts, key=lambda p: p["PartNumber"])
        try:
            self._retrying(
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
                "complete multipart upload of",
                url,
                own_retry=False,
            )
        except ClientError as e:
            if _err_code(e) == "NoSuchUpload" and _err_retried(e) > 0:
                head = self._head(full)
                if head is not None and head[1] == _multipart_etag(p["ETag"] for p in parts) and head[0] == size:
                    log.debug("complete %s: NoSuchUpload after a retry, but the object is ours", url)
                    return
            raise self._client_error(e, "complete multipart upload of", url) from e

    def _abort_upload(self, full: str, upload_id: str) -> bool:
        """AbortMultipartUpload; never raises. Returns whether the server confirmed it."""
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            return True
        except ClientError as e:
            if _err_code(e) == "NoSuchUpload":
                return True
            log.warning("cannot abort the multipart upload of %s: %s", self._url_of(full), redact(_err_code(e)) or _err_message(e))
        except Exception as e:  # noqa: BLE001 - abort must never raise
            log.warning("cannot abort the multipart upload of %s: %s: %s", self._url_of(full), type(e).__name__, redact(e))
        return False

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise TierError(f"{self.url}: the tier is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.cfg.concurrency, thread_name_prefix="tierckpt-s3")
            return self._pool

    def upload_file(self, key: str, path: str, *, progress: Callable[[int], None] | None = None) -> None:  # type: ignore[override]
        """Upload the local file ``path`` to ``key``.

        Files smaller than ``part_size`` go in one PutObject; larger ones in a multipart upload
        with up to ``cfg.concurrency`` parts in flight on the tier's thread pool (shared by
        concurrent calls), each read with ``os.pread`` and sent with its CRC32C. ``progress(n)``
        is called in the calling thread after each part (with the part's size). On any failure,
        KeyboardInterrupt included, pending parts are cancelled, running ones awaited and the
        upload aborted; nothing becomes visible under ``key``.
        """
        full = self._full(key)
        url = self._url_of(full)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise TierError(e.errno or 0, f"cannot open {path} to upload it to {url}: {e.strerror or e}") from e
        try:
            size = os.fstat(fd).st_size
            if size < self.cfg.part_size:
                data = _pread_exact(fd, size, 0, path, url)
                self.put(key, data)
                if progress is not None:
                    progress(size)
                return
            self._upload_fd_multipart(fd, path, full, size, progress)
        finally:
            os.close(fd)

    def _upload_fd_multipart(
        self, fd: int, path: str, full: str, size: int, progress: Callable[[int], None] | None
    ) -> None:
        url = self._url_of(full)
        ps = effective_part_size(size, self.cfg.part_size)
        nparts = -(-size // ps)
        pool = self._executor()
        upload_id = self._create_upload(full)
        stop = threading.Event()

        def one(pn: int) -> tuple[dict[str, Any], int] | None:
            if stop.is_set():
                return None
            off = (pn - 1) * ps
            n = min(ps, size - off)
            data = _pread_exact(fd, n, off, path, url)
            return self._upload_part(full, upload_id, pn, nparts, data, crc32c_b64(data)), n

        futures: list[Future[tuple[dict[str, Any], int] | None]] = []
        try:
            futures = [pool.submit(one, pn) for pn in range(1, nparts + 1)]
            parts: list[dict[str, Any]] = []
            for fut in as_completed(futures):
                res = fut.result()
                if res is None:  # pragma: no cover - only after stop, which raises first
                    continue
                parts.append(res[0])
                if progress is not None:
                    progress(res[1])
            self._complete_upload(full, upload_id, parts, size)
        except BaseException:
            stop.set()
            for f in futures:
                f.cancel()
            wait(futures)
            self._abort_upload(full, upload_id)
            raise

    # -- reads ----------------------------------------------------------------------------
    def _head(self, full: str) -> tuple[int, str] | None:
        """(size, ETag) of ``full``, or None if it does not exist."""
        url = self._url_of(full)
        try:
            resp = self._retrying(lambda: self._client.head_object(Bucket=self.bucket, Key=full), "head", url, own_retry=False)
        except ClientError as e:
            if _is_not_found(e):
                return None
            raise self._client_error(self._why_denied(full, e), "head", url) from e
        return int(resp["ContentLength"]), str(resp.get("ETag", "")).strip('"')

    def _why_denied(self, full: str, e: "ClientError") -> "ClientError":
        """A HEAD response has no body, so a refused HEAD says only "403". Ask once more with a
        one-byte GET, whose error names the reason (``SignatureDoesNotMatch``, ``AccessDenied``,
        ...); return that error, or ``e`` when the GET does not tell more."""
        if not _is_denied(e) or _err_code(e) in _DENIED:
            return e
        try:
            self._client.get_object(Bucket=self.bucket, Key=full, Range="bytes=0-0")["Body"].close()
        except ClientError as g:
            if _err_code(g) in _DENIED:
                return g
        except Exception:  # noqa: BLE001 - only an explanation; the HEAD's error stands
            pass
        return e

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
        mv = _byte_view(buf)
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

    def _list_raw(self, full_prefix: str, **extra: Any) -> Iterator[dict[str, Any]]:
        """Pages of ListObjectsV2 under ``full_prefix``."""
        url = self._url_of(full_prefix)
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix, **extra):
                yield page
        except ClientError as e:
            raise self._client_error(e, "list", url) from e
        except BotoCoreError as e:
            raise self._transport_error(e, "list", url) from e

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (paginated ListObjectsV2).

        Keys are relative to ``cfg.prefix``; stored keys that are not valid tier keys (directory
        markers, foreign objects such as ``a//b``) are skipped.
        """
        full_prefix = self._check_prefix(prefix)
        n = len(self._root)
        for page in self._list_raw(full_prefix):
            for obj in page.get("Contents", ()):
                key = obj["Key"][n:]
                try:
                    check_key(key)
                except CorruptCheckpoint:
                    continue
                yield ObjectInfo(key, int(obj["Size"]), obj["LastModified"].timestamp())

    def _has_objects(self, full_prefix: str) -> bool:
        for page in self._list_raw(full_prefix, PaginationConfig={"PageSize": 1, "MaxItems": 1}):
            if page.get("Contents"):
                return True
        return False

    def list_dirs(self) -> list[str]:
        """The first path components of all keys, sorted (ListObjectsV2 with ``Delimiter="/"``).

        A common prefix with no object under it (SeaweedFS keeps empty directories) is left out.
        """
        names: list[str] = []
        n = len(self._root)
        for page in self._list_raw(self._root, Delimiter="/"):
            for cp in page.get("CommonPrefixes", ()):
                p = cp["Prefix"]
                name = p[n:].rstrip("/")
                try:
                    check_key(name)
                except CorruptCheckpoint:
                    continue
                if "/" not in name and self._has_objects(p):
                    names.append(name)
        return sorted(set(names))

    # -- deletes --------------------------------------------------------------------------
    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key is not an error."""
        full = self._full(key)
        url = self._url_of(full)
        try:
            self._retrying(lambda: self._client.delete_object(Bucket=self.bucket, Key=full), "delete", url, own_retry=False)
        except ClientError as e:
            if not _is_not_found(e):
                raise self._client_error(e, "delete", url) from e

    def _delete_keys(self, keys: list[str], *, best_effort: bool = False) -> None:
        """DeleteObjects in batches of 1000 full keys."""
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = keys[i : i + _DELETE_BATCH]
            url = self._url_of(batch[0])
            try:
                resp = self._call(
                    lambda: self._client.delete_objects(
                        Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                    ),
                    "delete",
                    url,
                )
            except TierError:
                if best_effort:
                    continue
                raise
            errors = [e for e in resp.get("Errors", ()) if e.get("Code") not in ("NoSuchKey",)]
            if errors and not best_effort:
                first = errors[0]
                code = str(first.get("Code", ""))
                more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
                url = self._url_of(str(first.get("Key", "?")))
                if code in _DENIED:
                    raise TierAccessDenied(f"delete {url}: access denied ({code}): {_DENIED[code]}{more}")
                message = " ".join(redact(first.get("Message", "")).split())[:300]
                raise TierError(f"delete {url} failed: {redact(code)}: {message}{more}")

    def delete_many(self, keys: list[str]) -> int:
        """Delete exactly these keys with DeleteObjects (missing ones are not an error), then the
        empty directory entries some servers (SeaweedFS) keep for their parents. Returns how many
        keys were asked for (S3 does not tell which existed)."""
        full = [self._full(k) for k in keys]
        if not full:
            return 0
        self._delete_keys(full)
        dirs = {k.rsplit("/", 1)[0] + "/" for k in full if "/" in k}
        self._delete_keys(sorted(dirs, key=lambda d: (-d.count("/"), d)), best_effort=True)
        return len(full)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix`` (which must end with ``/``); return how many.

        Uses DeleteObjects (1000 keys per request), then removes empty directory entries that
        some servers (SeaweedFS) keep, and aborts multipart uploads under the prefix (the S3 form
        of leftover partial files). The count is the number of objects listed and deleted.
        """
        if not prefix.endswith("/"):
            raise ValueError(f"delete_prefix needs a prefix ending with '/', got {prefix!r}")
        full_prefix = self._check_prefix(prefix)
        keys = [obj["Key"] for page in self._list_raw(full_prefix) for obj in page.get("Contents", ())]
        self._delete_keys(keys)
        dirs = {full_prefix}
        for k in keys:
            parent = k.rsplit("/", 1)[0]
            while len(parent) + 1 > len(full_prefix):
                dirs.add(parent + "/")
                parent = parent.rsplit("/", 1)[0]
        self._delete_keys(sorted(dirs, key=lambda d: (-d.count("/"), d)), best_effort=True)
        try:
            self.abort_stale_uploads(prefix)
        except TierError as e:
            log.warning("delete_prefix %s: cannot abort multipart uploads: %s", self._url_of(full_prefix), redact(e))
        return sum(1 for k in keys if not k.endswith("/"))

    def _last_part_time(self, key: str, upload_id: str) -> float | None:
        """Epoch time of the most recently uploaded part of an upload (None: no parts, or the
        upload vanished)."""
        latest: float | None = None
        try:
            for page in self._client.get_paginator("list_parts").paginate(Bucket=self.bucket, Key=key, UploadId=upload_id):
                for part in page.get("Parts", ()) or ():
                    t = part["LastModified"].timestamp()
                    latest = t if latest is None else max(latest, t)
        except ClientError as e:
            if _err_code(e) == "NoSuchUpload":
                return None
            raise self._client_error(e, "list parts of", self._url_of(key)) from e
        except BotoCoreError as e:
            raise self._transport_error(e, "list parts of", self._url_of(key)) from e
        return latest

    def abort_stale(self, older_than_s: float) -> int:
        return self.abort_stale_uploads("", older_than_s=older_than_s)

    def abort_stale_uploads(self, prefix: str = "", older_than_s: float = 0) -> int:
        """Abort multipart uploads under ``prefix`` idle for at least ``older_than_s`` seconds;
        return how many were aborted.

        An upload is idle since its most recent event, by the server's clock: its initiation
        or, when that is old enough, its most recently uploaded part (one ListParts per such
        candidate), so that a long promotion still sending parts is never aborted. With
        ``older_than_s=0`` every upload under the prefix is aborted without ListParts. (moto
        reports a fixed 2010 initiation time, so there only part times protect an upload.)
        """
        full_prefix = self._check_prefix(prefix)
        url = self._url_of(full_prefix)
        now = time.time()
        n = 0
        paginator = self._client.get_paginator("list_multipart_uploads")
        try:
            pages = list(paginator.paginate(Bucket=self.bucket, Prefix=full_prefix))
        except ClientError as e:
            raise self._client_error(e, "list multipart uploads under", url) from e
        except BotoCoreError as e:
            raise self._transport_error(e, "list multipart uploads under", url) from e
        for page in pages:
            for up in page.get("Uploads", ()) or ():
                initiated = up.get("Initiated")
                age = now - initiated.timestamp() if initiated is not None else float("inf")
                if age < older_than_s:
                    continue
                if older_than_s > 0:
                    last = self._last_part_time(up["Key"], up["UploadId"])
                    if last is not None and now - last < older_than_s:
                        continue
                if self._abort_upload(up["Key"], up["UploadId"]):
                    n += 1
        return n

    def close(self) -> None:
        """Shut the upload pool down and close the client (if the tier built it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if self._own_client:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - best effort
                pass


def _pread_exact(fd: int, n: int, off: int, path: str, url: str) -> bytes:
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


class _S3Sink(DataSink):
    """A multipart upload assembled from ``write_at`` calls.

    Part ``n`` (0-based here, ``n+1`` on the wire) covers ``[n*ps, min((n+1)*ps, size))`` with
    ``ps = effective_part_size(size, cfg.part_size)``. ``write_at`` copies its bytes into the
    part's buffer (the caller may reuse its buffer afterwards); the thread whose write completes
    a part uploads it before returning. A write that covers a whole part is uploaded straight
    from the caller's buffer, without a copy. Ranges must be disjoint (each byte written once).

    Objects smaller than ``cfg.part_size`` are buffered whole and written with one PutObject at
    ``close``. Any failed part makes the sink failed: later calls raise, ``close`` aborts.
    """

    def __init__(self, tier: S3Tier, key: str, size: int) -> None:
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
        mv = _byte_view(data)
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
                self._upload(part, _ViewReader(chunk), crc32c_b64(chunk))
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
                    raise TierError(f"{self._url}: close() after {self._single_filled} of {self._size} bytes were written")
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
