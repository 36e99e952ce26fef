"""The local tier's resumable sink (what ``fetch`` writes through): direct I/O where the file
system allows it, progress recorded in batches, everything landed recorded at an interruption."""

from __future__ import annotations

import json
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tierckpt.tiers import localsinks
from tierckpt.tiers.local import LocalTier

MiB = 1 << 20
TAG = {"format": "test", "checkpoint_id": "c1"}


def aligned(data: bytes) -> memoryview:
    """``data`` in a page-aligned buffer (what fetch hands the sink)."""
    m = mmap.mmap(-1, len(data))
    m[:] = data
    return memoryview(m)


def sidecar(root: Path) -> list[int]:
    return json.loads((root / "c1" / "f.data.ranges.partial").read_text())["done"]


def roots() -> list[str]:
    out = ["disk"]
    if os.path.isdir("/dev/shm"):
        out.append("tmpfs")
    return out


@pytest.mark.parametrize("where", roots())
def test_batched_records_suspend_and_resume(where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks are recorded every RECORD_EVERY bytes; a suspend records every landed block; the
    next writer resumes with them and the file comes out whole. On tmpfs (O_DIRECT refused on older
    kernels: buffered writes) the same."""
    base = Path(tempfile.mkdtemp(dir="/dev/shm")) if where == "tmpfs" else tmp_path
    try:
        monkeypatch.setattr(localsinks, "RECORD_EVERY", 2 * MiB)
        tier = LocalTier(base, fsync=True)
        size = 4 * MiB + 1000  # the last block is short and unaligned
        data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8).tobytes()
        blk = lambda i: aligned(data[i * MiB : min(size, (i + 1) * MiB)])  # noqa: E731

        sink = tier.open_resumable("c1/f.data", size, block=MiB, tag=TAG)
        if where == "disk":
            assert sink.direct  # ext4: O_DIRECT (tmpfs accepts it on recent kernels, refuses it on older ones)
        sink.write_block(0, blk(0))
        assert sidecar(base) == []  # 1 MiB landed: not yet recorded
        sink.write_block(1, blk(1))
        assert sidecar(base) == [0, 1]  # 2 MiB: one batch, durable
        sink.write_block(4, blk(4))
        assert sidecar(base) == [0, 1]
        sink.suspend()  # an interruption records everything that landed
        assert sidecar(base) == [0, 1, 4]

        sink = tier.open_resumable("c1/f.data", size, block=MiB, tag=TAG)
        assert sink.recorded == {0, 1, 4}
        for i in (2, 3):
            sink.write_block(i, blk(i))
        sink.close()
        assert (base / "c1" / "f.data").read_bytes() == data
        assert not list((base / "c1").glob("*.partial"))
    finally:
        if where == "tmpfs":
            import shutil

            shutil.rmtree(base, ignore_errors=True)
