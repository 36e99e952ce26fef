"""Hostile stored frames and stored indexes cost bounded memory and fall back (issue 32, items 3-4).

An attacker who can write a tier's objects (with valid CRCs: the index is rewritten through
:func:`add_stored`) plants either a zstd stream whose header declares 1 GiB (a decompression
bomb: python-zstandard sizes its output by the header and ignores ``max_output_size`` then), or
a ``frame`` of 1 GiB / 1 TiB in the stored index. Either way a load must use memory bounded by
the stored frame, raise :class:`CorruptCheckpoint` when no other tier holds a good copy, and be
served bit-exact by the next tier when one does. Real parts: a local tier and moto's S3 server
over HTTP, ``compression = "zstd"``. Memory is measured with :mod:`tracemalloc` (the decoder's
output, numpy and bytearray buffers are all traced; moto runs in this process and is counted
too), against a generous bound far below the sizes the attacker declares.
"""

from __future__ import annotations

import dataclasses
import shutil
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import archive_tier  # noqa: F401 - registers [archive], the third tier of the fallback test
import numpy as np
import pytest
import s3servers
import torch
import torch.distributed.checkpoint as dcp
from s3_scenarios import compare, placeholder
from s3servers import s3_client

import tierckpt
from tierckpt import TieredReader, TieredWriter
from tierckpt.catalog.listing import read_checkpoint_doc
from tierckpt.codec.frames import decode_into, encode
from tierckpt.codec.view import decoding
from tierckpt.config import S3Config, config_from_dict
from tierckpt.errors import CorruptCheckpoint, find_error
from tierckpt.format import stored
from tierckpt.format.layout import data_key, metadata_key
from tierckpt.format.stored import StoredFile, add_stored
from tierckpt.load.readback import Readback, Request
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.s3 import S3Tier

MiB = 1 << 20
GiB = 1 << 30
BOUND = 256 * MiB
"""Peak traced memory allowed for a hostile read: the checkpoint is 8 MiB, the attacker declares 1 GiB."""
CID = "step-1"


def bomb_stream(n: int, declared: bool) -> bytes:
    """A zstd frame of ``n`` zero bytes (``n``: a multiple of 128 KiB) in RLE blocks, 4 bytes per
    128 KiB (32 KiB for 1 GiB); its header records ``n`` as the content size when ``declared``."""
    fhd = 0xC0 if declared else 0x00  # content size in 8 bytes / absent; window descriptor follows
    head = b"\x28\xb5\x2f\xfd" + bytes([fhd, 7 << 3]) + (n.to_bytes(8, "little") if declared else b"")
    block = 128 << 10  # a 128 KiB window (2^(10 + 7)): the largest block
    k = n // block
    rle = ((1 << 1) | (block << 3)).to_bytes(3, "little") + b"\x00"
    last = (1 | (1 << 1) | (block << 3)).to_bytes(3, "little") + b"\x00"
    return head + rle * (k - 1) + last


def bomb_frame(count: int, declared: bool, n: int = GiB) -> bytes:
    """A stored frame (version 1) of ``count`` logical bytes: one width-1 segment whose one plane
    is a zstd stream that inflates to ``n`` bytes."""
    s = bomb_stream(n, declared)
    return (
        b"\x01"
        + (1).to_bytes(4, "little")
        + count.to_bytes(4, "little")
        + b"\x01"
        + b"\x01"
        + b"\x01"
        + len(s).to_bytes(4, "little")
        + s
    )


def peak_of(fn: Callable[[], Any]) -> tuple[Any, int, BaseException | None]:
    """``fn()``'s result (None if it raised), the peak traced memory above the start, the error."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        try:
            return fn(), tracemalloc.get_traced_memory()[1] - base, None
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            return None, tracemalloc.get_traced_memory()[1] - base, e
    finally:
        tracemalloc.stop()


# -- the frame decoder and the index, alone ------------------------------------------------------


@pytest.mark.parametrize("declared", [True, False], ids=["declared-1GiB", "no-content-size"])
def test_a_frame_that_inflates_to_1_gib_is_refused_with_bounded_memory(declared: bool) -> None:
    count = 4 * MiB
    out = bytearray(count)
    _, peak, err = peak_of(lambda: decode_into(bomb_frame(count, declared), memoryview(out), "rank-0 frame 7"))
    assert isinstance(err, CorruptCheckpoint) and "rank-0 frame 7" in str(err), err
    assert peak < BOUND, f"{peak >> 20} MiB traced while refusing the frame"
    # a stream that declares the right size and holds it decodes (the check refuses nothing real)
    good = bomb_frame(count, declared, count)
    decode_into(good, memoryview(out), "rank-0 frame 7")
    assert bytes(out) == bytes(count)
    data = np.random.default_rng(1).standard_normal(1 << 20).astype(np.float32)
    back = bytearray(data.nbytes)
    decode_into(encode(data, [(data.nbytes, 4)]), memoryview(back), "f")
    assert bytes(back) == data.tobytes()


def test_stored_index_bounds_frame_from_above() -> None:
    size = 8 * MiB

    def entry(frame: int) -> dict:
        n = -(-size // frame)
        return StoredFile("zstd", frame, size, [frame // 2] * (n - 1) + [100], [b"h" * 16] * n, 1).to_json()

    for frame in (GiB, 1 << 40):
        with pytest.raises(CorruptCheckpoint, match=f"stored index of rank-0.data.*frame {frame}"):
            StoredFile.from_json(entry(frame), "rank-0.data", size)
    cap = stored.MAX_FRAME
    with pytest.raises(CorruptCheckpoint, match=f"frame {cap + 4096}"):
        StoredFile.from_json(entry(cap + 4096), "rank-0.data", size)
    assert StoredFile.from_json(entry(cap), "rank-0.data", size).frame == cap
    # a file smaller than its frame is what every writer writes for small files: accepted
    small = StoredFile("zstd", 4 * MiB, 100, [50], [b"h" * 16], 1).to_json()
    assert StoredFile.from_json(small, "rank-1.data", 100).frames == 1


# -- end to end: a local tier and S3 (moto over HTTP) -----------------------------------------------


@dataclasses.dataclass
class Saved:
    cfg: Any
    s3: S3Config
    root: Path
    state: dict
    file: str
    body: bytes
    meta: bytes


def _state() -> dict:
    g = torch.Generator().manual_seed(32)
    return {
        "w": torch.randn(2 << 20, generator=g) * 0.02,  # 8 MiB of fp32: two 4 MiB frames and a small one
        "b": (torch.randn(5000, generator=g)).to(torch.bfloat16),
        "step": 32,
    }


@pytest.fixture(scope="module")
def saved(moto_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    """One checkpoint saved to the local tier and promoted to S3 encoded (zstd); each test puts
    back the S3 objects it damaged."""
    root = tmp_path_factory.mktemp("bounds")
    bucket = f"tierckpt-{uuid.uuid4().hex[:12]}"
    s3servers.make_bucket(moto_endpoint, bucket)
    s3 = S3Config(
        bucket=bucket,
        prefix="ckpt",
        endpoint_url=moto_endpoint,
        part_size=5 * MiB,
        concurrency=4,
        max_attempts=5,
        connect_timeout=2.0,
        read_timeout=10.0,
        compression="zstd",
    )
    s3.validate()
    cfg = config_from_dict(
        {
            "job": {"commit_timeout": 60.0},
            "host": {"buffer_size": "32MiB", "chunk_size": "8MiB"},
            "local": {"path": str(root / "local"), "keep": 0, "fsync": False},
            "s3": dataclasses.asdict(s3),
        }
    )
    sd = _state()
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id=CID, storage_writer=w, no_dist=True)
    w.wait()
    w.close()
    tier = S3Tier(s3)
    try:
        man = read_checkpoint_doc(tier, CID).manifest
        ((file, idx),) = man.stored.items()
        assert idx.codec == "zstd" and idx.frames >= 2
        body = tier.get(data_key(CID, file))
        meta = tier.get(metadata_key(CID))
    finally:
        tier.close()
    yield Saved(cfg, s3, root, sd, file, body, meta)


def _put(s: Saved, key: str, data: bytes) -> None:
    s3_client(s.s3.endpoint_url).put_object(Bucket=s.s3.bucket, Key=f"{s.s3.prefix}/{key}", Body=data)


def _damage(s: Saved, how: str) -> None:
    """Rewrite S3's copy as an attacker would: stored object and/or index, the metadata's CRC valid."""
    tier = S3Tier(s.s3)
    try:
        idx = read_checkpoint_doc(tier, CID).manifest.stored[s.file]
    finally:
        tier.close()
    o = idx.offsets
    if how == "bomb":  # frame 0 replaced by a 32 KiB frame whose one stream inflates to 1 GiB
        a, b = idx.span(0)
        frame0 = bomb_frame(b - a, declared=True)
        body = frame0 + s.body[o[1] :]
        new = StoredFile(idx.codec, idx.frame, idx.size, [len(frame0), *idx.sizes[1:]], idx.hashes, idx.level)
        _put(s, data_key(CID, s.file), body)
    else:  # the index claims one frame of 1 GiB / 1 TiB holding the whole object
        frame = GiB if how == "frame-1GiB" else 1 << 40
        new = StoredFile(idx.codec, frame, idx.size, [idx.stored], idx.hashes[:1], idx.level)
    _put(s, metadata_key(CID), add_stored(s.meta, {s.file: new}))


def _restore(s: Saved) -> None:
    _put(s, data_key(CID, s.file), s.body)
    _put(s, metadata_key(CID), s.meta)


DAMAGES = ["bomb", "frame-1GiB", "frame-1TiB"]


@pytest.mark.parametrize("how", DAMAGES)
def test_hostile_s3_copy_is_served_from_the_local_tier_with_bounded_memory(saved: Saved, how: str) -> None:
    """The read engine reads the damaged S3 copy first: bounded memory, then every item
    bit-exact from the local tier."""
    s = saved
    _damage(s, how)
    tier = S3Tier(s.s3)
    local = LocalTier(s.root / "local", fsync=False)
    try:
        doc = read_checkpoint_doc(local, CID)
        reqs = [Request(rec, memoryview(bytearray(rec.length)), f"item {i.fqn}") for i, rec in doc.items if rec.length]
        rb = Readback(CID, [decoding(tier, CID), local], doc.manifest.chunk_size)

        def read() -> None:
            for r in reqs:  # one item at a time: reads of part of a frame, as a ranged load makes
                rb.read([r])

        _, peak, err = peak_of(read)
        assert err is None, f"{type(err).__name__}: {err}"
        assert peak < BOUND, f"{how}: {peak >> 20} MiB traced reading the damaged copy"
        assert rb.recovered.get(s.file) == "local"
        expect = [Request(r.rec, memoryview(bytearray(r.rec.length)), r.what) for r in reqs]
        Readback(CID, [local], doc.manifest.chunk_size).read(expect)
        assert all(bytes(a.buf) == bytes(b.buf) for a, b in zip(reqs, expect))
    finally:
        tier.close()
        local.close()
        _restore(s)


@pytest.mark.parametrize("how", DAMAGES)
def test_hostile_s3_copy_alone_is_corrupt_with_bounded_memory(saved: Saved, how: str) -> None:
    """The local copy lost, S3's damaged: ``dcp.load`` raises CorruptCheckpoint naming the
    checkpoint and the file (a TierckptError a resume loop catches, never a MemoryError), with
    bounded memory; the documented resume loop ends with nothing older to resume from; the
    repaired copy loads bit-exact. A hostile index is refused with the metadata
    (``read_metadata``: DCP 2.13 re-raises that as text only, which ``find_error`` maps back to
    the reader's error; ``latest`` skips such a checkpoint), a bomb when its frame is read."""
    s = saved
    _damage(s, how)
    aside = s.root / "local-aside"
    shutil.move(s.root / "local", aside)
    try:

        def load() -> None:
            target = placeholder(s.state)
            dcp.load(target, checkpoint_id=CID, storage_reader=TieredReader(s.cfg), no_dist=True)

        _, peak, err = peak_of(load)
        assert err is not None, f"{how}: the damaged copy loaded"
        assert peak < BOUND, f"{how}: {peak >> 20} MiB traced loading the damaged copy"
        bad = find_error(err, CorruptCheckpoint)  # also where DCP kept only read_metadata's text
        assert bad is not None, f"{how}: {type(err).__name__}: {err}"
        assert CID in str(bad) and s.file in str(bad), bad
        # the resume loop of docs/operations.md ("A bad newest checkpoint") ends cleanly: nothing
        # older to resume from, and no other error (a MemoryError) escapes it. ``latest`` skips
        # a checkpoint whose index is refused; a bomb is found by the load.
        cid = tierckpt.latest(s.cfg)
        tried = []
        while cid is not None:
            tried.append(cid)
            try:
                dcp.load(placeholder(s.state), checkpoint_id=cid, storage_reader=TieredReader(s.cfg), no_dist=True)
                break
            except BaseException as e:  # noqa: BLE001 - as documented: DCP's CheckpointException
                if find_error(e, CorruptCheckpoint) is None:
                    raise
                cid = tierckpt.latest(s.cfg, before=cid)
        assert cid is None and tried == ([CID] if how == "bomb" else []), (cid, tried)
        _restore(s)
        target = placeholder(s.state)
        reader = TieredReader(s.cfg)
        dcp.load(target, checkpoint_id=CID, storage_reader=reader, no_dist=True)
        assert compare(s.state, target) == []
        assert set(reader.served.values()) == {"s3"}
    finally:
        _restore(s)
        if (s.root / "local").exists():
            shutil.rmtree(s.root / "local")
        shutil.move(aside, s.root / "local")


@pytest.fixture(scope="module")
def chained(saved: Saved, moto_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    """The checkpoint saved again through three tiers, ``[local]`` -> ``[s3]`` (zstd) -> ``[archive]``
    (a directory after S3, ``tests/archive_tier.py``), in a bucket of its own; then the local
    directory is lost, so that a load reads S3 first and the archive holds the other copy
    (``fill_on_load = false``: a load does not put the local copy back)."""
    root = tmp_path_factory.mktemp("chained")
    bucket = f"tierckpt-{uuid.uuid4().hex[:12]}"
    s3servers.make_bucket(moto_endpoint, bucket)
    s3 = dataclasses.replace(saved.s3, bucket=bucket)
    cfg = config_from_dict(
        {
            "job": {"commit_timeout": 60.0},
            "host": {"buffer_size": "32MiB", "chunk_size": "8MiB"},
            "local": {"path": str(root / "local"), "keep": 0, "fsync": False, "fill_on_load": False},
            "s3": dataclasses.asdict(s3),
            "archive": {"path": str(root / "archive")},
        }
    )
    w = TieredWriter(cfg)
    dcp.save(saved.state, checkpoint_id=CID, storage_writer=w, no_dist=True)
    w.wait()
    w.close()
    shutil.rmtree(root / "local")
    tier = S3Tier(s3)
    try:
        ((file, idx),) = read_checkpoint_doc(tier, CID).manifest.stored.items()
        assert idx.codec == "zstd" and idx.frames >= 2
        body, meta = tier.get(data_key(CID, file)), tier.get(metadata_key(CID))
    finally:
        tier.close()
    yield Saved(cfg, s3, root, saved.state, file, body, meta)


@pytest.mark.parametrize("how", DAMAGES)
def test_dcp_load_falls_back_past_a_hostile_s3_copy_to_the_next_tier(chained: Saved, how: str) -> None:
    """``dcp.load`` with the local copy lost reads S3 first; its copy is hostile (valid CRCs).
    The load succeeds bit-exact from ``[archive]``, the tier after S3, with bounded memory: no
    MemoryError, no bomb inflated, no frame-sized buffer."""
    s = chained
    _damage(s, how)
    try:
        # the whole state, then ``b`` alone: a read of part of a frame, as a partial load makes
        for want in (s.state, {"b": s.state["b"]}):
            target = placeholder(want)
            reader = TieredReader(s.cfg)
            _, peak, err = peak_of(lambda: dcp.load(target, checkpoint_id=CID, storage_reader=reader, no_dist=True))
            assert err is None, f"{how} {list(want)}: {type(err).__name__}: {err}"
            assert peak < BOUND, f"{how} {list(want)}: {peak >> 20} MiB traced loading past the damaged copy"
            assert compare(want, target) == []
            # the bomb is frame 0 alone: ``b`` lies in the last frame, intact, and S3 serves it
            intact = how == "bomb" and "w" not in want
            assert reader.served.get(s.file) == ("s3" if intact else "archive"), reader.served
    finally:
        _restore(s)


def test_any_error_from_a_tiers_copy_fails_that_tier_only(saved: Saved) -> None:
    """The read engine's net under the checks above: an index that no check saw (handed to the
    view as parsed, its sizes 1 PiB a frame) makes the view raise a bare MemoryError; the engine
    treats it as that tier's read error: the local tier serves, and with no other tier the
    engine raises CorruptCheckpoint naming it, the MemoryError chained."""
    s = saved
    tier = S3Tier(s.s3)
    local = LocalTier(s.root / "local", fsync=False)
    try:
        doc = read_checkpoint_doc(tier, CID)
        idx = doc.manifest.stored[s.file]
        doc.manifest.stored[s.file] = dataclasses.replace(idx, sizes=[1 << 50] * idx.frames, _offsets=[])
        reqs = [Request(rec, memoryview(bytearray(rec.length)), f"item {i.fqn}") for i, rec in doc.items if rec.length]
        rb = Readback(CID, [decoding(tier, CID, doc), local], doc.manifest.chunk_size)
        rb.read(reqs)
        assert rb.recovered.get(s.file) == "local"
        expect = [Request(r.rec, memoryview(bytearray(r.rec.length)), r.what) for r in reqs]
        Readback(CID, [local], doc.manifest.chunk_size).read(expect)
        assert all(bytes(a.buf) == bytes(b.buf) for a, b in zip(reqs, expect))
        alone = Readback(CID, [decoding(tier, CID, doc)], doc.manifest.chunk_size)
        with pytest.raises(CorruptCheckpoint, match=f"checkpoint {CID}.*{s.file}.*MemoryError") as ei:
            alone.read([Request(r.rec, memoryview(bytearray(r.rec.length)), r.what) for r in reqs])
        assert isinstance(ei.value.__cause__, MemoryError)
    finally:
        tier.close()
        local.close()
