"""``[local] fill_on_load``: a load that reads data files from S3 because the local tier lacks them
(a lost or replaced node) leaves a committed local copy behind (:mod:`tierckpt.fill`).

Real S3 over HTTP (moto's server on loopback). Every comparison is bit-exact; nothing is timed.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3servers import s3_client
from test_s3_promotion import local_files, make_cfg, md_doc, s3_get, state

from tierckpt import TieredReader, TieredWriter
from tierckpt.format.layout import data_key, metadata_key
from tierckpt.testing import compare, placeholder

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def save(cfg, sd: dict, cid: str) -> None:
    w = TieredWriter(cfg)
    try:
        dcp.save(sd, checkpoint_id=cid, storage_writer=w)
        w.wait()
    finally:
        w.close()


def load(cfg, expected: dict, cid: str = "latest") -> TieredReader:
    got = placeholder(expected)
    reader = TieredReader(cfg)
    dcp.load(got, checkpoint_id=cid, storage_reader=reader)
    assert compare(expected, got) == [], f"{cid}: loaded state differs"
    return reader


@pytest.fixture
def saved(moto_endpoint, s3cfg, tmp_path):
    """A checkpoint committed locally and on S3, then the local tier lost."""
    s3 = s3cfg(moto_endpoint)
    cfg = make_cfg(tmp_path, s3)
    sd = state(7)
    sd["model"]["empty"] = torch.empty(0, 4)  # an item of no bytes: the file is covered all the same
    save(cfg, sd, "step-7")
    local = cfg.local.resolved_path()
    shutil.rmtree(local)
    return cfg, sd, local, s3


def test_load_from_s3_fills_the_local_tier(saved, tmp_path):
    cfg, sd, local, s3 = saved
    reader = load(cfg, sd)
    assert set(reader.served.values()) == {"s3"}
    assert reader.fill is not None
    reader.fill.wait()
    client = s3_client(s3.endpoint_url)
    files = local_files(local, "step-7")
    assert metadata_key("step-7") in files
    data = [k for k in files if k != metadata_key("step-7")]
    assert len(data) == 1 and reader.fill.committed == [data[0].rsplit("/", 1)[1]]
    for key, path in files.items():  # byte-identical to S3's copy, metadata (commit time) included
        assert s3_get(client, s3.bucket, key) == path.read_bytes(), key
    assert not [p for p in local.rglob("*") if p.name.endswith(".partial")]
    # the next load (S3 gone from the configuration) is served by the local copy
    local_only = make_cfg(tmp_path, None)
    again = load(local_only, sd)
    assert set(again.served.values()) == {"local"} and again.fill is None


def test_fill_off_leaves_the_local_tier_alone(saved, tmp_path):
    cfg, sd, local, _ = saved
    cfg.local.fill_on_load = False
    reader = load(cfg, sd)
    assert reader.fill is None and set(reader.served.values()) == {"s3"}
    assert not local_files(local, "step-7")


def test_fill_skips_a_file_another_writer_has_open(saved):
    cfg, sd, local, _ = saved
    doc = md_doc(s3_get(s3_client(cfg.s3.endpoint_url), cfg.s3.bucket, metadata_key("step-7")))
    (name,) = doc["files"]
    partial = local / (data_key("step-7", name) + ".partial")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"someone else's bytes")
    reader = load(cfg, sd)
    assert reader.fill is None  # nothing else to fill: no metadata committed for nothing
    assert partial.read_bytes() == b"someone else's bytes"  # the other writer's file is left alone
    assert not (local / metadata_key("step-7")).exists()


def test_a_failing_fill_never_fails_the_load(saved, caplog):
    cfg, sd, local, _ = saved
    doc = md_doc(s3_get(s3_client(cfg.s3.endpoint_url), cfg.s3.bucket, metadata_key("step-7")))
    (name,) = doc["files"]
    blocker = local / data_key("step-7", name)
    blocker = blocker.parent
    blocker.parent.mkdir(parents=True)
    blocker.write_bytes(b"a file where the data directory goes")  # every write there fails
    with caplog.at_level(logging.INFO, logger="tierckpt"):
        reader = load(cfg, sd)
    assert set(reader.served.values()) == {"s3"}
    assert reader.fill is None
    assert "not filling" in caplog.text and name in caplog.text
    assert blocker.read_bytes() == b"a file where the data directory goes"
    assert not (local / metadata_key("step-7")).exists()


def test_fill_resumes_a_partial_fetch(saved, tmp_path):
    """A local copy committed with some files (``fetch --rank``) gains the missing ones."""
    cfg, _, local, s3 = saved
    big = make_cfg(tmp_path / "two", s3, local=True)
    # a full save, then its local data file dropped and its metadata kept: a partial local copy
    sd = state(9)
    save(big, sd, "step-9")
    root = big.local.resolved_path()
    (data,) = [k for k in local_files(root, "step-9") if k != metadata_key("step-9")]
    (root / data).unlink()
    reader = load(big, sd, "step-9")
    assert set(reader.served.values()) == {"s3"} and reader.fill is not None
    reader.fill.wait()
    assert (root / data).read_bytes() == s3_get(s3_client(s3.endpoint_url), s3.bucket, data)
    assert set(load(make_cfg(tmp_path / "two", None), sd, "step-9").served.values()) == {"local"}


def test_state_is_the_users_after_the_load(saved):
    """The fill never holds the destination tensors: changing them after the load changes
    nothing that was written."""
    cfg, sd, local, s3 = saved
    got = placeholder(sd)
    reader = TieredReader(cfg)
    dcp.load(got, checkpoint_id="latest", storage_reader=reader)
    for t in got["model"].values():
        if isinstance(t, torch.Tensor):
            t.zero_()
    reader.fill.wait()
    client = s3_client(s3.endpoint_url)
    for key, path in local_files(local, "step-7").items():
        assert s3_get(client, s3.bucket, key) == path.read_bytes(), key


@pytest.mark.parametrize("direct_io", ["auto", False])
def test_fill_writes_whole_pages_direct(saved, monkeypatch, direct_io):
    """Where the local tier takes ``O_DIRECT``, the fill copies each item through a reused
    page-aligned staging buffer (several pieces per item here), so the pages of the file go to
    the device directly and only an item's edges are buffered; with ``direct_io = false`` every
    write is buffered. The file is byte-identical to S3's either way."""
    import tierckpt.load.fill as fill_mod
    import tierckpt.tiers.localfs as localfs
    import tierckpt.tiers.localsinks as sinks

    cfg, sd, local, s3 = saved
    cfg.local.direct_io = direct_io
    monkeypatch.setattr(fill_mod, "STAGE_BYTES", 64 << 10)
    monkeypatch.setattr(localfs, "DIRECT_WRITE_MIN", 0)  # a small file, written direct all the same
    direct: list[int] = []
    real = sinks._pwrite_direct

    def spy(tier, dfd, path, mv, offset):  # noqa: ANN001
        done = real(tier, dfd, path, mv, offset)
        direct.append(done)
        return done

    monkeypatch.setattr(sinks, "_pwrite_direct", spy)
    probe = local.parent / "probe"
    probe.mkdir(exist_ok=True)
    try:
        fd = os.open(probe / "f", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
        os.close(fd)
        accepts = hasattr(os, "O_DIRECT")
    except OSError:
        accepts = False
    reader = load(cfg, sd)
    reader.fill.wait()
    (name,) = reader.fill.committed
    client = s3_client(s3.endpoint_url)
    for key, path in local_files(local, "step-7").items():
        assert s3_get(client, s3.bucket, key) == path.read_bytes(), key
    size = (local / data_key("step-7", name)).stat().st_size
    if direct_io is False or not accepts:
        assert sum(direct) == 0
    else:  # the 12 MiB item went by pages of 64 KiB pieces; only edges and small items did not
        assert sum(direct) >= size - 64 * 1024 and len(direct) > 12 * 16
