"""The codec (tierckpt/codec): frames by byte planes, the stored index in metadata.json, and the
decoding view. Bit-exact round trips for every dtype; damaged frames and hostile indexes refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tierckpt.codec import add_stored, frame_size, strip_stored
from tierckpt.codec.frames import decode_into, encode, encode_into, segments_of, stored_bound
from tierckpt.codec.hop import Previous, copy_encoded, width_runs
from tierckpt.codec.view import decoding
from tierckpt.errors import CorruptCheckpoint
from tierckpt.format.stored import StoredFile, parse_stored
from tierckpt.tiers.base import Encoding
from tierckpt.tiers.local import LocalTier

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.int32,
]


def _tensor(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype) * 0.02
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 0.02).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), (n,), generator=g, dtype=dtype)


def _bytes(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().copy() if t.numel() else np.zeros(0, np.uint8)


def _width(t: torch.Tensor) -> int:
    return width_runs([(0, 1, str(t.dtype).removeprefix("torch."))])[0][2]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n", [0, 1, 7, 1001, 65536 + 3])
def test_frame_round_trip_every_dtype(dtype: torch.dtype, n: int) -> None:
    data = _bytes(_tensor(dtype, n))
    segs = [(len(data), _width(_tensor(dtype, 1)))] if len(data) else []
    stored = encode(data, segs)
    out = bytearray(len(data))
    decode_into(stored, memoryview(out), "test")
    assert bytes(out) == data.tobytes()


def test_non_contiguous_and_mixed_widths_in_one_frame() -> None:
    a = _tensor(torch.float32, 4096).reshape(64, 64).t()  # a transposed view: not contiguous
    assert not a.is_contiguous()
    parts = [
        _bytes(a),
        _bytes(_tensor(torch.bfloat16, 999)),
        np.frombuffer(b"pickled object bytes" * 7, np.uint8),
        _bytes(_tensor(torch.float64, 333)),
        _bytes(_tensor(torch.bfloat16, 10)),
    ]
    widths = [4, 2, 1, 8, 2]
    data = np.concatenate(parts)
    segs = [(len(p), w) for p, w in zip(parts, widths)]
    stored = encode(data, segs)
    out = bytearray(len(data))
    decode_into(stored, memoryview(out), "test")
    assert bytes(out) == data.tobytes()
    assert len(stored) < len(data)  # float data with small values compresses


def test_planes_of_bf16_weights_compress_and_random_bytes_stay_raw() -> None:
    w = _bytes((torch.randn(1 << 20) * 0.02).to(torch.bfloat16))
    stored = encode(w, [(len(w), 2)])
    assert len(w) / len(stored) > 1.3  # the exponent plane codes well; the mantissa plane is raw
    noise = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    s2 = encode(noise, [(len(noise), 1)])
    assert s2[0] == 0 and len(s2) == len(noise) + 1  # kept as it was
    # as 4-byte elements: the top plane is coded without a sample first, and kept raw all the same
    s4 = encode(noise, [(len(noise), 4)])
    assert s4[0] == 0 and len(s4) == len(noise) + 1


def test_encode_into_a_reused_buffer_writes_what_encode_returns() -> None:
    """The hop codes each frame into a buffer it reuses (no copy out): whatever the buffer held
    before, the frame is the same bytes as :func:`encode` returns, coded or kept raw."""
    noise = np.random.default_rng(1).integers(0, 256, 300_001, dtype=np.uint8)
    mixed = np.concatenate(
        [_bytes(_tensor(torch.bfloat16, 100_000)), noise[:77], _bytes(_tensor(torch.float32, 50_000))]
    )
    cases = [
        (mixed, [(200_000, 2), (77, 1), (200_000, 4)]),
        (noise, [(len(noise), 4)]),  # not smaller: kept raw
        (noise[:40], [(1, 2)] * 40),  # a header longer than the frame: kept raw
    ]
    dst = np.full(stored_bound(len(mixed), cases[0][1]) + 10, 0xAB, np.uint8)
    for data, segs in cases:
        n = encode_into(data, segs, 1, dst)
        assert bytes(dst[:n]) == encode(data, segs)
        out = bytearray(len(data))
        decode_into(memoryview(dst)[:n], memoryview(out), "test")
        assert bytes(out) == data.tobytes()
        dst[:] = 0xCD  # garbage for the next frame
    with pytest.raises(ValueError, match="room"):
        encode_into(mixed, cases[0][1], 1, bytearray(len(mixed)))


def test_literal_only_coder_and_its_fallback_write_frames_one_reader_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Byte planes are coded literal-only where the zstd module takes the parameter (the package's
    dependency brings one); frames coded without it (older checkpoints, or the fallback to
    python-zstandard's stable parameters) decode the same way, at about the same size."""
    from tierckpt.codec import frames

    assert frames._entropy_coder() is not None
    data = np.concatenate(
        [_bytes((torch.randn(1 << 19) * 0.02).to(torch.bfloat16)), _bytes(torch.randn(1 << 18).square() * 1e-6)]
    )
    segs = [(1 << 20, 2), (1 << 20, 4)]
    sizes = []
    for fallback in (False, True):
        monkeypatch.setattr(frames._local, "compressors", {}, raising=False)  # this thread's coders, made anew
        if fallback:
            monkeypatch.setattr(frames, "_entropy_coder", lambda: None)
        stored = encode(data, segs)
        assert stored[0] in (1, 2)  # coded (2: the fp32 group's low planes paired, see below)
        out = bytearray(len(data))
        decode_into(stored, memoryview(out), "test")
        assert bytes(out) == data.tobytes()
        sizes.append(len(stored))
    assert 0.9 < sizes[0] / sizes[1] < 1.1


def _v1_frame(x: np.ndarray) -> bytes:
    """A version-1 frame of fp32 elements ``x``, built from the format's description (as every
    release before version 2 wrote it): planes 0-2 raw, plane 3 a zstd frame."""
    import struct

    import zstandard

    u = x.view("<u4")
    planes = [((u >> (8 * j)) & 0xFF).astype(np.uint8).tobytes() for j in range(4)]
    top = zstandard.ZstdCompressor(level=1).compress(planes[3])
    head = b"\x01" + struct.pack("<I", 1) + struct.pack("<IB", x.nbytes, 4) + bytes([4])
    head += b"".join(struct.pack("<BI", 0, len(u)) for _ in range(3)) + struct.pack("<BI", 1, len(top))
    return head + b"".join(planes[:3]) + top


def test_fp32_frames_pair_raw_low_planes_in_version_2_and_version_1_still_decodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Width-4 groups whose planes 0 and 1 are kept raw are written as one run of 16-bit halves
    (frame version 2: the same stored bytes, one stream head fewer); frames of version 1 (older
    checkpoints) decode as before; low planes that compress keep version 1."""
    from tierckpt.codec import frames

    x = (torch.randn(1 << 18, generator=torch.Generator().manual_seed(3)) * 0.02).numpy()
    v2 = encode(x.view(np.uint8), [(x.nbytes, 4)])
    with monkeypatch.context() as m:
        m.setattr(frames, "_low_samples", lambda *a: None)  # no pairing: the version-1 encoder
        v1 = encode(x.view(np.uint8), [(x.nbytes, 4)])
    assert v1[0] == 1 and v2[0] == 2 and len(v2) == len(v1) - 5
    for stored in (_v1_frame(x), v1, v2):
        out = bytearray(x.nbytes)
        decode_into(stored, memoryview(out), "test")
        assert bytes(out) == x.tobytes()
    # mixed widths, the fp32 group in two pieces (its sample gathered across them)
    parts = [_bytes(_tensor(torch.float32, 200_000, seed=4)), _bytes(_tensor(torch.bfloat16, 5000)), x.view(np.uint8)]
    data = np.concatenate(parts)
    segs = [(len(parts[0]), 4), (len(parts[1]), 2), (len(parts[2]), 4)]
    stored = encode(data, segs)
    assert stored[0] == 2
    out = bytearray(len(data))
    decode_into(stored, memoryview(out), "test")
    assert bytes(out) == data.tobytes()
    # small integers: the low planes compress, the frame keeps version 1
    ints = _bytes(torch.randint(0, 300, (1 << 18,), generator=torch.Generator().manual_seed(5), dtype=torch.int32))
    stored = encode(ints, [(len(ints), 4)])
    assert stored[0] == 1 and len(stored) < len(ints) / 2
    out = bytearray(len(ints))
    decode_into(stored, memoryview(out), "test")
    assert bytes(out) == ints.tobytes()


@pytest.mark.parametrize("count", [4 * (64 << 10) - 1, 4 * (64 << 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64, torch.int32])
def test_width_4_groups_at_the_sampling_bound_and_at_odd_offsets_round_trip(count: int, dtype: torch.dtype) -> None:
    """Groups just under and at the sampled size (paired or not), in two pieces that start at
    offsets no multiple of 4 (a 3-byte segment of width 1 before each): bit-exact either way."""
    n = count if not dtype.is_complex else count // 2  # complex64: two 4-byte components each
    half = _bytes(_tensor(dtype, n // 2, seed=6))
    rest = _bytes(_tensor(dtype, n - n // 2, seed=7))
    odd = np.frombuffer(b"abc", np.uint8)
    data = np.concatenate([odd, half, odd, rest])
    segs = [(3, 1), (len(half), 4), (3, 1), (len(rest), 4)]
    stored = encode(data, segs)
    elements = (len(half) + len(rest)) // 4
    assert stored[0] == (2 if elements >= 4 * (64 << 10) and dtype != torch.int32 else 1)
    out = bytearray(len(data))
    decode_into(stored, memoryview(out), "test")
    assert bytes(out) == data.tobytes()


@pytest.mark.parametrize(
    "damage", ["kind 2 in version 1", "kind 2 as plane 2", "kind 2 of a wrong size", "one head short"]
)
def test_malformed_version_2_frames_are_refused(damage: str) -> None:
    x = (torch.randn(1 << 18) * 0.02).numpy()
    f = bytearray(encode(x.view(np.uint8), [(x.nbytes, 4)]))
    assert f[0] == 2
    heads = 1 + 4 + 5 + 1  # version, nseg, one segment, nstream; then 3 stream heads
    if damage == "kind 2 in version 1":
        f[0] = 1
    elif damage == "kind 2 as plane 2":
        f[heads + 5] = 2
    elif damage == "kind 2 of a wrong size":
        f[heads + 1 : heads + 5] = (2 * len(x) - 1).to_bytes(4, "little")
    else:
        f[heads - 1] = 2
    with pytest.raises(CorruptCheckpoint, match="frame"):
        decode_into(bytes(f), memoryview(bytearray(x.nbytes)), "test frame")


def test_segments_of_cuts_runs_at_frame_bounds() -> None:
    runs = [(0, 128, 4), (128, 192, 2), (256, 1024, 8)]
    assert segments_of(0, 1024, runs) == [(128, 4), (64, 2), (64, 1), (768, 8)]
    assert segments_of(100, 300, runs) == [(28, 4), (64, 2), (64, 1), (44, 8)]
    assert segments_of(2000, 3000, runs) == [(1000, 1)]


@pytest.mark.parametrize("damage", ["flip", "truncate", "kind", "segments"])
def test_damaged_frame_is_refused(damage: str) -> None:
    data = _bytes(_tensor(torch.float32, 50000))
    stored = bytearray(encode(data, [(len(data), 4)]))
    if damage == "flip":
        stored[len(stored) // 2] ^= 0xFF
    elif damage == "truncate":
        del stored[-10:]
    elif damage == "kind":
        stored[0] = 7
    else:
        stored[5:9] = (123).to_bytes(4, "little")
    out = bytearray(len(data))
    try:
        decode_into(bytes(stored), memoryview(out), "rank-0 frame 3")
    except CorruptCheckpoint as e:
        assert "rank-0 frame 3" in str(e)
        return
    assert bytes(out) != data.tobytes()  # a flip inside a raw plane decodes: the CRC32C catches it


def test_frame_size_divides_the_chunk_grid() -> None:
    for chunk in (64 << 10, 4 << 20, 6 << 20, 32 << 20, 64 << 20, 12345 * 4096):
        f = frame_size(chunk)
        assert chunk % f == 0 and f % 4096 == 0 and f <= 4 << 20


def _index(size: int = 10000, frame: int = 4096) -> StoredFile:
    n = -(-size // frame)
    return StoredFile("zstd", frame, size, [100 + i for i in range(n)], [bytes([i]) * 16 for i in range(n)], 1)


def test_index_json_round_trip_and_hostile_entries() -> None:
    idx = _index()
    back = StoredFile.from_json(json.loads(json.dumps(idx.to_json())), "f", 10000)
    assert back == idx and back.offsets == [0, 100, 201, 303]
    assert parse_stored(None, {}) == {}
    bad = [
        dict(idx.to_json(), size=9999),
        dict(idx.to_json(), codec="lz77"),
        dict(idx.to_json(), sizes="!!"),
        dict(idx.to_json(), hashes=""),
        dict(idx.to_json(), frame=1),
        "nope",
        dict(idx.to_json(), sizes=__import__("base64").b64encode(np.array([0, 1, 1], "<u4").tobytes()).decode()),
    ]
    for d in bad:
        with pytest.raises(CorruptCheckpoint, match="stored index of f|stored index"):
            parse_stored({"f": d}, {"f": 10000})
    with pytest.raises(CorruptCheckpoint, match="not a data file"):
        parse_stored({"g": idx.to_json()}, {"f": 10000})


def test_add_and_strip_stored_keep_the_first_tiers_metadata_byte_identical(tmp_path: Path) -> None:
    from tierckpt.format.metadata import parse_metadata

    raw = _saved_metadata(tmp_path)
    doc = parse_metadata(raw, "md")
    file = next(iter(doc.manifest.files))
    size = doc.manifest.files[file]
    idx = _index(size, 4096)
    with_idx = add_stored(raw, {file: idx})
    parsed = parse_metadata(with_idx, "md with index")
    assert parsed.manifest.stored[file] == idx and parsed.manifest.stored_size(file) == idx.stored
    assert parsed.manifest.seq == doc.manifest.seq
    assert strip_stored(with_idx) == raw
    assert strip_stored(raw) is raw


def _saved_metadata(tmp_path: Path) -> bytes:
    import torch.distributed.checkpoint as dcp

    from tierckpt import TieredWriter
    from tierckpt.config import config_from_dict

    cfg = config_from_dict(
        {"host": {"buffer_size": "8MiB", "chunk_size": "1MiB"}, "local": {"path": str(tmp_path / "md"), "fsync": False}}
    )
    w = TieredWriter(cfg)
    dcp.save(
        {"w": torch.randn(20000), "b": torch.zeros(3, dtype=torch.bfloat16)},
        checkpoint_id="s-1",
        storage_writer=w,
        no_dist=True,
    )
    w.wait()
    w.close()
    return (tmp_path / "md" / "s-1" / "metadata.json").read_bytes()


class _EncodingLocal(LocalTier):
    """A directory tier that may hold encoded files (the contract of an encoding tier, on disk)."""

    name = "enc"
    may_encode = True


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_copy_encoded_reads_back_through_the_view_and_copies_unchanged_frames(tmp_path: Path, compression: str) -> None:
    src = LocalTier(tmp_path / "src", fsync=False)
    dst = _EncodingLocal(tmp_path / "dst", fsync=False)
    frame = 64 << 10
    w = _bytes(_tensor(torch.bfloat16, 300_000))
    o = _bytes(_tensor(torch.float32, 70_000, seed=1))
    data = np.concatenate([w, o, np.zeros(17, np.uint8)])
    runs = width_runs([(0, len(w), "bfloat16"), (len(w), len(o), "float32")])
    enc = Encoding(compression, 1, True)
    src.put("_00/c-1/rank-00000.data", data.tobytes())
    idx, figs = copy_encoded(src, dst, "_00/c-1/rank-00000.data", size=len(data), frame=frame, runs=runs, encoding=enc)
    assert figs.frames_copied == 0 and figs.logical == len(data)
    if compression == "zstd":
        assert idx.stored < len(data)
    # the next checkpoint: the first bf16 frames changed, the rest did not
    data2 = data.copy()
    data2[:1000] ^= 1
    src.put("_00/c-2/rank-00000.data", data2.tobytes())
    prev = Previous("c-1", "_00/c-1/rank-00000.data", idx)
    idx2, figs2 = copy_encoded(
        src, dst, "_00/c-2/rank-00000.data", size=len(data), frame=frame, runs=runs, encoding=enc, prev=prev
    )
    assert figs2.frames_copied == idx2.frames - 1
    for cid, raw, ix in (("c-1", data, idx), ("c-2", data2, idx2)):
        dst.put(f"{cid}/metadata.json", add_stored(_fake_md(cid, len(data)), {"rank-00000.data": ix}))
        view = decoding(dst, cid)
        key = f"_00/{cid}/rank-00000.data"
        assert view.size(key) == len(data)
        assert view.get(key) == raw.tobytes()
        buf = bytearray(frame + 100)
        view.read_into(key, frame - 50, memoryview(buf))  # straddles two frames
        assert bytes(buf) == raw[frame - 50 : 2 * frame + 50].tobytes()
        a, b = bytearray(10), bytearray(70000)
        view.read_ranges(key, 5, [memoryview(a), memoryview(b)])
        assert bytes(a + b) == raw[5:70015].tobytes()
        assert {i.key: i.size for i in view.list(f"_00/{cid}/")} == {key: len(data)}


def _fake_md(cid: str, size: int) -> bytes:
    """A minimal valid metadata.json of one data file (no items) for the view tests."""
    from tierckpt.checksum import crc32c

    body = json.dumps(
        {
            "format": "tierckpt/1",
            "checkpoint_id": cid,
            "step": 1,
            "created": 1.0,
            "committed": 2.0,
            "world_size": 1,
            "chunk_size": 1 << 20,
            "save_token": "",
            "seq": 1,
            "files": {"rank-00000.data": size},
            "dcp": {"state_dict_metadata": {}},
            "items": [],
        },
        separators=(",", ":"),
    ).encode()
    head = json.dumps(
        {"format": "tierckpt/1", "length": len(body), "crc32c": crc32c(body), "seq": 1, "step": 1, "committed": 2.0}
    ).encode()
    return head + b"\n" + body


def test_frames_code_and_decode_on_many_threads_at_once() -> None:
    """The coding pool and the read engine call the codec from several threads (zstd objects are
    not thread-safe: each thread has its own)."""
    from concurrent.futures import ThreadPoolExecutor

    frames = [_bytes(_tensor(torch.float32, 200_000, seed=i)) for i in range(12)]
    with ThreadPoolExecutor(4) as ex:
        coded = list(ex.map(lambda f: encode(f, [(len(f), 4)]), frames))

        def back(i: int) -> bool:
            out = bytearray(len(frames[i]))
            decode_into(coded[i], memoryview(out), "t")
            return bytes(out) == frames[i].tobytes()

        assert all(ex.map(back, range(len(frames))))
