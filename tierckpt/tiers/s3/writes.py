"""Writes to the S3 tier: ``PutObject`` (conditional for commits), multipart sinks,
``upload_file`` on the tier's own thread pool, and the cleanup of stale multipart uploads.

``put`` is one ``PutObject`` carrying a CRC32C that the server verifies; ``if_absent=True`` adds
``If-None-Match: *`` (the commit primitive). ``upload_file`` keeps ``cfg.concurrency`` parts in
flight, each read with ``os.pread`` (s3transfer is not used), so it holds at most
``concurrency`` parts in memory.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from typing import Any

from ...config.redact import redact
from ...errors import CommitConflict, CorruptCheckpoint, TierckptError, TierError
from ..base import DataSink, Spare, spared_ids
from .client import (
    BotoCoreError,
    ClientError,
    S3Requests,
    Urllib3HTTPError,
    _err_code,
    _err_message,
    _err_retried,
    _err_status,
    _is_conflict,
    _rejects_conditional,
    log,
)
from .multipart import S3Sink, crc32c_b64, effective_part_size, multipart_etag, pread_exact


class S3Writes(S3Requests):
    """The writing half of :class:`~.tier.S3Tier` (see the module docstring)."""

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
        """A multipart sink for an object of exactly ``size`` bytes (see :class:`~.multipart.S3Sink`)."""
        return S3Sink(self, key, size)

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
        what = f"upload part {pn}/{nparts} of" if nparts else f"upload part {pn} of"

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
        """CompleteMultipartUpload, then a HEAD: an object that is not ``size`` bytes (a server
        that clipped a copied range instead of refusing it) is deleted and
        :class:`CorruptCheckpoint` raised, naming it, so that no metadata ever commits it."""
        url = self._url_of(full)
        self._complete_parts(full, upload_id, parts, size)
        head = self._head(full)
        got = None if head is None else head[0]
        if got != size:
            try:
                self._retrying(
                    lambda: self._client.delete_object(Bucket=self.bucket, Key=full), "delete", url, own_retry=False
                )
            except (ClientError, TierckptError) as e:
                log.warning("cannot delete %s (completed with the wrong size): %s", url, redact(e))
            raise CorruptCheckpoint(
                f"{url}: the completed multipart upload holds {'no object' if got is None else f'{got} bytes'}, "
                f"{size} expected (deleted, not committed)"
            )

    def _complete_parts(self, full: str, upload_id: str, parts: list[dict[str, Any]], size: int) -> None:
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
                if head is not None and head[1] == multipart_etag(p["ETag"] for p in parts) and head[0] == size:
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
            log.warning(
                "cannot abort the multipart upload of %s: %s",
                self._url_of(full),
                redact(_err_code(e)) or _err_message(e),
            )
        except Exception as e:  # noqa: BLE001 - abort must never raise
            log.warning(
                "cannot abort the multipart upload of %s: %s: %s", self._url_of(full), type(e).__name__, redact(e)
            )
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
                data = pread_exact(fd, size, 0, path, url)
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
            data = pread_exact(fd, n, off, path, url)
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

    def _last_part_time(self, key: str, upload_id: str) -> float | None:
        """Epoch time of the most recently uploaded part of an upload (None: no parts, or the
        upload vanished)."""
        latest: float | None = None
        try:
            for page in self._client.get_paginator("list_parts").paginate(
                Bucket=self.bucket, Key=key, UploadId=upload_id
            ):
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

    def abort_stale(self, older_than_s: float, spare: Spare = ()) -> int:
        return self.abort_stale_uploads("", older_than_s=older_than_s, spare=spare)

    def abort_stale_uploads(self, prefix: str = "", older_than_s: float = 0, spare: Spare = ()) -> int:
        """Abort multipart uploads under ``prefix`` idle for at least ``older_than_s`` seconds;
        return how many were aborted.

        An upload is idle since its most recent event, by the server's clock: its initiation
        or, when that is old enough, its most recently uploaded part (one ListParts per such
        candidate), so that a long promotion still sending parts is never aborted. With
        ``older_than_s=0`` every upload under the prefix is aborted without ListParts. (moto
        reports a fixed 2010 initiation time, so there only part times protect an upload.)
        Uploads whose key has a checkpoint id of ``spare`` (leased) as a directory (``ID/...``, and
        data files' ``_XX/ID/...``, as :meth:`LocalTier.abort_stale` prunes them) are left alone; a callable ``spare`` is called after the listing (see :data:`Spare`).
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
        spared = set(spared_ids(spare))
        for page in pages:
            for up in page.get("Uploads", ()) or ():
                if spared and not spared.isdisjoint(up["Key"][len(self._root) :].split("/")[:-1]):
                    continue  # a directory of the key is a spared id (ID/... or _XX/ID/...)
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
