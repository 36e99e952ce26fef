"""``[s3]``: the S3-compatible object-store tier's section (re-exported by :mod:`.sections`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError
from .redact import redact_url
from .values import (
    _ARN_RE,
    _BUCKET_RE,
    _REGION_RE,
    MAX_TIMEOUT_S,
    S3_MAX_ATTEMPTS,
    S3_MAX_PART,
    S3_MIN_PART,
    MiB,
    check_compression,
    check_endpoint_url,
)

__all__ = ["S3Config"]


@dataclass
class S3Config:
    """``[s3]``: the S3-compatible object-store tier.

    Credentials are never part of the config: boto3's standard chain supplies them.

    Attributes:
        bucket: bucket name (required).
        prefix: key prefix under which checkpoints live.
        endpoint_url: e.g. ``http://127.0.0.1:8333`` for SeaweedFS/MinIO; empty for AWS. Checked
            by :func:`check_endpoint_url`: ``http(s)://host[:port][/path]``, no ``user:password@``
            (refused without being echoed), no query string.
        region: signing region (letters, digits and ``-``).
        part_size: multipart part size (5MiB..5GiB).
        concurrency: concurrent part uploads / ranged GETs per process.
        keep: committed checkpoints kept on this tier (0 keeps all).
        keep_every: additionally keep forever every checkpoint whose step is a multiple of this (0: off).
        max_attempts: botocore retry attempts for transient errors (also caps tierckpt's own
            retries of uploads and resumed downloads, at most 4 tries).
        connect_timeout, read_timeout: seconds.
        conditional_commit: write the commit object with ``If-None-Match: *``; servers that
            reject the header fall back to check-then-put automatically.
        compression: ``"zstd"``: the hop into this tier stores each data file in frames coded by
            byte planes + zstd (:mod:`tierckpt.codec`, ``docs/compression.md``); ``"none"``
            (default): as written.
        compression_level: the zstd level (-7..22; 1 by default: higher levels gain little on
            model state and cost much CPU). At levels <= 1 the byte planes of multi-byte items
            are coded literal-only (Huffman, no match search; faster than level 1 at the same
            ratio; ``tierckpt.codec.frames``), other bytes at the level.
        copy_unchanged: frames byte-identical (128-bit hash) to the same rank's file in the
            previous checkpoint on this tier are copied by the server (``UploadPartCopy``), not
            uploaded again. Either this or ``compression`` switches the hop to the encoded copy.
    """

    bucket: str = ""
    prefix: str = ""
    endpoint_url: str = ""
    region: str = "us-east-1"
    part_size: int = 64 * MiB
    concurrency: int = 8
    keep: int = 5
    keep_every: int = 0
    max_attempts: int = 8
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    conditional_commit: bool = True
    compression: str = "none"
    compression_level: int = 1
    copy_unchanged: bool = False

    def __repr__(self) -> str:
        """The dataclass repr with ``endpoint_url`` redacted (it may not have been validated yet)."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            parts.append(f"{f.name}={redact_url(value)!r}" if f.name == "endpoint_url" else f"{f.name}={value!r}")
        return f"S3Config({', '.join(parts)})"

    def validate(self, where: str = "[s3]") -> None:
        if not isinstance(self.bucket, str) or not self.bucket:
            raise ConfigError(f"{where} bucket: required, the bucket name")
        if not (_BUCKET_RE.match(self.bucket) or _ARN_RE.match(self.bucket)):
            raise ConfigError(
                f"{where} bucket: {self.bucket[:80]!r} is not a bucket name "
                "(letters, digits, '.', '-' and '_', at most 255 characters; or an access point ARN)"
            )
        check_endpoint_url(self.endpoint_url, f"{where} endpoint_url")
        if self.region and not _REGION_RE.match(self.region):
            raise ConfigError(f"{where} region: {self.region[:80]!r} is not a region name (e.g. 'us-east-1')")
        if not (S3_MIN_PART <= self.part_size <= S3_MAX_PART):
            raise ConfigError(f"{where} part_size: must be between 5MiB and 5GiB (S3 limits), got {self.part_size}")
        if self.concurrency < 1 or self.concurrency > 256:
            raise ConfigError(f"{where} concurrency: must be between 1 and 256, got {self.concurrency}")
        if self.keep < 0:
            raise ConfigError(f"{where} keep: must not be negative, got {self.keep}")
        if self.keep_every < 0:
            raise ConfigError(f"{where} keep_every: must not be negative, got {self.keep_every}")
        if not 1 <= self.max_attempts <= S3_MAX_ATTEMPTS:
            raise ConfigError(f"{where} max_attempts: must be between 1 and {S3_MAX_ATTEMPTS}, got {self.max_attempts}")
        for name in ("connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if not 0 < value <= MAX_TIMEOUT_S:
                raise ConfigError(
                    f"{where} {name}: must be positive and at most {MAX_TIMEOUT_S:.0f} seconds, got {value}"
                )
        if self.prefix.startswith("/") or ".." in self.prefix.split("/"):
            raise ConfigError(f"{where} prefix: must be relative and must not contain '..', got {self.prefix!r}")
        check_compression(self.compression, self.compression_level, where)
