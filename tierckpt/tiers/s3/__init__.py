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
* :meth:`S3Tier.copy_from` (promotion after a local commit, :mod:`.copy`) is a pipeline: the
  calling thread reads part ``N+1`` of the source into a reused page-aligned buffer (``O_DIRECT``
  from the local tier: no page cache, no copy) while up to ``cfg.concurrency`` parts upload on
  the tier's thread pool, each with its CRC32C computed on the buffer.
* :meth:`S3Tier.upload_file` uploads a local file with ``cfg.concurrency`` parts in flight on a
  thread pool owned by the tier, reading each part with ``os.pread`` (s3transfer is not used).

Data plane: boto3/botocore for every request (credentials from its chain, its retry modes, any
``endpoint_url``, path-style addressing). Part bodies go out zero-copy (memoryview slices, 1 MiB
per ``sendall``), unsigned (``payload_signing_enabled = False``: the CRC32C header each body
carries is what the server verifies; botocore would SHA-256 every body on http endpoints).
awscrt's S3 client was measured against it (``tools/bench.py --only s3``) and is not used for
requests (it spent more CPU per GiB uploaded than this tier and was not faster on these servers).
CRC32C of parts: :func:`tierckpt.checksum.crc32c` on the part buffer (no copy, GIL released).

Part size: S3 allows at most 10,000 parts, so for an object larger than ``10000 * part_size`` the
effective part size is grown to the smallest multiple of 1 MiB that fits (see
:func:`effective_part_size`). Memory: a sink buffers at most one ``part_size`` per part that has
been partly written; ``upload_file`` holds at most ``concurrency`` parts; ``copy_from`` at most
``concurrency + 1`` part buffers per tier, kept for reuse until :meth:`S3Tier.close`.

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

from .client import make_client
from .multipart import MAX_PARTS, crc32c_b64, effective_part_size
from .tier import S3Tier

__all__ = ["S3Tier", "effective_part_size", "crc32c_b64", "MAX_PARTS", "make_client"]
