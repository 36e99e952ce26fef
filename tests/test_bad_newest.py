"""A bad newest checkpoint (issue 22, item 5): ``latest(cfg, before=ID)`` gives the next candidate,
and a bare ``dcp.load(checkpoint_id="latest")`` of a checkpoint damaged on every tier raises
``CorruptCheckpoint`` naming it (inside DCP's ``CheckpointException``; ``tierckpt.errors.find_error``
digs it out). The torchtitan fallback is tested in ``tests/test_torchtitan.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from archive_tier import ArchiveConfig

import tierckpt
from tierckpt import (
    CheckpointNotFound,
    ChecksumMismatch,
    CorruptCheckpoint,
    HostConfig,
    JobConfig,
    LocalConfig,
    TierConfig,
    TieredReader,
    TieredWriter,
)
from tierckpt.chain.engine import close_all
from tierckpt.errors import find_error

MiB = 1 << 20


def cfg(tmp_path: Path, archive: bool = False) -> TierConfig:
    return TierConfig(
        host=HostConfig(buffer_size=8 * MiB, chunk_size=1 * MiB),
        local=LocalConfig(path=str(tmp_path / "local"), keep=0, fsync=False),
        sections={"archive": ArchiveConfig(path=str(tmp_path / "archive"))} if archive else {},
        job=JobConfig(commit_timeout=30),
    )


def state(i: int) -> dict:
    return {"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(i)), "step": i}


def save_all(c: TierConfig, steps: list[int]) -> None:
    w = TieredWriter(c)
    for i in steps:
        dcp.save(state(i), checkpoint_id=f"step-{i}", storage_writer=w, no_dist=True)
    w.wait()
    close_all()


def load(c: TierConfig, cid: str = "latest") -> dict:
    out = {"w": torch.zeros(256, 256), "step": -1}
    dcp.load(out, checkpoint_id=cid, storage_reader=TieredReader(c), no_dist=True)
    return out


def flip(root: Path, cid: str) -> Path:
    """Flip one byte in the middle of ``cid``'s data file under ``root`` (inside the tensor)."""
    (f,) = [p for p in root.rglob(f"{cid}/*.data")]
    b = bytearray(f.read_bytes())
    b[len(b) // 3] ^= 0xFF
    f.write_bytes(bytes(b))
    return f


@pytest.fixture(autouse=True)
def _fresh():
    close_all()
    yield
    close_all()


def test_latest_before_gives_the_next_older_committed_checkpoint(tmp_path):
    c = cfg(tmp_path)
    save_all(c, [1, 2, 3])
    assert tierckpt.latest(c) == "step-3"
    assert tierckpt.latest(c, before="step-3") == "step-2"
    assert tierckpt.latest(c, before="step-2") == "step-1"
    assert tierckpt.latest(c, before="step-1") is None
    assert tierckpt.latest(c, before="/dump/checkpoint/step-3") == "step-2"  # a framework's path-style id
    with pytest.raises(CheckpointNotFound, match="step-9"):
        tierckpt.latest(c, before="step-9")


def test_latest_before_follows_commit_order_not_names(tmp_path):
    c = cfg(tmp_path)
    save_all(c, [5, 2])  # step-2 committed after step-5: it is the newer one
    assert tierckpt.latest(c) == "step-2"
    assert tierckpt.latest(c, before="step-2") == "step-5"


def test_bare_load_of_a_newest_bad_on_its_only_tier_raises_corrupt_naming_it(tmp_path):
    c = cfg(tmp_path)
    save_all(c, [1, 2])
    flip(tmp_path / "local", "step-2")
    assert tierckpt.latest(c) == "step-2"  # latest reads metadata and listings, not every byte
    with pytest.raises(BaseException) as ei:
        load(c)
    bad = find_error(ei.value, CorruptCheckpoint)
    assert isinstance(bad, ChecksumMismatch), ei.value
    assert "checkpoint step-2" in str(bad) and str(tmp_path / "local") in str(bad)
    older = tierckpt.latest(c, before="step-2")
    assert older == "step-1"
    got = load(c, older)
    assert got["step"] == 1 and torch.equal(got["w"], state(1)["w"])


def test_bad_on_every_tier_names_every_tier_and_bad_on_one_is_served_by_the_other(tmp_path):
    c = cfg(tmp_path, archive=True)
    save_all(c, [1, 2])
    flip(tmp_path / "local", "step-2")
    got = load(c)  # the archive's intact copy serves it
    assert got["step"] == 2 and torch.equal(got["w"], state(2)["w"])
    flip(tmp_path / "archive", "step-2")
    with pytest.raises(BaseException) as ei:
        load(c)
    bad = find_error(ei.value, CorruptCheckpoint)
    assert bad is not None and "checkpoint step-2" in str(bad)
    assert str(tmp_path / "local") in str(bad) and str(tmp_path / "archive") in str(bad)
    assert tierckpt.latest(c, before="step-2") == "step-1"


def test_find_error_digs_through_dcp_and_chains():
    inner = ChecksumMismatch("checkpoint step-7: item 'w' failed its CRC32C check on /x")
    try:
        try:
            raise inner
        except ChecksumMismatch as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as outer:
        assert find_error(outer, CorruptCheckpoint) is inner
        assert find_error(outer, (CheckpointNotFound, CorruptCheckpoint)) is inner
        assert find_error(outer, CheckpointNotFound) is None
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise inner
    except ChecksumMismatch as e:
        dcp_exc = CheckpointException("read", {1: _wrap_exception(e)})
    assert find_error(dcp_exc, CorruptCheckpoint) is inner
