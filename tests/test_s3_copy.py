"""Promotion into S3 (``S3Tier.copy_from``): the pipelined copy from the local tier.

Each part is read (``O_DIRECT`` from the local tier) into a reused page-aligned buffer while
earlier parts upload; the object is bit-exact on moto and SeaweedFS, carries the CRC32C of every
part, the buffers stay bounded and come back, and a failure on either side (a source read, a
part upload through a faulty connection) leaves nothing visible and no multipart upload behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faultproxy import FaultProxy

from tierckpt.config import MiB
from tierckpt.errors import CheckpointNotFound, TierError
from tierckpt.testing.faults import FaultyTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.s3 import S3Tier, crc32c_b64

KEY = "ck-1/_00/rank-0.data"


def _local_file(root: Path, size: int, seed: int) -> tuple[LocalTier, bytes]:
    """A local tier holding ``KEY`` (written by its sink, as a flush does: nothing cached)."""
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    tier = LocalTier(root, fsync=True)
    sink = tier.open_sink(KEY, size)
    sink.write_at(0, memoryview(data))
    sink.close()
    return tier, data


def _uploads(s3: S3Tier) -> list[Any]:
    return s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])


@pytest.mark.parametrize("server", ["moto", "seaweedfs"])
def test_copy_from_local_is_exact_bounded_and_checksummed(
    server: str, request: pytest.FixtureRequest, s3cfg: Any, tmp_path: Path
) -> None:
    endpoint = request.getfixturevalue("moto_endpoint" if server == "moto" else "seaweed_endpoint")
    size = 4 * 5 * MiB + 4096 * 3 + 17  # 5 parts, the last one short and unaligned
    local, data = _local_file(tmp_path / "local", size, seed=1)
    s3 = S3Tier(s3cfg(endpoint, concurrency=2))
    try:
        taken: list[int] = []
        real_take = s3._buffers.take

        def counting_take(n: int) -> Any:
            buf = real_take(n)
            taken.append(s3._buffers._out)
            return buf

        s3._buffers.take = counting_take  # type: ignore[method-assign]
        assert s3.copy_from(local, KEY) == size
        assert s3.get(KEY) == data
        assert max(taken) <= 3, "more part buffers than concurrency + 1 were in use"
        assert s3._buffers._out == 0 and len(s3._buffers._free) <= 3
        # the second copy reuses the buffers of the first
        free_before = list(s3._buffers._free)
        assert s3.copy_from(local, KEY) == size
        assert all(any(b is f for f in s3._buffers._free) for b in free_before)
        # every part was stored with the CRC32C of its bytes
        full = s3._full(KEY)
        attrs = s3.client.get_object_attributes(
            Bucket=s3.bucket, Key=full, ObjectAttributes=["ObjectParts"], MaxParts=100
        )
        parts = attrs.get("ObjectParts", {}).get("Parts")
        if parts:  # servers that list parts with their checksums
            for p in parts:
                pn = p["PartNumber"]
                chunk = data[(pn - 1) * 5 * MiB : pn * 5 * MiB]
                assert p.get("ChecksumCRC32C") in (None, crc32c_b64(chunk)), pn
        assert not _uploads(s3)
    finally:
        s3.close()


def test_copy_from_small_object_is_one_put(moto_endpoint: str, s3cfg: Any, tmp_path: Path) -> None:
    local, data = _local_file(tmp_path / "local", 3 * MiB + 5, seed=2)
    s3 = S3Tier(s3cfg(moto_endpoint))
    try:
        assert s3.copy_from(local, KEY) == len(data)
        assert s3.get(KEY) == data
        assert s3._buffers._out == 0 and not s3._buffers._free
    finally:
        s3.close()


def test_source_read_failure_aborts_and_leaves_nothing(moto_endpoint: str, s3cfg: Any, tmp_path: Path) -> None:
    local, _data = _local_file(tmp_path / "local", 6 * 5 * MiB, seed=3)
    src = FaultyTier(local)
    src.arm("read_into", OSError(5, "Input/output error"), skip=3)
    s3 = S3Tier(s3cfg(moto_endpoint, concurrency=2))
    try:
        with pytest.raises(OSError, match="Input/output error"):
            s3.copy_from(src, KEY)
        with pytest.raises(CheckpointNotFound):
            s3.size(KEY)
        assert not _uploads(s3)
        assert s3._buffers._out == 0
        # the tier is usable afterwards: the next copy succeeds
        src.disarm()
        assert s3.copy_from(src, KEY) == 6 * 5 * MiB
    finally:
        s3.close()


def test_upload_failure_aborts_and_leaves_nothing(moto_endpoint: str, s3cfg: Any, tmp_path: Path) -> None:
    """The endpoint goes down (503 beyond botocore's and our retries) after two parts were read:
    the copy raises a TierError naming the object and returns its buffers; nothing is visible,
    and once the endpoint is back no multipart upload of it is left (the abort is retried by
    the stale-upload cleanup when the outage swallowed it)."""
    local, _data = _local_file(tmp_path / "local", 6 * 5 * MiB, seed=4)
    src = FaultyTier(local)
    with FaultProxy(moto_endpoint, error_rate=0.0, drop_rate=0.0) as proxy:
        src.arm("read_into", lambda: setattr(proxy, "outage", True), skip=2)
        s3 = S3Tier(s3cfg(moto_endpoint, endpoint_url=proxy.url, concurrency=2, max_attempts=2))
        try:
            with pytest.raises(TierError, match="rank-0.data"):
                s3.copy_from(src, KEY)
            assert s3._buffers._out == 0
            proxy.outage = False
            with pytest.raises(CheckpointNotFound):
                s3.size(KEY)
            s3.abort_stale_uploads("", older_than_s=0)
            assert not _uploads(s3)
        finally:
            s3.close()
