"""Single-process round trips through TieredWriter/TieredReader (``no_dist=True``).

Every comparison is bit-exact: ``torch.equal`` where values allow it, and always the raw bytes
(``.view(torch.uint8)``), so that NaN payloads, signed zeros and subnormals must survive too.
"""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt import (
    CheckpointNotFound,
    CommitConflict,
    HostConfig,
    LocalConfig,
    TierckptError,
    TierConfig,
    TieredReader,
    TieredWriter,
)
from tierckpt.testing import bits as random_bits  # random_bits(shape, dtype, generator)
from tierckpt.testing import find_error, raw

MiB = 1 << 20

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# -- helpers --------------------------------------------------------------------------------


def make_cfg(
    tmp_path, *, keep: int = 0, fsync: bool = False, buffer_size: int = 8 * MiB, chunk_size: int = 1 * MiB
) -> TierConfig:
    return TierConfig(
        host=HostConfig(buffer_size=buffer_size, chunk_size=chunk_size),
        local=LocalConfig(path=str(tmp_path / "ckpt"), keep=keep, fsync=fsync),
    )


def save(cfg, sd, cid=None, writer=None) -> TieredWriter:
    w = writer or TieredWriter(cfg)
    if cid is None:
        dcp.save(sd, storage_writer=w, no_dist=True)
    else:
        dcp.save(sd, checkpoint_id=cid, storage_writer=w, no_dist=True)
    w.wait()
    return w


def load(cfg, sd, cid="latest", **kw) -> TieredReader:
    r = TieredReader(cfg, **kw)
    dcp.load(sd, checkpoint_id=cid, storage_reader=r, no_dist=True)
    return r


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype, what
    assert a.shape == b.shape, what
    assert torch.equal(raw(a), raw(b)), f"{what}: bytes differ"


def committed_ids(cfg) -> set[str]:
    root = cfg.local.resolved_path()
    return {p.name for p in root.iterdir() if (p / "metadata.json").is_file()}


@pytest.fixture
def cfg(tmp_path):
    return make_cfg(tmp_path)


# -- dtypes -----------------------------------------------------------------------------------

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BIT_DTYPES = FLOAT_DTYPES + [torch.complex64, torch.complex128]


def test_dtypes_bit_exact(cfg):
    g = torch.Generator().manual_seed(1)
    sd: dict[str, torch.Tensor] = {}
    for dt in FLOAT_DTYPES:
        name = str(dt).removeprefix("torch.")
        sd[f"{name}_values"] = torch.randn(37, 11, generator=g).to(dt)
        sd[f"{name}_bits"] = random_bits((129, 7), dt, g)
    for dt in (torch.complex64, torch.complex128):
        name = str(dt).removeprefix("torch.")
        sd[f"{name}_values"] = torch.randn(33, 5, dtype=dt, generator=g)
        sd[f"{name}_bits"] = random_bits((65, 3), dt, g)
    sd["int8"] = torch.randint(-128, 128, (301,), dtype=torch.int8, generator=g)
    sd["uint8"] = torch.randint(0, 256, (17, 19), dtype=torch.uint8, generator=g)
    sd["int64"] = torch.randint(-(2**62), 2**62, (5, 7), dtype=torch.int64, generator=g)
    sd["int64_extremes"] = torch.tensor([-(2**63), 2**63 - 1, 0, -1], dtype=torch.int64)
    sd["int32"] = torch.randint(-(2**31), 2**31 - 1, (99,), dtype=torch.int32, generator=g)
    sd["bool"] = torch.rand(257, generator=g) > 0.5
    # explicit special values, including a non-canonical NaN payload
    sd["specials"] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45])
    sd["nan_payload"] = torch.tensor([0x7FC00001, -1, 0x7F800001], dtype=torch.int32).view(torch.float32)
    save(cfg, sd, "step-1")

    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(cfg, out, "step-1")
    for k, v in sd.items():
        assert_bits_equal(v, out[k], k)
        if not (v.is_floating_point() or v.is_complex()) or not torch.isnan(v).any():
            assert torch.equal(v, out[k]), k
    assert torch.isnan(out["nan_payload"]).all()


def test_zero_dim_and_empty(cfg):
    sd = {
        "scalar_f": torch.tensor(3.25),
        "scalar_i": torch.tensor(-7, dtype=torch.int64),
        "scalar_b": torch.tensor(True),
        "scalar_bf16": torch.tensor(1.5, dtype=torch.bfloat16),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(0, 5, dtype=torch.float16),
        "empty_mid": torch.empty(3, 0, 4, dtype=torch.int64),
        "after": torch.arange(10, dtype=torch.int32),
    }
    save(cfg, sd, "step-1")
    out = {k: (torch.zeros_like(v) if v.numel() else torch.empty_like(v)) for k, v in sd.items()}
    load(cfg, out, "step-1")
    for k, v in sd.items():
        assert out[k].shape == v.shape, k
        assert_bits_equal(v, out[k], k)
        assert torch.equal(v, out[k]), k


def test_only_empty_tensors(cfg):
    """A state dict with nothing but numel-0 tensors still commits and loads."""
    sd = {"e": torch.empty(0), "f": torch.empty(2, 0, dtype=torch.int8)}
    save(cfg, sd, "step-1")
    assert "step-1" in committed_ids(cfg)
    out = {"e": torch.ones(0), "f": torch.ones(2, 0, dtype=torch.int8)}
    load(cfg, out, "step-1")
    assert out["e"].shape == (0,) and out["f"].shape == (2, 0)


def test_non_contiguous_sources_and_targets(cfg):
    g = torch.Generator().manual_seed(2)
    base = torch.randn(300, 200, generator=g)
    sd = {
        "transposed": base.t(),
        "step_rows": base[::3],
        "step_cols": base[:, 1::4],
        "expanded": torch.arange(6.0).reshape(1, 6).expand(4, 6),
        "permuted": torch.randn(4, 5, 6, generator=g).permute(2, 0, 1),
        "bf16_strided": base.to(torch.bfloat16)[::7, ::5],
    }
    for v in sd.values():
        assert not v.is_contiguous()
    expected = {k: v.clone() for k, v in sd.items()}
    save(cfg, sd, "step-1")

    # contiguous destinations
    out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    load(cfg, out, "step-1")
    for k, v in expected.items():
        assert torch.equal(v, out[k]), k
        assert_bits_equal(v, out[k], k)

    # non-contiguous destinations: loaded in place into the strided views
    holders = {k: torch.zeros(tuple(reversed(v.shape)), dtype=v.dtype) for k, v in expected.items()}
    out2 = {k: holders[k].permute(*reversed(range(v.dim()))) for k, v in expected.items()}
    for k, v in out2.items():
        assert v.shape == expected[k].shape
    load(cfg, out2, "step-1")
    for k, v in expected.items():
        assert torch.equal(v, out2[k]), k
        assert torch.equal(holders[k], v.permute(*reversed(range(v.dim())))), k


def test_larger_than_chunk_and_pool(cfg):
    g = torch.Generator().manual_seed(3)
    sd = {
        "small": torch.randn(10, generator=g),
        "chunk_and_a_half": random_bits((3 * MiB // 2 // 4,), torch.float32, g),  # 1.5 MiB
        "odd_size": random_bits((MiB + 13,), torch.uint8, g),  # crosses a chunk at an odd offset
        "huge": random_bits((5 * MiB + 3,), torch.float32, g),  # ~20 MiB: larger than the 8 MiB pool
        "tail": torch.arange(5, dtype=torch.int16),
    }
    w = save(cfg, sd, "step-1")
    assert w.stats is not None and w.stats.bytes >= 20 * MiB
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(cfg, out, "step-1")
    for k, v in sd.items():
        assert_bits_equal(v, out[k], k)
    # also into scratch (dtype-mismatched layout forces a non-direct read): non-contiguous target
    holder = torch.zeros(2, sd["huge"].numel(), dtype=torch.float32)
    out2 = {"huge": holder[0]}
    load(cfg, out2, "step-1")
    assert_bits_equal(sd["huge"], holder[0], "huge")
    assert torch.count_nonzero(holder[1]) == 0


def test_large_python_object_spans_chunks(cfg):
    """A non-tensor item larger than a chunk (and a bytes payload with every byte value)."""
    blob = bytes(range(256)) * (3 * MiB // 256 + 7)
    text = "ünïcode-" * 200_000  # ~1.8 MB of UTF-8
    save(cfg, {"blob": blob, "text": text, "t": torch.arange(3)}, "step-1")
    out = {"blob": None, "text": None, "t": torch.zeros(3, dtype=torch.int64)}
    load(cfg, out, "step-1")
    assert out["blob"] == blob and out["text"] == text


def test_reader_with_another_chunk_size(tmp_path):
    """The reader follows the chunk grid recorded in the checkpoint, not its own configuration."""
    g = torch.Generator().manual_seed(11)
    sd = {"w": random_bits((3 * MiB // 4 + 11,), torch.float32, g), "o": "x"}
    save(make_cfg(tmp_path, chunk_size=1 * MiB), sd, "step-1")
    other = make_cfg(tmp_path, buffer_size=2 * MiB, chunk_size=64 << 10)
    out = {"w": torch.zeros_like(sd["w"]), "o": None}
    load(other, out, "step-1")
    assert_bits_equal(sd["w"], out["w"], "w")


@pytest.mark.parametrize("cid", ["step-000100", "a.b_c-d=e+f@g", "X" * 200, "7"])
def test_unusual_but_valid_ids(cfg, cid):
    save(cfg, {"x": torch.arange(4.0), "id": cid}, cid)
    assert committed_ids(cfg) == {cid}
    out = {"x": torch.zeros(4), "id": None}
    r = load(cfg, out, "latest")
    assert r.resolved_id == cid and out["id"] == cid and torch.equal(out["x"], torch.arange(4.0))


def test_nested_dicts_with_python_objects(cfg):
    g = torch.Generator().manual_seed(4)
    sd = {
        "model": {"layer": {"w": torch.randn(5, 3, generator=g), "b": torch.randn(5, generator=g)}},
        "meta": {
            "step": 1234,
            "name": "run-ä-✓",
            "ratio": 0.125,
            "flag": True,
            "nothing": None,
            "list": [1, "two", 3.0, [4, 5]],
            "tuple": (1, ("a", "b"), 2),
            "nested": {"deep": {"deeper": {"x": 1, "y": "z"}}},
            "big_int": 2**80,
        },
        "mixed_list": [torch.arange(4), "label", 7],
        "top": "string at the top",
    }
    expected_w = sd["model"]["layer"]["w"].clone()
    save(cfg, sd, "step-1")

    out = {
        "model": {"layer": {"w": torch.zeros(5, 3), "b": torch.zeros(5)}},
        "meta": {
            "step": 0,
            "name": "",
            "ratio": 0.0,
            "flag": False,
            "nothing": 0,
            "list": None,
            "tuple": None,
            "nested": {"deep": {"deeper": {"x": None, "y": None}}},
            "big_int": 0,
        },
        "mixed_list": [torch.zeros(4, dtype=torch.int64), None, None],
        "top": None,
    }
    load(cfg, out, "step-1")
    assert torch.equal(out["model"]["layer"]["w"], expected_w)
    assert torch.equal(out["model"]["layer"]["b"], sd["model"]["layer"]["b"])
    assert out["meta"] == sd["meta"]
    assert type(out["meta"]["tuple"]) is tuple and type(out["meta"]["tuple"][1]) is tuple
    assert type(out["meta"]["list"]) is list
    assert torch.equal(out["mixed_list"][0], torch.arange(4))
    assert out["mixed_list"][1:] == ["label", 7]
    assert out["top"] == "string at the top"


def test_model_and_optimizer_state(cfg):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build(seed: int):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )
        o = torch.optim.Adam(m.parameters(), lr=1e-3 * seed)
        return m, o

    m, o = build(1)
    m(torch.randn(3, 8)).pow(2).sum().backward()
    o.step()
    msd, osd = get_state_dict(m, o)
    save(cfg, {"model": msd, "optim": osd, "step": 1}, "step-1")

    m2, o2 = build(2)
    msd2, osd2 = get_state_dict(m2, o2)
    target = {"model": msd2, "optim": osd2, "step": 0}
    load(cfg, target, "step-1")
    set_state_dict(m2, o2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    assert target["step"] == 1

    for (k, a), (k2, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert k == k2
        assert_bits_equal(a, b, k)
    s1, s2 = o.state_dict(), o2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    for p in s1["state"]:
        for name, v in s1["state"][p].items():
            assert_bits_equal(v, s2["state"][p][name], f"state[{p}][{name}]")

    # the restored pair keeps training identically
    x = torch.randn(3, 8)
    for mm, oo in ((m, o), (m2, o2)):
        oo.zero_grad()
        mm(x).pow(2).sum().backward()
        oo.step()
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_plain_module_state_dict(cfg):
    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    m.train()
    m(torch.randn(8, 4))  # updates running stats and num_batches_tracked (int64, 0-d)
    save(cfg, {"model": m.state_dict()}, "step-1")
    torch.manual_seed(6)
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    target = {"model": m2.state_dict()}
    load(cfg, target, "step-1")
    m2.load_state_dict(target["model"])
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert_bits_equal(a, b, k)


# -- ids, latest, conflicts, retention ------------------------------------------------------


def test_latest_resolves_to_newest_committed(cfg):
    for i in (1, 2, 3):
        save(cfg, {"x": torch.full((4,), float(i)), "i": i}, f"step-{i}")
    out = {"x": torch.zeros(4), "i": 0}
    r = load(cfg, out, "latest")
    assert out["i"] == 3 and torch.equal(out["x"], torch.full((4,), 3.0))
    assert r.resolved_id == "step-3"
    # an explicit older id is still loadable
    out = {"x": torch.zeros(4), "i": 0}
    load(cfg, out, "step-1")
    assert out["i"] == 1 and torch.equal(out["x"], torch.ones(4))
    # "latest" means the newest *commit*, not the largest step number
    save(cfg, {"x": torch.full((4,), 0.5), "i": 0}, "step-0")
    out = {"x": torch.zeros(4), "i": -1}
    r = load(cfg, out, "latest")
    assert r.resolved_id == "step-0" and out["i"] == 0


def test_latest_without_any_checkpoint(cfg):
    r = TieredReader(cfg)
    with pytest.raises(CheckpointNotFound):  # resolved when the load starts (not distributed)
        r.reset("latest")
    # raised by the reader's reset, before DCP's metadata exchange: the typed error itself, once
    with pytest.raises(CheckpointNotFound, match="no committed checkpoint on any tier"):
        load(cfg, {"x": torch.zeros(2)}, "latest")


def test_generated_ids_are_fresh(cfg):
    w = TieredWriter(cfg)
    save(cfg, {"x": torch.ones(3), "n": 1}, writer=w)
    first = committed_ids(cfg)
    assert len(first) == 1
    save(cfg, {"x": torch.full((3,), 2.0), "n": 2}, writer=w)
    both = committed_ids(cfg)
    assert len(both) == 2 and first < both
    # an explicit id, then again no id: the explicit id must not be reused
    save(cfg, {"x": torch.full((3,), 3.0), "n": 3}, "step-3", writer=w)
    save(cfg, {"x": torch.full((3,), 4.0), "n": 4}, writer=w)
    ids = committed_ids(cfg)
    assert len(ids) == 4 and "step-3" in ids
    (newest,) = ids - both - {"step-3"}
    out = {"x": torch.zeros(3), "n": 0}
    r = load(cfg, out, "latest")
    assert r.resolved_id == newest and out["n"] == 4
    for cid in ids:
        out = {"x": torch.zeros(3), "n": 0}
        load(cfg, out, cid)
        assert torch.equal(out["x"], torch.full((3,), float(out["n"])))


def test_existing_id_conflicts_and_stays_intact(cfg):
    g = torch.Generator().manual_seed(7)
    original = {"w": random_bits((1000,), torch.float32, g), "tag": "first"}
    keep = {"w": original["w"].clone(), "tag": "first"}
    save(cfg, original, "step-1")
    w = TieredWriter(cfg)
    with pytest.raises(BaseException) as ei:
        save(cfg, {"w": torch.zeros(1000), "tag": "second"}, "step-1", writer=w)
    err = find_error(ei.value, CommitConflict)
    assert err is not None, repr(ei.value)
    assert isinstance(err, TierckptError)
    assert "step-1" in str(err)
    out = {"w": torch.zeros(1000), "tag": None}
    load(cfg, out, "step-1")
    assert out["tag"] == "first"
    assert_bits_equal(keep["w"], out["w"], "w")
    # the writer is still usable afterwards
    save(cfg, {"w": torch.ones(1000), "tag": "third"}, "step-2", writer=w)
    out = {"w": torch.zeros(1000), "tag": None}
    load(cfg, out, "latest")
    assert out["tag"] == "third"


def _two_saves_same_id(cfg):
    g = torch.Generator().manual_seed(8)
    a = {"w": random_bits((3 * MiB,), torch.float32, g), "tag": "a"}  # 12 MiB: capture still pending
    a_copy = a["w"].clone()
    w1, w2 = TieredWriter(cfg), TieredWriter(cfg)
    dcp.save(a, checkpoint_id="step-1", storage_writer=w1, no_dist=True)
    sync_error = None
    try:
        dcp.save({"w": torch.zeros(3 * MiB), "tag": "b"}, checkpoint_id="step-1", storage_writer=w2, no_dist=True)
    except BaseException as e:  # noqa: BLE001 - the conflict may surface synchronously
        sync_error = e
    return w1, w2, a_copy, sync_error


def test_same_id_in_flight_twice_first_wins(cfg):
    """Two saves of one id without waiting in between: the first commits, its data stays intact."""
    w1, w2, a_copy, sync_error = _two_saves_same_id(cfg)
    errors = [sync_error] if sync_error is not None else []
    for w in (w1, w2, w1):
        try:
            w.wait()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    for e in errors:  # whatever surfaced is the conflict, nothing else
        assert find_error(e, CommitConflict) is not None, repr(e)
    out = {"w": torch.zeros(3 * MiB), "tag": None}
    load(cfg, out, "step-1")
    assert out["tag"] == "a"
    assert_bits_equal(a_copy, out["w"], "w")


def test_same_id_in_flight_twice_loser_wait_raises(tmp_path):
    """wait() returning normally must mean: committed. The losing save must raise CommitConflict."""
    for attempt in range(4):  # the failure mode is a race: give it a few chances to show
        cfg = make_cfg(tmp_path / f"try{attempt}")
        w1, w2, _a_copy, sync_error = _two_saves_same_id(cfg)
        if sync_error is not None:
            assert find_error(sync_error, CommitConflict) is not None, repr(sync_error)
        else:
            with pytest.raises(CommitConflict):
                w2.wait()
        for w in (w1, w2):  # no background work outlives the test (it would log into a closed capture)
            with contextlib.suppress(CommitConflict):
                w.wait()


def test_retention_keep_two(tmp_path):
    cfg = make_cfg(tmp_path, keep=2)
    for i in range(1, 5):
        save(cfg, {"x": torch.full((1000,), float(i)), "i": i}, f"step-{i}")
    root = cfg.local.resolved_path()
    assert committed_ids(cfg) == {"step-3", "step-4"}
    # nothing of the deleted checkpoints is left anywhere under the tier root
    left = [p.relative_to(root).as_posix() for p in root.rglob("*")]
    assert not [p for p in left if "step-1" in p or "step-2" in p], left
    assert [p for p in left if p.endswith(".data")], left
    for i in (3, 4):
        out = {"x": torch.zeros(1000), "i": 0}
        load(cfg, out, f"step-{i}")
        assert out["i"] == i and torch.equal(out["x"], torch.full((1000,), float(i)))


def test_fresh_writer_per_save(tmp_path):
    cfg = make_cfg(tmp_path, keep=0, fsync=True)
    g = torch.Generator().manual_seed(9)
    saved = {}
    for i in range(1, 4):
        sd = {"w": torch.randn(200, 300, generator=g), "i": i}
        saved[i] = sd["w"].clone()
        w = TieredWriter(cfg)
        dcp.save(sd, checkpoint_id=f"step-{i}", storage_writer=w, no_dist=True)
        w.wait()
        assert w.stats is not None and w.stats.checkpoint_id == f"step-{i}"
    assert committed_ids(cfg) == {"step-1", "step-2", "step-3"}
    for i, t in saved.items():
        out = {"w": torch.zeros(200, 300), "i": 0}
        load(cfg, out, f"step-{i}")
        assert out["i"] == i
        assert_bits_equal(t, out["w"], f"step-{i}")


def test_metadata_is_json_with_item_records(cfg):
    sd = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "obj": {"k": "v"}}
    save(cfg, sd, "step-7")
    raw = (cfg.local.resolved_path() / "step-7" / "metadata.json").read_bytes()
    head, sep, body = raw.partition(b"\n")  # an optional header line frames the JSON body
    doc = json.loads(body if sep and body.strip() else raw)
    assert doc["checkpoint_id"] == "step-7" and doc["step"] == 7 and doc["world_size"] == 1
    items = {it["index"][0]: it for it in doc["items"]}
    assert items["a"]["dtype"] == "float32" and items["a"]["shape"] == [3, 4] and items["a"]["length"] == 48
    assert items["obj.k"]["dtype"] == ""
    for it in doc["items"]:
        assert it["pos"] % 64 == 0
        assert it["file"] in doc["files"]
