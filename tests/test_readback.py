"""The one verified multi-tier read engine (:mod:`tierckpt.readback`) on real tiers.

A checkpoint is saved once on a local tier; a second copy lives on another local directory or on
moto's S3. The engine must read each file from the fastest tier holding it, fall back per item
to the next tier on a flipped byte or an absent file, and name file, item and tiers when no tier
serves an item.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt import TierConfig, TieredWriter
from tierckpt.catalog.listing import read_checkpoint_metadata
from tierckpt.config import HostConfig, LocalConfig, MiB
from tierckpt.errors import CheckpointNotFound, ChecksumMismatch
from tierckpt.format.layout import data_key, metadata_key
from tierckpt.format.metadata import iter_items
from tierckpt.load.readback import Readback, Request, hold, range_size, read_checked
from tierckpt.tiers.base import Tier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.s3 import S3Tier

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

CID = "step-3"


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(700_000, generator=g),
        "small": torch.arange(37, dtype=torch.int64),
        "w": torch.randn(64, 33, generator=g),
        "obj": {"name": "x", "n": 3},
    }


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, Path]:
    """The checkpoint on local root ``a`` and an identical copy on root ``b``."""
    cfg = TierConfig(
        host=HostConfig(buffer_size=2 * MiB, chunk_size=256 * 1024),
        local=LocalConfig(path=str(tmp_path / "a"), keep=0, fsync=False),
    )
    w = TieredWriter(cfg)
    dcp.save(_state(), checkpoint_id=CID, storage_writer=w, no_dist=True)
    w.wait()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    return tmp_path / "a", tmp_path / "b"


def _tier(root: Path, name: str) -> LocalTier:
    t = LocalTier(root, fsync=False)
    t.name = name  # only to tell the two copies apart in `served` and messages
    return t


def _requests(tier: Tier) -> tuple[list[Request], dict[str, bytes], int]:
    """One request per stored item, and the bytes each should get (read raw from ``tier``)."""
    md, man = read_checkpoint_metadata(tier, CID)
    reqs, want = [], {}
    for idx, rec in iter_items(md):
        what = f"item {idx.fqn!r}"
        want[what] = tier.get(data_key(CID, rec.file), rec.pos, rec.pos + rec.length)
        reqs.append(Request(rec, memoryview(bytearray(rec.length)), what))
    return reqs, want, man.chunk_size


def _flip(tier: Tier, rec, at: int) -> None:
    key = data_key(CID, rec.file)
    raw = bytearray(tier.get(key))
    raw[rec.pos + at] ^= 0x40
    tier.put(key, bytes(raw))


def _big(reqs: list[Request]) -> Request:
    return max(reqs, key=lambda r: r.rec.length)


def test_reads_everything_from_the_fastest_tier(saved):
    a, b = _tier(saved[0], "fast"), _tier(saved[1], "slow")
    reqs, want, chunk = _requests(b)
    rb = Readback(CID, [a, b], chunk)
    rb.read(reqs)
    assert {r.what: bytes(r.buf) for r in reqs} == want
    assert set(rb.served.values()) == {"fast"}


def test_flipped_byte_in_the_fastest_tier_falls_back(saved, caplog):
    a, b = _tier(saved[0], "fast"), _tier(saved[1], "slow")
    reqs, want, chunk = _requests(b)
    big = _big(reqs)
    _flip(a, big.rec, big.rec.length // 2)
    caplog.set_level(logging.WARNING, logger="tierckpt")
    Readback(CID, [a, b], chunk).read(reqs)
    assert {r.what: bytes(r.buf) for r in reqs} == want
    [msg] = [r.getMessage() for r in caplog.records if "served from" in r.getMessage()]
    assert big.what in msg and "CRC32C" in msg and "on fast; served from slow" in msg and CID in msg, msg


def test_absent_file_in_the_fastest_tier_falls_back(saved):
    a, b = _tier(saved[0], "fast"), _tier(saved[1], "slow")
    reqs, want, chunk = _requests(b)
    file = reqs[0].rec.file
    a.delete(data_key(CID, file))
    rb = Readback(CID, [a, b], chunk)
    assert rb.tiers_for(file) == [b]
    rb.read(reqs)
    assert {r.what: bytes(r.buf) for r in reqs} == want
    assert rb.served[file] == "slow"


def test_every_tier_bad_raises_checksum_mismatch_naming_file_item_and_tiers(saved):
    a, b = _tier(saved[0], "fast"), _tier(saved[1], "slow")
    reqs, _want, chunk = _requests(b)
    big = _big(reqs)
    _flip(a, big.rec, 5)
    _flip(b, big.rec, big.rec.length - 1)
    with pytest.raises(ChecksumMismatch) as ei:
        Readback(CID, [a, b], chunk).read(reqs)
    msg = str(ei.value)
    assert CID in msg and big.rec.file in msg and big.what in msg and "rank 0" in msg, msg
    assert a.url in msg and b.url in msg, msg


def test_file_absent_everywhere_raises_checkpoint_not_found(saved):
    a, b = _tier(saved[0], "fast"), _tier(saved[1], "slow")
    reqs, _want, chunk = _requests(b)
    file = reqs[0].rec.file
    for t in (a, b):
        t.delete(data_key(CID, file))
    with pytest.raises(CheckpointNotFound) as ei:
        Readback(CID, [a, b], chunk).read(reqs)
    msg = str(ei.value)
    assert file in msg and a.url in msg and b.url in msg and CID in msg, msg


def test_truncated_file_serves_the_items_before_the_cut(saved):
    """One tier only, its file cut short: the run fails, items before the cut are read alone from
    the same tier, the item past the cut is named in the error."""
    a = _tier(saved[0], "fast")
    reqs, want, chunk = _requests(a)
    file = reqs[0].rec.file
    last = max((r for r in reqs if r.rec.file == file), key=lambda r: r.rec.pos)
    key = data_key(CID, file)
    a.put(key, a.get(key, 0, last.rec.pos + 1))
    with pytest.raises(Exception) as ei:
        Readback(CID, [a], chunk, threads=1).read(reqs)
    assert last.what in str(ei.value) and file in str(ei.value)
    for r in reqs:
        if r.rec.pos + r.rec.length <= last.rec.pos and r.rec.file == file:
            assert bytes(r.buf) == want[r.what], r.what


@pytest.fixture
def with_s3(saved, moto_endpoint, s3cfg):
    """The local copy ``a`` and the same objects on moto's S3."""
    a = _tier(saved[0], "local")
    s3 = S3Tier(s3cfg(moto_endpoint))
    for info in list(a.list("")):
        if info.key.startswith("_leases"):
            continue
        s3.put(info.key, a.get(info.key))
    yield a, s3
    s3.close()


def test_s3_serves_what_the_local_tier_lost_or_spoiled(with_s3):
    a, s3 = with_s3
    reqs, want, chunk = _requests(s3)
    holding, held = hold([a, s3], CID, "test")
    try:
        assert holding == [a, s3]
        big = _big(reqs)
        _flip(a, big.rec, 7)
        rb = Readback(CID, holding, chunk)
        rb.read(reqs)
        assert {r.what: bytes(r.buf) for r in reqs} == want
        # spoiled on S3 as well: the error names both tiers
        _flip(s3, big.rec, 9)
        with pytest.raises(ChecksumMismatch) as ei:
            Readback(CID, holding, chunk).read([Request(big.rec, memoryview(bytearray(big.rec.length)), big.what)])
        assert a.url in str(ei.value) and s3.url in str(ei.value) and big.rec.file in str(ei.value)
    finally:
        for lease in held:
            lease.release()


def test_hold_and_read_checked(with_s3):
    a, s3 = with_s3
    a.delete(metadata_key(CID))
    holding, held = hold([a, s3], CID, "test")
    assert holding == [s3]
    for lease in held:
        lease.release()
    s3.delete(metadata_key(CID))
    with pytest.raises(CheckpointNotFound, match=CID):
        hold([a, s3], CID, "test")
    # read_checked: a persistently bad range is read TRIES times, then reported
    from restore.pieces import FileCheck, files_items

    b = LocalTier(Path(a.url).parent / "b", fsync=False)  # the untouched copy, for the metadata
    reqs, _want, _chunk = _requests(b)
    big = _big(reqs)
    _flip(s3, big.rec, 3)
    md, man = read_checkpoint_metadata(b, CID)
    fc = FileCheck(big.rec.file, man.files[big.rec.file], files_items(md)[big.rec.file], man.chunk_size)
    rsize = range_size(s3, man.chunk_size)
    start = (big.rec.pos // rsize) * rsize
    end = min(fc.size, start + rsize)
    bad, reads = read_checked(s3, data_key(CID, big.rec.file), start, memoryview(bytearray(end - start)), fc.check)
    assert bad and reads == 3 and big.rec.file == bad[0].file
