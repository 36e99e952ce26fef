"""The :class:`S3Tier` class: construction, listing, deletes and close, over its reading and
writing halves (:mod:`.reads`, :mod:`.writes`) and the request layer (:mod:`.client`)."""

from __future__ import annotations

import builtins
import dataclasses
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...config import S3Config
from ...config.redact import redact, redact_url
from ...errors import (
    ConfigError,
    CorruptCheckpoint,
    TierAccessDenied,
    TierckptError,
    TierError,
    TierUnavailable,
    TierUnreachable,
)
from ..base import Encoding, ObjectInfo, Tier, check_key
from ..streams import StreamSink
from .client import (
    _DELETE_BATCH,
    _DENIED,
    BotoConnectionError,
    BotoCoreError,
    ClientError,
    HTTPClientError,
    _err_code,
    _err_status,
    _is_not_found,
    log,
    make_client,
)
from .copy import PartBuffers, copy_into
from .reads import S3Reads
from .writes import S3Writes

PROBE_TIMEOUT_S = 5.0
"""Cap on each of the connect and read timeouts of :meth:`S3Tier.probe` (one small listing)."""


class S3Tier(S3Reads, S3Writes):
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
        self._buffers = PartBuffers(cfg.part_size, cfg.concurrency + 1)
        self.may_encode = True
        self._part_copy = True  # UploadPartCopy works here (False once the server refused it)
        if cfg.compression != "none" or cfg.copy_unchanged:
            self.encoding = Encoding(cfg.compression, cfg.compression_level, cfg.copy_unchanged)

    def open_stream(self, key: str, size_hint: int = 0) -> StreamSink:
        """A multipart upload written front to back, ``UploadPartCopy`` for ranges of this tier's
        objects (:class:`~.stream.S3Stream`); ``size_hint``: about how large it will be."""
        from .stream import S3Stream

        return S3Stream(self, check_key(key), size_hint)

    def copy_from(self, src: Tier, key: str) -> int:
        """Copy object ``key`` of ``src`` here (promotion after a local commit); return its size.

        A pipeline (:mod:`.copy`): the calling thread reads part ``N+1`` of ``src`` into a reused
        page-aligned buffer (``O_DIRECT`` from the local tier) while up to ``cfg.concurrency``
        parts upload on the tier's pool, each with its CRC32C; at most ``cfg.concurrency + 1``
        part buffers per tier. Blocks until the object is complete; on failure the multipart
        upload is aborted and nothing is visible under ``key``.
        """
        return copy_into(self, self._buffers, src, key)

    def probe(self) -> None:
        """See :meth:`Tier.probe`: one ListObjectsV2 for at most one key under the prefix. Its
        answer proves that the endpoint answers, the bucket exists and the credentials are accepted
        and may list there (what every save needs: the commit order and the backlog are listed).
        Read-only: a key that may read but not write passes (its first write is refused in the
        background, with a :class:`TierAccessDenied` naming the key).

        One attempt, bounded by ``[s3] connect_timeout`` + ``read_timeout``, each at most
        :data:`PROBE_TIMEOUT_S` (a hung endpoint delays the writer's creation by 10 s at most, then
        is a WARNING; the defaults, 10 + 60 s, suit transfers, not a check): a client of its own
        with botocore's retries off (built in about 15 ms; closed after), unless the tier was given
        a client. Refused credentials and no credentials at all raise :class:`TierAccessDenied`, a
        missing bucket (or any other answer but a server error) a :class:`TierError`; a connection
        refused or timed out, a 5xx or a throttling answer raises :class:`TierUnreachable`. The
        messages go through the tier's error mapping: they name the bucket, never a credential.
        """
        url = self._url_of(self._root)
        quick = dataclasses.replace(
            self.cfg,
            max_attempts=1,
            connect_timeout=min(self.cfg.connect_timeout, PROBE_TIMEOUT_S),
            read_timeout=min(self.cfg.read_timeout, PROBE_TIMEOUT_S),
        )
        client = make_client(quick) if self._own_client else self._client
        try:
            client.list_objects_v2(Bucket=self.bucket, Prefix=self._root, MaxKeys=1)
        except ClientError as e:
            status = _err_status(e)
            if _err_code(e) == "NoSuchBucket" or status == 404:
                where = redact_url(self.cfg.endpoint_url) or "AWS"
                raise TierUnavailable(
                    f"[{self.name}] {self.url}: bucket {self.bucket!r} does not exist at {where} "
                    "(check [s3] bucket and endpoint_url)"
                ) from e
            transient = status >= 500 or status == 429 or _err_code(e) in ("SlowDown", "RequestTimeout", "Throttling")
            raise self._probe_error(self._client_error(e, "list", url), transient) from e
        except (BotoConnectionError, HTTPClientError) as e:
            raise self._probe_error(self._transport_error(e, "list", url), True) from e
        except BotoCoreError as e:
            raise self._probe_error(self._transport_error(e, "list", url), False) from e
        finally:
            if client is not self._client:
                client.close()

    def _probe_error(self, err: TierckptError, transient: bool) -> TierckptError:
        """``err`` (mapped from a failed probe) as the error :meth:`probe` raises."""
        msg = f"[{self.name}] {self.url} cannot be used now: {err}" if transient else f"[{self.name}] {err}"
        if transient:
            return TierUnreachable(msg)
        try:
            return type(err)(msg)
        except TypeError:  # pragma: no cover - every tierckpt error takes a message
            return err

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

    def list_dirs(self) -> builtins.list[str]:
        """The first path components of all keys, sorted (ListObjectsV2 with ``Delimiter="/"``).

        A common prefix with no object under it (SeaweedFS keeps empty directories) is left out.
        """
        return [name for name, prefix in self._tops() if self._has_objects(prefix)]

    def list_tops(self) -> builtins.list[str]:
        """The first path components of all keys, sorted: one delimited ListObjectsV2 per 1,000
        names, whatever the number of objects (a name may have nothing under it any more)."""
        return [name for name, _prefix in self._tops()]

    def _tops(self) -> builtins.list[tuple[str, str]]:
        found: dict[str, str] = {}
        n = len(self._root)
        for page in self._list_raw(self._root, Delimiter="/"):
            for cp in page.get("CommonPrefixes", ()):
                p = cp["Prefix"]
                name = p[n:].rstrip("/")
                try:
                    check_key(name)
                except CorruptCheckpoint:
                    continue
                if "/" not in name:
                    found[name] = p
        return sorted(found.items())

    # -- deletes --------------------------------------------------------------------------
    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key is not an error."""
        full = self._full(key)
        url = self._url_of(full)
        try:
            self._retrying(
                lambda: self._client.delete_object(Bucket=self.bucket, Key=full), "delete", url, own_retry=False
            )
        except ClientError as e:
            if not _is_not_found(e):
                raise self._client_error(e, "delete", url) from e

    def _delete_keys(self, keys: builtins.list[str], *, best_effort: bool = False) -> None:
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

    def delete_many(self, keys: builtins.list[str]) -> int:
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

    def close(self) -> None:
        """Shut the upload pool down and close the client (if the tier built it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._buffers.close()
        if self._own_client:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - best effort
                pass
