"""Integrity and hostile input: corrupted bytes, malformed or hostile metadata, pickles.

Checkpoints are written by the real writer, then damaged on disk the way a bad disk, a truncated
copy or an attacker would; every load must refuse with a precise error and never run code or read
outside the checkpoint.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt import (
    CheckpointNotFound,
    ChecksumMismatch,
    CorruptCheckpoint,
    HostConfig,
    InvalidCheckpointId,
    LocalConfig,
    TierckptError,
    TierConfig,
    TieredReader,
    TieredWriter,
)
from tierckpt.checksum import crc32c
from tierckpt.testing import find_error

MiB = 1 << 20
ALIGN = 64
CHUNK = 256 << 10

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# -- helpers --------------------------------------------------------------------------------


def make_cfg(tmp_path) -> TierConfig:
    return TierConfig(
        host=HostConfig(buffer_size=2 * MiB, chunk_size=CHUNK),
        local=LocalConfig(path=str(tmp_path / "ckpt"), keep=0, fsync=False),
    )


def save(cfg, sd, cid) -> None:
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id=cid, storage_writer=w, no_dist=True)
    w.wait()


def load(cfg, sd, cid, **kw) -> None:
    dcp.load(sd, checkpoint_id=cid, storage_reader=TieredReader(cfg, **kw), no_dist=True)


def load_fails(cfg, sd, cid, cls=CorruptCheckpoint, **kw) -> BaseException:
    """dcp.load must fail; return the ``cls`` error found in what it raised (DCP may wrap it)."""
    with pytest.raises(BaseException) as ei:
        load(cfg, sd, cid, **kw)
    err = find_error(ei.value, cls)
    assert err is not None, f"expected {cls.__name__}, got {ei.value!r}"
    return err


def load_refused_at_metadata(cfg, sd, cid, expected: BaseException) -> None:
    """dcp.load must fail with ``expected`` (raised by read_metadata).

    DCP 2.13 re-raises metadata read failures as an AssertionError inside a CheckpointException,
    so the type may be lost on the way: the message must still carry the reader's error.
    """
    with pytest.raises(BaseException) as ei:
        load(cfg, sd, cid)
    err = find_error(ei.value, type(expected))
    assert err is not None or str(expected) in str(ei.value), repr(ei.value)


def data_path(cfg, cid, file: str) -> Path:
    """The data file ``file`` of checkpoint ``cid``, wherever the layout puts it under the tier root."""
    root = cfg.local.resolved_path()
    found = [p for p in root.rglob(file) if p.is_file() and cid in p.relative_to(root).parts[:-1]]
    assert len(found) == 1, (file, found)
    return found[0]


def ckpt_dir(cfg, cid) -> Path:
    return cfg.local.resolved_path() / cid


def read_meta(cfg, cid) -> tuple[dict | None, dict]:
    """(header, body) of metadata.json: an optional header line, then the JSON body."""
    raw = (ckpt_dir(cfg, cid) / "metadata.json").read_bytes()
    head, sep, body = raw.partition(b"\n")
    if sep and body.strip():
        return json.loads(head), json.loads(body)
    return None, json.loads(raw)


def write_meta(cfg, cid, doc: dict, header: dict | None) -> None:
    """Rewrite metadata.json with a *valid* frame, so the reader gets past the framing check."""
    body = json.dumps(doc, separators=(",", ":")).encode()
    path = ckpt_dir(cfg, cid) / "metadata.json"
    if header is None:
        path.write_bytes(body)
        return
    new_header = dict(header, length=len(body), crc32c=crc32c(body))
    path.write_bytes(json.dumps(new_header).encode() + b"\n" + body)


def item_of(doc: dict, fqn: str) -> dict:
    (it,) = [it for it in doc["items"] if it["index"][0] == fqn]
    return it


def padded(n: int) -> int:
    return n + (-n) % ALIGN


def crc_pieces(file_bytes: bytes, pos: int, length: int, chunk: int, cover_padding: bool) -> list[int]:
    """CRC32C of [pos, pos+length (+padding)) cut at the chunk grid, as the format describes."""
    end = pos + (padded(length) if cover_padding else length)
    out, start = [], pos
    while start < end:
        cut = min(end, (start // chunk + 1) * chunk)
        out.append(crc32c(file_bytes[start:cut]))
        start = cut
    return out


def covers_padding(cfg, cid, doc) -> bool:
    """Whether this format's CRC pieces include the padding after each item (checked on a real item)."""
    data = {f: data_path(cfg, cid, f).read_bytes() for f in doc["files"]}
    for it in doc["items"]:
        if it["length"] % ALIGN:
            return crc_pieces(data[it["file"]], it["pos"], it["length"], doc["chunk_size"], True) == it["crcs"]
    return True


def flip(path: Path, offset: int) -> None:
    b = bytearray(path.read_bytes())
    b[offset] ^= 0x5A
    path.write_bytes(bytes(b))


class Evil:
    """Unpickling this creates ``marker``: proof that pickle code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class Benign:
    """A harmless custom class: only loadable without weights_only."""

    def __init__(self, x: int, tag: str) -> None:
        self.x, self.tag = x, tag

    def __eq__(self, other) -> bool:
        return isinstance(other, Benign) and (self.x, self.tag) == (other.x, other.tag)


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "small": torch.randn(7, 3, generator=g),  # 84 bytes: followed by padding
        "big": torch.randn(150_000, generator=g),  # 600 kB: several CRC pieces (256 KiB chunks)
        "ints": torch.arange(100, dtype=torch.int64),
        "obj": {"name": "run", "lr": 0.5},
    }


def target() -> dict:
    return {
        "small": torch.zeros(7, 3),
        "big": torch.zeros(150_000),
        "ints": torch.zeros(100, dtype=torch.int64),
        "obj": {"name": None, "lr": None},
    }


@pytest.fixture
def saved(tmp_path):
    cfg = make_cfg(tmp_path)
    sd = state()
    save(cfg, sd, "step-5")
    return cfg, sd


def assert_loads_ok(cfg, sd, cid="step-5") -> None:
    out = target()
    load(cfg, out, cid)
    for k in ("small", "big", "ints"):
        assert torch.equal(out[k], sd[k]), k
    assert out["obj"] == sd["obj"]


# -- corrupted data bytes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "fqn, where",
    [
        ("small", "first"),
        ("small", "last"),
        ("big", "first"),
        ("big", "middle"),
        ("big", "last"),
        ("ints", "middle"),
        ("obj.name", "middle"),
    ],
)
def test_flipped_data_byte_is_detected(saved, fqn, where):
    cfg, sd = saved
    assert_loads_ok(cfg, sd)
    _h, doc = read_meta(cfg, "step-5")
    it = item_of(doc, fqn)
    off = {"first": 0, "middle": it["length"] // 2 + 1, "last": it["length"] - 1}[where]
    data_file = data_path(cfg, "step-5", it["file"])
    flip(data_file, it["pos"] + off)
    err = load_fails(cfg, target(), "step-5", ChecksumMismatch)
    msg = str(err)
    assert "step-5" in msg and it["file"] in msg and fqn in msg, msg
    assert "rank 0" in msg, msg
    # the other checkpoints/items are not affected: an undamaged copy still loads
    flip(data_file, it["pos"] + off)
    assert_loads_ok(cfg, sd)


def test_flipped_padding_byte_is_detected(saved):
    """Every byte of a data file is covered: padding after an item is checksummed with it."""
    cfg, sd = saved
    _h, doc = read_meta(cfg, "step-5")
    if not covers_padding(cfg, "step-5", doc):
        pytest.skip("this format does not checksum padding")
    it = item_of(doc, "small")
    assert it["length"] % ALIGN, "the test needs an item followed by padding"
    flip(data_path(cfg, "step-5", it["file"]), it["pos"] + it["length"] + 3)
    err = load_fails(cfg, target(), "step-5", ChecksumMismatch)
    assert "step-5" in str(err) and it["file"] in str(err) and "small" in str(err)


def test_truncated_data_file(saved):
    cfg, _sd = saved
    _h, doc = read_meta(cfg, "step-5")
    (file,) = doc["files"]
    path = data_path(cfg, "step-5", file)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    err = load_fails(cfg, target(), "step-5", CorruptCheckpoint)
    msg = str(err)
    assert "step-5" in msg and file in msg, msg


def test_truncated_data_file_error_names_the_cause(saved):
    cfg, _sd = saved
    _h, doc = read_meta(cfg, "step-5")
    (file,) = doc["files"]
    path = data_path(cfg, "step-5", file)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    err = load_fails(cfg, target(), "step-5", CorruptCheckpoint)
    msg = str(err).replace(str(cfg.local.resolved_path()), "<root>").lower()  # the tmp path names the test
    assert any(w in msg for w in ("truncat", "outside the file", "end of file", "shorter", "bytes)")), str(err)


def test_missing_data_file(saved):
    cfg, _sd = saved
    _h, doc = read_meta(cfg, "step-5")
    (file,) = doc["files"]
    data_path(cfg, "step-5", file).unlink()
    with pytest.raises(BaseException) as ei:
        load(cfg, target(), "step-5")
    err = find_error(ei.value, TierckptError)
    assert err is not None, repr(ei.value)
    assert file in str(err) and "step-5" in str(err)


# -- corrupted / malformed metadata -----------------------------------------------------------


def _refused_metadata(cfg, cid="step-5") -> CorruptCheckpoint:
    r = TieredReader(cfg)
    r.reset(cid)
    with pytest.raises(CorruptCheckpoint) as ei:
        r.read_metadata()
    load_refused_at_metadata(cfg, target(), cid, ei.value)
    return ei.value


@pytest.mark.parametrize("where", ["first", "header_end", "body_start", "body_middle", "last"])
def test_flipped_metadata_byte(saved, where):
    cfg, _sd = saved
    path = ckpt_dir(cfg, "step-5") / "metadata.json"
    raw = path.read_bytes()
    nl = raw.find(b"\n")
    off = {
        "first": 0,
        "header_end": max(nl - 2, 1),
        "body_start": nl + 1,
        "body_middle": (nl + len(raw)) // 2,
        "last": len(raw) - 1,
    }[where]
    flip(path, off)
    err = _refused_metadata(cfg)
    assert "step-5" in str(err) and "metadata" in str(err)


def test_flipped_crc_digit_in_metadata(saved):
    """A bit flip that keeps the JSON valid (a digit of a checksum) is still caught."""
    cfg, _sd = saved
    path = ckpt_dir(cfg, "step-5") / "metadata.json"
    raw = path.read_bytes()
    at = raw.index(b'"crcs":[') + len(b'"crcs":[')
    b = bytearray(raw)
    b[at] = ord("1") if raw[at : at + 1] != b"1" else ord("2")
    path.write_bytes(bytes(b))
    _refused_metadata(cfg)


def test_wrong_item_crc_in_valid_metadata(saved):
    """Metadata whose frame is intact but whose item CRC disagrees with the data: ChecksumMismatch."""
    cfg, _sd = saved
    header, doc = read_meta(cfg, "step-5")
    it = item_of(doc, "big")
    it["crcs"][1] ^= 1
    write_meta(cfg, "step-5", doc, header)
    err = load_fails(cfg, target(), "step-5", ChecksumMismatch)
    assert "big" in str(err) and it["file"] in str(err) and "step-5" in str(err)


@pytest.mark.parametrize("cut", [0, 1, 10, -1, -10])
def test_truncated_metadata(saved, cut):
    cfg, _sd = saved
    path = ckpt_dir(cfg, "step-5") / "metadata.json"
    raw = path.read_bytes()
    path.write_bytes(raw[:cut] if cut > 0 else raw[: len(raw) + cut] if cut else b"")
    _refused_metadata(cfg)


def test_plain_json_without_frame_is_refused(saved):
    cfg, _sd = saved
    header, doc = read_meta(cfg, "step-5")
    if header is None:
        pytest.skip("this format has no header frame")
    (ckpt_dir(cfg, "step-5") / "metadata.json").write_bytes(json.dumps(doc).encode())
    _refused_metadata(cfg)


def test_metadata_as_pickle_never_runs(saved, tmp_path):
    cfg, _sd = saved
    marker = tmp_path / "pwned-metadata"
    (ckpt_dir(cfg, "step-5") / "metadata.json").write_bytes(pickle.dumps(Evil(str(marker))))
    err = _refused_metadata(cfg)
    assert "step-5" in str(err)
    assert not marker.exists()
    # "latest" also only sees this (newest) checkpoint: refused as well, still nothing runs
    with pytest.raises(BaseException):
        load(cfg, target(), "latest")
    assert not marker.exists()


def test_metadata_as_torch_save_never_runs(saved, tmp_path):
    cfg, _sd = saved
    marker = tmp_path / "pwned-torch"
    buf = io.BytesIO()
    torch.save({"x": Evil(str(marker))}, buf)
    (ckpt_dir(cfg, "step-5") / "metadata.json").write_bytes(buf.getvalue())
    _refused_metadata(cfg)
    assert not marker.exists()


def _mut_file_outside(doc):
    item_of(doc, "small")["file"] = "../../etc/passwd"


def _mut_file_outside_listed(doc):
    doc["files"]["../../etc/passwd"] = 10**6
    item_of(doc, "small")["file"] = "../../etc/passwd"


def _mut_absolute_file(doc):
    doc["files"]["/etc/passwd"] = 10**6
    item_of(doc, "small")["file"] = "/etc/passwd"


def _mut_past_end(doc):
    it = item_of(doc, "big")
    it["pos"] = doc["files"][it["file"]] - 64


def _mut_huge_pos(doc):
    item_of(doc, "ints")["pos"] = 1 << 61


def _mut_negative_pos(doc):
    item_of(doc, "ints")["pos"] = -64


def _mut_length_mismatch(doc):
    item_of(doc, "ints")["length"] = 400


def _mut_shape_mismatch(doc):
    item_of(doc, "small")["shape"] = [7, 4]


def _mut_bad_dtype(doc):
    item_of(doc, "small")["dtype"] = "object"


def _mut_bad_sdm_dtype(doc):
    doc["dcp"]["state_dict_metadata"]["small"]["dtype"] = "complex256"


def _mut_wrong_crc_count(doc):
    item_of(doc, "big")["crcs"] = item_of(doc, "big")["crcs"][:1]


def _mut_crc_not_int(doc):
    it = item_of(doc, "small")
    it["crcs"] = ["0"] * len(it["crcs"])


def _mut_other_id(doc):
    doc["checkpoint_id"] = "step-6"


def _mut_traversal_id(doc):
    doc["checkpoint_id"] = "../step-5"


def _mut_format(doc):
    doc["format"] = "tierckpt/999"


def _mut_unknown_key(doc):
    doc["items"][0]["index"][0] = "no.such.key"


def _mut_misaligned(doc):
    it = item_of(doc, "ints")
    it["pos"] += 1


def _mut_items_not_list(doc):
    doc["items"] = {"a": 1}


def _mut_shape_too_long(doc):
    item_of(doc, "small")["shape"] = [1] * 100


def _mut_files_not_dict(doc):
    doc["files"] = ["x"]


def _mut_chunk_size_zero(doc):
    doc["chunk_size"] = 0


def _mut_deep_planner_data(doc):
    x: object = 1
    for _ in range(200):
        x = [x]
    doc["dcp"]["planner_data"] = x


HOSTILE = [v for k, v in sorted(globals().items()) if k.startswith("_mut_")]


@pytest.mark.parametrize("mutate", HOSTILE, ids=[f.__name__[5:] for f in HOSTILE])
def test_hostile_metadata_is_refused(saved, mutate):
    cfg, _sd = saved
    header, doc = read_meta(cfg, "step-5")
    mutate(doc)
    write_meta(cfg, "step-5", doc, header)
    r = TieredReader(cfg)
    r.reset("step-5")
    with pytest.raises(CorruptCheckpoint) as ei:
        r.read_metadata()
    assert "step-5" in str(ei.value) or "metadata" in str(ei.value)
    load_refused_at_metadata(cfg, target(), "step-5", ei.value)


def test_paths_outside_the_checkpoint_are_never_read(saved, tmp_path):
    """A decoy with exactly the right bytes sits where an escaping file name points: still refused."""
    cfg, sd = saved
    header, doc = read_meta(cfg, "step-5")
    (file,) = doc["files"]
    real = data_path(cfg, "step-5", file)
    escaping = f"../../decoy/{file}"  # relative to the directory the data file is in
    decoy_dir = (real.parent / "../../decoy").resolve()
    decoy_dir.mkdir()
    shutil.copyfile(real, decoy_dir / file)
    doc["files"] = {escaping: doc["files"][file]}
    for it in doc["items"]:
        it["file"] = escaping
    write_meta(cfg, "step-5", doc, header)
    real.unlink()
    _refused_metadata(cfg)
    # and an absolute path
    doc["files"] = {str(decoy_dir / file): doc["files"][escaping]}
    for it in doc["items"]:
        it["file"] = str(decoy_dir / file)
    write_meta(cfg, "step-5", doc, header)
    _refused_metadata(cfg)


def test_metadata_copied_under_another_id_is_refused(saved):
    cfg, _sd = saved
    shutil.copytree(ckpt_dir(cfg, "step-5"), ckpt_dir(cfg, "step-6"))
    err = _refused_metadata(cfg, "step-6")
    assert "step-6" in str(err) and "step-5" in str(err)


def test_unknown_checkpoint(saved):
    cfg, _sd = saved
    r = TieredReader(cfg)
    r.reset("step-404")
    with pytest.raises(CheckpointNotFound):
        r.read_metadata()
    with pytest.raises(BaseException) as ei:
        load(cfg, target(), "step-404")
    assert "step-404" in str(ei.value)


# "/etc" and "a/b" are path-style ids since issue 14 (ids "etc" and "b"); a "." or ".." component is refused.
# Issue 33: one class for a bad id (InvalidCheckpointId, never the CorruptCheckpoint a resume loop falls
# back on), the documented characters only (no ',', ' ', ':'), the whole string (no trailing newline).
@pytest.mark.parametrize(
    "cid",
    [
        "../step-5",
        "step-5/../../x",
        ".hidden",
        "",
        "latest/..",
        "a/./b",
        "/ckpt/..",
        "step 1",
        "a:b",
        "a,b",
        "step-1\n",
    ],
)
def test_invalid_checkpoint_ids_are_rejected(saved, cid):
    cfg, _sd = saved
    root = cfg.local.resolved_path()
    before = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    with pytest.raises(BaseException) as ei:
        load(cfg, target(), cid)
    assert find_error(ei.value, TierckptError) is not None or not TieredReader.validate_checkpoint_id(cid)
    r = TieredReader(cfg)
    with pytest.raises(InvalidCheckpointId) as bad:
        r.reset(cid)
    assert not isinstance(bad.value, CorruptCheckpoint) and isinstance(bad.value, ValueError)
    with pytest.raises(BaseException) as es:
        save(cfg, {"x": torch.ones(1)}, cid)
    assert find_error(es.value, InvalidCheckpointId) is not None, es.value
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == before


# -- pickles in non-tensor items ----------------------------------------------------------------


def _replace_bytes_item(cfg, cid: str, fqn: str, payload: bytes) -> None:
    """Point ``fqn`` at ``payload``, appended to its data file, with correct CRCs and frame."""
    header, doc = read_meta(cfg, cid)
    pad_crcs = covers_padding(cfg, cid, doc)
    it = item_of(doc, fqn)
    assert it["dtype"] == "", "only for non-tensor items"
    path = data_path(cfg, cid, it["file"])
    data = bytearray(path.read_bytes())
    assert len(data) % ALIGN == 0
    pos = len(data)
    data += payload + bytes(padded(len(payload)) - len(payload))
    path.write_bytes(bytes(data))
    it["pos"], it["length"] = pos, len(payload)
    it["crcs"] = crc_pieces(bytes(data), pos, len(payload), doc["chunk_size"], pad_crcs)
    doc["files"][it["file"]] = len(data)
    write_meta(cfg, cid, doc, header)


def test_crafted_item_helper_is_faithful(saved):
    """Sanity check of the crafting helper: a benign replacement payload loads."""
    cfg, _sd = saved
    buf = io.BytesIO()
    torch.save("replaced", buf)
    _replace_bytes_item(cfg, "step-5", "obj.name", buf.getvalue())
    out = target()
    load(cfg, out, "step-5")
    assert out["obj"]["name"] == "replaced"


def test_malicious_item_pickle_is_refused(saved, tmp_path):
    cfg, _sd = saved
    marker = tmp_path / "pwned-item"
    buf = io.BytesIO()
    torch.save(Evil(str(marker)), buf)
    _replace_bytes_item(cfg, "step-5", "obj.name", buf.getvalue())
    err = load_fails(cfg, target(), "step-5", CorruptCheckpoint)
    assert "obj.name" in str(err) and "step-5" in str(err)
    assert "allow_pickle" in str(err) or "weights_only" in str(err)
    assert not marker.exists()


def test_malicious_raw_pickle_item_is_refused(saved, tmp_path):
    """Not even a torch.save container: a bare pickle stream."""
    cfg, _sd = saved
    marker = tmp_path / "pwned-raw"
    _replace_bytes_item(cfg, "step-5", "obj.lr", pickle.dumps(Evil(str(marker)), protocol=2))
    load_fails(cfg, target(), "step-5", CorruptCheckpoint)
    assert not marker.exists()


def test_custom_class_needs_allow_pickle(tmp_path):
    cfg = make_cfg(tmp_path)
    obj = Benign(42, "hello")
    save(cfg, {"t": torch.arange(3.0), "custom": obj, "plain": {"a": 1}}, "step-1")

    out = {"t": torch.zeros(3), "custom": None, "plain": {"a": None}}
    err = load_fails(cfg, out, "step-1", CorruptCheckpoint)
    assert "custom" in str(err) and "allow_pickle" in str(err)

    out = {"t": torch.zeros(3), "custom": None, "plain": {"a": None}}
    load(cfg, out, "step-1", allow_pickle=True)
    assert out["custom"] == obj and out["plain"] == {"a": 1}
    assert torch.equal(out["t"], torch.arange(3.0))

    # plain Python objects never need allow_pickle
    out = {"t": torch.zeros(3), "plain": {"a": None}}
    load(cfg, out, "step-1")
    assert out["plain"] == {"a": 1}


def test_corruption_names_the_writing_rank(tmp_path):
    """Two ranks save; rank 1's file is damaged; the error names rank 1, its file and the item."""
    from dist_scenarios import placeholder, rank_state
    from distrun import run_world

    cfg = make_cfg(tmp_path)
    conf = {
        "host": {"buffer_size": "2MiB", "chunk_size": "256KiB"},
        "local": {"path": cfg.local.path, "fsync": False, "keep": 0},
    }
    res = run_world(2, "save_load_exact", {"config": conf, "id": "step-1"}, tmp_path / "w")
    assert all(r["mismatches"] == [] for r in res), res
    _h, doc = read_meta(cfg, "step-1")
    it = item_of(doc, "r1.f32")
    assert it["file"].startswith("rank-00001")
    flip(data_path(cfg, "step-1", it["file"]), it["pos"] + 5)
    # rank 0's items still load
    expected0 = {"r0": rank_state(0, 0)}
    out0 = placeholder(expected0)
    load(cfg, out0, "step-1")
    assert torch.equal(out0["r0"]["f32"].view(torch.uint8), expected0["r0"]["f32"].view(torch.uint8))
    err = load_fails(cfg, placeholder({"r1": rank_state(1, 0)}), "step-1", ChecksumMismatch)
    msg = str(err)
    assert "rank 1" in msg and "r1.f32" in msg and it["file"] in msg and "step-1" in msg, msg


def test_crc32c_is_castagnoli_on_any_buffer() -> None:
    """The checksum every file, part and metadata body carries: CRC-32C (the standard check
    value), continued across calls, the same on bytes, memoryviews of any format and numpy views."""
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(b"456789", crc32c(b"123")) == 0xE3069283
    t = torch.arange(1 << 16, dtype=torch.float32)
    raw = t.numpy().tobytes()
    want = crc32c(raw)
    assert crc32c(memoryview(t.numpy())) == want  # format "f", no copy
    assert crc32c(np.frombuffer(bytearray(raw), dtype=np.uint8)) == want
    assert crc32c(memoryview(bytearray(raw))[100:], crc32c(raw[:100])) == want
