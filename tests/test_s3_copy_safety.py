"""Server-side copies of unchanged frames are proven, never assumed (issue #32, items 1 and 2).

With ``[s3] compression = "zstd"`` and ``copy_unchanged = true`` a promotion copies the frames
that did not change since the previous checkpoint from that checkpoint's S3 object. That object
may have been damaged, truncated or deleted since its commit; the new checkpoint must still be,
on S3, exactly what the local tier committed: each copied frame is read back and checked
against the local data's hash, a copy that fails or does not match is uploaded instead, and a
completed object's size is checked before anything commits it. With ``[local] keep = 1`` the
local copy of a promoted checkpoint is deleted, so a bad copy on S3 is a checkpoint lost.

Real parts: moto's server and SeaweedFS over HTTP (they differ: moto clips a copy range that
runs past the end of its source, SeaweedFS refuses it), the restore CLI's ``verify``, loads
from S3 alone.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_scenarios import compare, placeholder
from s3servers import s3_client

from restore import verify_checkpoint
from tierckpt import TieredReader, TieredWriter
from tierckpt.catalog.listing import committed_in_order, read_checkpoint_doc
from tierckpt.config import MiB, S3Config, config_from_dict
from tierckpt.format.layout import data_key
from tierckpt.tiers.s3 import S3Tier
from tierckpt.tiers.streams import CopySourceError

PREFIX = "ckpt"


@pytest.fixture(params=["moto", "seaweedfs"])
def endpoint(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("moto_endpoint" if request.param == "moto" else "seaweed_endpoint")


def make_cfg(tmp_path: Path, s3: S3Config):
    s = dataclasses.asdict(s3) | {"part_size": "5MiB", "compression": "zstd", "copy_unchanged": True, "keep": 0}
    return config_from_dict(
        {
            "job": {"commit_timeout": 60.0},
            "host": {"buffer_size": "32MiB", "chunk_size": "4MiB"},
            "local": {"path": str(tmp_path / "local"), "keep": 1, "fsync": False},
            "s3": s,
        }
    )


FROZEN = (torch.randn(4 << 20, generator=torch.Generator().manual_seed(7)) * 0.02).to(torch.float32)  # 16 MiB


def state(step: int) -> dict:
    """A frozen 16 MiB tensor (its frames are copied from one checkpoint to the next) and a
    small one that changes every step."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"frozen": FROZEN, "head": torch.randn(5000, generator=g)}, "step": step}


def save(w: TieredWriter, step: int) -> dict:
    sd = state(step)
    dcp.save(sd, checkpoint_id=f"step-{step}", storage_writer=w, no_dist=True)
    w.wait()
    return sd


def object_key(tier: S3Tier, cid: str) -> tuple[str, Any, Any]:
    """(full S3 key, stored index, metadata doc) of ``cid``'s only data file on S3."""
    doc = read_checkpoint_doc(tier, cid)
    ((file, idx),) = doc.manifest.stored.items()
    return f"{PREFIX}/{data_key(cid, file)}", idx, doc


def frozen_frame(doc: Any, idx: Any) -> int:
    """A frame in the middle of the frozen tensor's bytes."""
    ((rec,),) = [[r for i, r in doc.items if i.fqn == "model.frozen"]]
    inside = [k for k in range(idx.frames) if rec.pos <= idx.span(k)[0] and idx.span(k)[1] <= rec.pos + rec.length]
    assert len(inside) >= 3, inside
    return inside[len(inside) // 2]


def check_on_s3(cfg: Any, s3: S3Config, steps: dict[int, dict]) -> None:
    """Each checkpoint is committed on S3, verifies there, and loads bit-exact from S3 alone."""
    tier = S3Tier(s3)
    try:
        on_s3 = {c.checkpoint_id for c in committed_in_order(tier)}
    finally:
        tier.close()
    for step in steps:
        assert f"step-{step}" in on_s3, on_s3
        rep = verify_checkpoint(cfg, f"step-{step}", progress=False)
        assert rep.ok, [str(p) for p in rep.problems]
    shutil.rmtree(tmp := Path(cfg.local.path))
    tmp.mkdir()
    for step, sd in steps.items():
        target = placeholder(sd)
        reader = TieredReader(cfg)
        dcp.load(target, checkpoint_id=f"step-{step}", storage_reader=reader, no_dist=True)
        assert compare(sd, target) == [], f"step-{step}: loaded state differs"
        assert set(reader.served.values()) == {"s3"}


def test_damaged_copy_source_is_not_copied(
    tmp_path: Path, endpoint: str, s3cfg: Callable[..., S3Config], caplog: pytest.LogCaptureFixture
) -> None:
    """Item 1: one flipped byte inside a frame of step-1's S3 object. step-2 and step-3 keep the
    same frozen tensor; on b0e99ab both committed on S3 with the damaged frame (and keep=1 then
    deleted step-2's only good copy). Now the damaged frame is uploaded, the others still copied."""
    s3 = s3cfg(endpoint)
    cfg = make_cfg(tmp_path, s3)
    w = TieredWriter(cfg)
    try:
        save(w, 1)
        tier = S3Tier(s3)
        try:
            full, idx, doc = object_key(tier, "step-1")
            k = frozen_frame(doc, idx)
        finally:
            tier.close()
        client = s3_client(endpoint)
        body = bytearray(client.get_object(Bucket=s3.bucket, Key=full)["Body"].read())
        body[(idx.offsets[k] + idx.offsets[k + 1]) // 2] ^= 0x20
        client.put_object(Bucket=s3.bucket, Key=full, Body=bytes(body))
        assert not verify_checkpoint(cfg, "step-1", progress=False).ok  # S3's copy of step-1 is bad
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            steps = {2: save(w, 2)}
            st2 = w.history[-1]
            steps[3] = save(w, 3)
            st3 = w.history[-1]
    finally:
        w.close()
    assert not (tmp_path / "local" / "step-2").exists()  # keep = 1: S3 holds the only copy
    check_on_s3(cfg, s3, steps)
    assert full in caplog.text and "do not match" in caplog.text  # the warning names the damaged source
    # the undamaged frames were still copied (uploaded_bytes counts both attempts of step-2)
    assert st2.copied_bytes > 0 and st2.uploaded_bytes < st2.stored_bytes
    assert st3.uploaded_bytes < 1 * MiB  # step-3 copies every frozen frame from step-2


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_missing_or_short_copy_source_falls_back_to_upload(
    tmp_path: Path, endpoint: str, s3cfg: Callable[..., S3Config], caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """Item 2: step-1's S3 data object deleted (its metadata left), or cut to half its size. On
    b0e99ab every later promotion failed (missing: the backlog grows for ever) or committed a
    short object (moto clips the copy). Now each frame is uploaded instead, naming the source."""
    s3 = s3cfg(endpoint)
    cfg = make_cfg(tmp_path, s3)
    w = TieredWriter(cfg)
    try:
        save(w, 1)
        tier = S3Tier(s3)
        try:
            full, idx, _doc = object_key(tier, "step-1")
        finally:
            tier.close()
        client = s3_client(endpoint)
        if damage == "missing":
            client.delete_object(Bucket=s3.bucket, Key=full)
        else:
            body = client.get_object(Bucket=s3.bucket, Key=full)["Body"].read()
            client.put_object(Bucket=s3.bucket, Key=full, Body=body[: len(body) // 2])
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            steps = {2: save(w, 2), 3: save(w, 3)}
            st3 = w.history[-1]
    finally:
        w.close()
    check_on_s3(cfg, s3, steps)
    assert full in caplog.text, caplog.text  # the warning names the source object
    assert st3.copied_bytes > 0  # step-3 copies from step-2 again


# -- the S3 stream itself ------------------------------------------------------------------------


def _source(tier: S3Tier, key: str, size: int) -> bytes:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    tier.put(key, data)
    return data


def test_stream_copy_from_a_short_source_is_refused_not_clipped(endpoint: str, s3cfg: Callable[..., S3Config]) -> None:
    """A copy range past the end of its source: moto copies the bytes that exist, SeaweedFS
    refuses. Either way close() raises CopySourceError naming the source and the destination
    holds nothing (on b0e99ab moto's clipped object was completed and reported whole)."""
    tier = S3Tier(s3cfg(endpoint))
    try:
        _source(tier, "src/short", 8 * MiB)
        s = tier.open_stream("dst/obj", 16 * MiB)
        s.append(b"x" * 1000)
        with pytest.raises(CopySourceError) as ei:
            try:
                s.append_copy("src/short", 0, 12 * MiB)  # topped up to 5 MiB by a read, the rest one copied part
                s.close()
            except CopySourceError:
                s.abort()  # the caller's part, as for any failed append (close aborts by itself)
                raise
        assert "src/short" in str(ei.value)
        assert not tier.exists("dst/obj")
        assert not tier.client.list_multipart_uploads(Bucket=tier.bucket).get("Uploads")
    finally:
        tier.close()


def test_stream_copy_from_a_source_cut_short_after_its_head_is_refused(
    endpoint: str, s3cfg: Callable[..., S3Config]
) -> None:
    """The source shrinks between the stream's HEAD of it and a later copy from it: moto clips
    the copied range, so only the size check of the completed object catches it (SeaweedFS
    refuses the range). Either way close() raises CopySourceError naming the source and no
    object is left."""
    tier = S3Tier(s3cfg(endpoint))
    try:
        src = _source(tier, "src/shrinks", 12 * MiB)
        s = tier.open_stream("dst/obj", 12 * MiB)
        with pytest.raises(CopySourceError) as ei:
            s.append_copy("src/shrinks", 0, 6 * MiB)  # HEADs the source: 12 MiB
            tier.put("src/shrinks", src[: 8 * MiB])
            s.append_copy("src/shrinks", 6 * MiB, 12 * MiB)
            s.close()
        assert "src/shrinks" in str(ei.value)
        assert not tier.exists("dst/obj")
    finally:
        tier.close()


def test_stream_copy_from_a_missing_source_names_the_source(endpoint: str, s3cfg: Callable[..., S3Config]) -> None:
    """On b0e99ab the error of a copy from a deleted object named the destination only."""
    tier = S3Tier(s3cfg(endpoint))
    try:
        s = tier.open_stream("dst/obj", 8 * MiB)
        with pytest.raises(CopySourceError) as ei:
            s.append_copy("src/gone", 0, 6 * MiB)
            s.close()
        assert "src/gone" in str(ei.value)
        assert not tier.exists("dst/obj")
    finally:
        tier.close()


def test_stream_copy_is_exact_when_the_source_is_whole(endpoint: str, s3cfg: Callable[..., S3Config]) -> None:
    """The size check after completion passes objects assembled from uploads and copies."""
    tier = S3Tier(s3cfg(endpoint))
    try:
        src = _source(tier, "src/whole", 12 * MiB)
        s = tier.open_stream("dst/obj", 20 * MiB)
        s.append(b"y" * 100)
        s.append_copy("src/whole", MiB, 12 * MiB)
        s.append(b"z" * 10)
        assert s.close() == 110 + 11 * MiB
        assert s.copied > 5 * MiB
        assert tier.get("dst/obj") == b"y" * 100 + src[MiB:] + b"z" * 10
    finally:
        tier.close()
