"""The S3 tier's request layer: the boto3 client, retries and the mapping of errors.

:func:`make_client` builds the client (standard retries, timeouts, pool size, path-style
addressing for custom endpoints). :class:`S3Requests` is the base of :class:`~.tier.S3Tier`: key
naming, the mapping of botocore/urllib3 errors to tierckpt errors (redacted, naming the
``s3://`` url), this module's own retry loop on top of botocore's, and the HEAD and LIST
requests that reads, writes and deletes share. Every method may be called from several threads.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ...config import MiB, S3Config, check_endpoint_url
from ...config.redact import redact, redact_url
from ...errors import (
    CheckpointNotFound,
    ConfigError,
    CorruptCheckpoint,
    TierAccessDenied,
    TierckptError,
    TierError,
    TierUnavailable,
)
from ..base import Tier, check_key

try:  # boto3 is a hard dependency; keep the import error readable if it is missing.
    import boto3
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        HTTPClientError,
        IncompleteReadError,
        NoCredentialsError,
        PartialCredentialsError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from urllib3.exceptions import HTTPError as Urllib3HTTPError  # noqa: F401 - for reads and writes

    _IMPORT_ERROR: ImportError | None = None
except ImportError as _e:  # pragma: no cover - exercised only without boto3
    _IMPORT_ERROR = _e

log = logging.getLogger("tierckpt.tiers.s3")

_OWN_ATTEMPTS = 4
"""Tries (first one included) of this module's own retry loop, on top of botocore's; fewer when
``[s3] max_attempts`` is lower (:meth:`S3Requests._own_attempts`)."""
_BACKOFF_BASE_S = 0.2
_BACKOFF_MAX_S = 5.0
_READ_CHUNK = 8 * MiB
_DELETE_BATCH = 1000
_SEND_BLOCK = 1 << 20
"""Bytes urllib3 reads from a request body per ``sendall`` (see :func:`_send_large_blocks`)."""

_T = TypeVar("_T")


def _backoff(attempt: int) -> float:
    """Delay before retry ``attempt`` (1-based): exponential, capped, with +-50% jitter."""
    return min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * (2 ** (attempt - 1))) * (0.5 + random.random())


def _err_code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _err_status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _err_retried(e: ClientError) -> int:
    """How many times botocore retried the request that finally failed with ``e``."""
    return int(e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)


def _err_message(e: ClientError) -> str:
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


def _is_denied(e: ClientError) -> bool:
    """Whether ``e`` is an authentication or authorization failure (never worth a retry)."""
    code = _err_code(e)
    return code in _DENIED or (_err_status(e) in (401, 403) and code in ("", "401", "403", "Forbidden", "Unauthorized"))


def _is_not_found(e: ClientError) -> bool:
    return _err_code(e) in ("NoSuchKey", "404", "NotFound") or (
        _err_status(e) == 404 and _err_code(e) != "NoSuchBucket"
    )


def _is_conflict(e: ClientError) -> bool:
    return _err_code(e) in ("PreconditionFailed", "ConditionalRequestConflict") or _err_status(e) in (412, 409)


def _rejects_conditional(e: ClientError) -> bool:
    """Whether the server refused ``If-None-Match`` as unsupported (rather than failing it)."""
    code, status = _err_code(e), _err_status(e)
    if status == 501 or code == "NotImplemented":
        return True
    if code in ("InvalidArgument", "InvalidRequest", "InvalidHeader"):
        err = e.response.get("Error", {})
        text = f"{err.get('Message', '')} {err.get('ArgumentName', '')}".lower()
        return "if-none-match" in text or "ifnonematch" in text
    return False


def make_client(cfg: S3Config) -> Any:
    """A boto3 S3 client for ``cfg``: standard retries, timeouts, a connection pool larger than
    ``cfg.concurrency`` and path-style addressing for custom endpoints.

    Credentials come from boto3's standard chain (environment, shared files, instance role).
    A fresh :class:`boto3.session.Session` is used because sessions are not thread-safe while
    clients are (and each resolves the credentials of its time); they share one botocore data
    loader (:func:`_session`), so only a process's first client pays for parsing the service
    model and endpoint rules. Raises :class:`ConfigError` for an endpoint URL or region botocore refuses
    (the message shows the URL redacted).
    """
    if _IMPORT_ERROR is not None:  # pragma: no cover
        raise TierUnavailable(f"the S3 tier needs boto3: {_IMPORT_ERROR}")
    # Every body we send carries a CRC32C that the server verifies, so the SigV4 signature need
    # not cover a SHA-256 of the payload: botocore skips it on https by itself but computes it on
    # http endpoints, where it cost 1.2 of the 2.0 client CPU-seconds per GiB uploaded
    # (SeaweedFS on loopback, 16 MiB parts).
    s3_opts: dict[str, Any] = {"payload_signing_enabled": False}
    if cfg.endpoint_url:
        s3_opts["addressing_style"] = "path"
    conf = BotoConfig(
        region_name=cfg.region or None,
        retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        max_pool_connections=max(cfg.concurrency + 4, 10),
        tcp_keepalive=True,
        s3=s3_opts,
        # We send our own CRC32C headers; never let botocore add its default CRC32 (or demand awscrt).
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        user_agent_extra="tierckpt",
    )
    check_endpoint_url(cfg.endpoint_url)
    try:
        session = _session()
        client = session.client(
            "s3", endpoint_url=cfg.endpoint_url or None, region_name=cfg.region or None, config=conf
        )
    except ValueError as e:  # botocore refuses an endpoint or region our checks let through
        raise ConfigError(
            f"[s3] endpoint_url/region: botocore refuses {redact_url(cfg.endpoint_url)!r} / {cfg.region!r}: {redact(e)}"
        ) from None
    except BotoCoreError as e:
        raise TierUnavailable(
            f"cannot create the S3 client for {redact_url(cfg.endpoint_url) or 'AWS'}: {type(e).__name__}: {redact(e)}"
        ) from None
    _send_large_blocks(client)
    return client


_LOADER_LOCK = threading.Lock()
_LOADER: Any = None


def _session() -> boto3.session.Session:
    """A new boto3 session sharing this process's botocore data loader.

    The loader caches the parsed JSON of the S3 service model and endpoint rules: building a
    client re-reads and parses them otherwise (measured here: 78 ms per client warm, 160 ms
    from a cold page cache; 14 ms with the shared loader). It holds only those AWS data files,
    no credentials or configuration, and its cache fills idempotently (a race loads a file twice).
    """
    global _LOADER
    import botocore.session

    core = botocore.session.get_session()
    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = core.get_component("data_loader")
        else:
            core.register_component("data_loader", _LOADER)
        session = boto3.session.Session(botocore_session=core)
        paths = _LOADER.search_paths  # boto3 appends its data directory for every session: once is enough
        for i in range(len(paths) - 1, -1, -1):
            if paths[i] in paths[:i]:
                del paths[i]
    return session


def _send_large_blocks(client: Any) -> None:
    """Let urllib3 send a file-like request body (our part views, :class:`~.multipart.ViewReader`)
    :data:`_SEND_BLOCK` bytes per ``read``/``sendall`` instead of its default 16 KiB: 64x fewer
    calls per part (measured on a 16 MiB-part promotion to SeaweedFS: 0.8 -> 0.55 client
    CPU-seconds per GiB). botocore has no setting for it; its pool manager passes
    ``connection_pool_kw`` to every connection it makes. A botocore without that attribute
    keeps urllib3's default (logged at debug level)."""
    try:
        client._endpoint.http_session._manager.connection_pool_kw["blocksize"] = _SEND_BLOCK
    except (AttributeError, TypeError) as e:
        log.debug("S3 client: cannot set urllib3's send block size (%s); using its default", type(e).__name__)


class S3Requests(Tier):
    """Naming, error mapping, retries and the shared HEAD/LIST requests of :class:`~.tier.S3Tier`
    (which sets every attribute declared here in its ``__init__``)."""

    cfg: S3Config
    bucket: str
    prefix: str
    url: str
    _root: str
    _client: Any
    _own_client: bool
    _conditional: bool
    _lock: threading.Lock
    _pool: ThreadPoolExecutor | None
    _closed: bool

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

    @property
    def _own_attempts(self) -> int:
        """Tries of this module's own retry loops: :data:`_OWN_ATTEMPTS`, or ``[s3] max_attempts``
        when lower (a configuration that asks for one attempt gets one, not four more of ours)."""
        return max(1, min(_OWN_ATTEMPTS, self.cfg.max_attempts))

    # -- error handling -------------------------------------------------------------------
    def _client_error(self, e: ClientError, what: str, url: str) -> TierckptError:
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
            return TierUnavailable(
                f"{what} {url}: cannot reach the S3 endpoint after retries: {type(e).__name__}: {redact(e)}"
            )
        retried = isinstance(e, (HTTPClientError, IncompleteReadError))
        return TierError(f"{what} {url} failed{' after retries' if retried else ''}: {type(e).__name__}: {redact(e)}")

    def _retrying(self, fn: Callable[[], _T], what: str, url: str, *, own_retry: bool) -> _T:
        """Run ``fn`` (one boto3 call, already retried by botocore).

        ``ClientError`` propagates unchanged for the caller to classify. Connection-level errors
        that outlived botocore's attempts are retried here (:attr:`_own_attempts` tries in all) when
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
                if not own_retry or attempt >= self._own_attempts:
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

    def _head(self, full: str) -> tuple[int, str] | None:
        """(size, ETag) of ``full``, or None if it does not exist."""
        url = self._url_of(full)
        try:
            resp = self._retrying(
                lambda: self._client.head_object(Bucket=self.bucket, Key=full), "head", url, own_retry=False
            )
        except ClientError as e:
            if _is_not_found(e):
                return None
            raise self._client_error(self._why_denied(full, e), "head", url) from e
        return int(resp["ContentLength"]), str(resp.get("ETag", "")).strip('"')

    def _why_denied(self, full: str, e: ClientError) -> ClientError:
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

    def _list_raw(self, full_prefix: str, **extra: Any) -> Iterator[dict[str, Any]]:
        """Pages of ListObjectsV2 under ``full_prefix``."""
        url = self._url_of(full_prefix)
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            yield from paginator.paginate(Bucket=self.bucket, Prefix=full_prefix, **extra)
        except ClientError as e:
            raise self._client_error(e, "list", url) from e
        except BotoCoreError as e:
            raise self._transport_error(e, "list", url) from e
