"""The S3 destination of :func:`restore.export.export_hf`: ``out = "s3://bucket/prefix"``.

The folder is written under a hidden local staging directory (``$TMPDIR/.tierckpt-s3export.partial-PID``,
removed at the end; one left by a killed export is removed by the next one once its process is
gone) and uploaded through tierckpt's S3 tier (:class:`tierckpt.tiers.s3.S3Tier`: multipart with
a CRC32C per part, retries, an upload that fails is aborted and leaves nothing visible), with the
``[s3]`` section's endpoint, region, part size, concurrency, timeouts and retries, on the bucket
and prefix of the URL. Credentials are never part of the configuration: boto3's standard chain
(environment, shared files, instance role) supplies them, as for the tier; nothing logs them.
Without an ``[s3]`` section, the defaults apply (AWS; ``AWS_ENDPOINT_URL`` in the environment is
honoured by boto3 itself).

Crash safety, the S3 way. What makes a prefix loadable by ``from_pretrained`` is its *marker*:
``model.safetensors.index.json`` for a sharded export, ``model.safetensors`` for a single-shard
one. An export (1) deletes both markers under the prefix first (an older export there stops
looking complete before any of its files is replaced; multipart uploads a killed export left there
are aborted), (2) uploads each shard as soon as it is
complete on the staging disk (the local copy is removed once uploaded, so the staging disk holds
about one shard at a time), then the extra files, (3) uploads the marker last (one PutObject or
one CompleteMultipartUpload: atomic), and (4) deletes the objects under the prefix that are not
part of this export (shards of an older, differently split export). A killed export therefore
leaves shards without a marker, which ``from_pretrained`` refuses; the next export to the prefix
replaces them. Objects are read by nobody meanwhile except a reader racing step (1) of a
rerun, which sees a folder without a marker.

The prefix must not lie inside the ``[s3]`` tier's own prefix in the same bucket (its retention
and ``gc`` own everything there); :func:`check_destination` refuses that.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tierckpt.config import S3Config, TierConfig
from tierckpt.config.export import ExportConfig
from tierckpt.errors import ConfigError

from .errors import UsageError

__all__ = ["S3Destination", "check_destination", "is_s3_url", "parse_s3_url"]

log = logging.getLogger("tierckpt.restore")


def is_s3_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an ``s3://`` URL (rather than a local directory)."""
    return str(path).startswith("s3://")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``. Raises :class:`UsageError`
    naming the URL when the bucket or the prefix is missing (an export needs a prefix of its own)."""
    rest = url[len("s3://") :] if url.startswith("s3://") else ""
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket or not prefix:
        raise UsageError(f"export path {url!r}: use s3://BUCKET/PREFIX (a prefix of its own for the folder)")
    return bucket, prefix


def check_destination(cfg: TierConfig, url: str) -> None:
    """Refuse an export prefix inside the ``[s3]`` tier's own prefix in the same bucket (the
    tier's retention and ``gc`` own every key there; :meth:`ExportConfig.check_s3`). Raises
    :class:`UsageError` naming both."""
    parse_s3_url(url)
    if cfg.s3 is not None:
        try:
            ExportConfig(path=url).check_s3(cfg.s3.bucket, cfg.s3.prefix, where="export")
        except ConfigError as e:
            raise UsageError(str(e)) from None


class S3Destination:
    """One export's upload into ``s3://bucket/prefix`` (see the module docstring for the order).

    Use: :meth:`has_objects` (refuse a non-empty prefix), :meth:`begin` (delete the markers),
    :meth:`send` for each finished shard (uploaded in the background, one at a time, the local
    file removed after), :meth:`finish` with the remaining files and the marker, :meth:`close`.
    The first upload error is raised by the next :meth:`send` or by :meth:`finish`.
    """

    def __init__(self, cfg: TierConfig, url: str) -> None:
        from tierckpt.tiers.s3 import S3Tier

        check_destination(cfg, url)
        bucket, prefix = parse_s3_url(url)
        base = cfg.s3 if cfg.s3 is not None else S3Config(bucket=bucket)
        # the tier's transport settings; never its codec (an export is plain safetensors files)
        s3 = dataclasses.replace(base, bucket=bucket, prefix=prefix, compression="none", copy_unchanged=False)
        self.url = f"s3://{bucket}/{prefix}"
        self.tier = S3Tier(s3)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierckpt-export-upload")
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()
        self.sent: list[str] = []  # keys uploaded, in order
        self.bytes = 0

    def has_objects(self) -> bool:
        """Whether anything is stored under the prefix."""
        return next(iter(self.tier.list("")), None) is not None

    def is_export(self, markers: tuple[str, ...]) -> bool:
        """Whether one of ``markers`` is there (a finished export)."""
        return any(self.tier.exists(m) for m in markers)

    def begin(self, markers: tuple[str, ...]) -> None:
        """Delete the markers under the prefix, so that an older export there no longer looks
        complete, and abort the multipart uploads a killed export left under it (one export
        writes a prefix at a time: ``{checkpoint_id}``/``{node}`` in the path keep them apart)."""
        self.tier.delete_many(list(markers))
        aborted = self.tier.abort_stale_uploads("", older_than_s=0)
        if aborted:
            log.info("%s: aborted %d multipart upload(s) left by an export that did not finish", self.url, aborted)

    def _upload(self, path: Path, name: str) -> None:
        size = path.stat().st_size
        self.tier.upload_file(name, str(path))
        path.unlink()
        with self._lock:
            self.sent.append(name)
            self.bytes += size

    def _raise(self) -> None:
        with self._lock:
            failed = [f for f in self._futures if f.done() and f.exception() is not None]
        if failed:
            raise failed[0].exception()  # type: ignore[misc]

    def send(self, path: Path) -> None:
        """Upload the finished file ``path`` (key: its name) in the background; its local copy is
        removed once uploaded."""
        self._raise()
        fut = self._pool.submit(self._upload, path, path.name)
        with self._lock:
            self._futures.append(fut)

    def finish(self, rest: list[Path], marker: Path) -> None:
        """Wait for the shards sent, upload ``rest`` and then ``marker`` (last), and delete every
        other object under the prefix (an older export's files)."""
        for fut in self._futures:
            fut.result()
        for p in rest:
            self._upload(p, p.name)
        self._upload(marker, marker.name)
        keep = set(self.sent)
        stale = [o.key for o in self.tier.list("") if o.key not in keep]
        if stale:
            log.info("%s: removing %d object(s) of an older export", self.url, len(stale))
            self.tier.delete_many(stale)

    def close(self) -> None:
        """Stop uploading (what is queued is cancelled, a running upload is waited for) and close the tier."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.tier.close()


def staging_parent() -> Path:
    """Where an S3 export stages its files: the system's temporary directory."""
    return Path(tempfile.gettempdir())
