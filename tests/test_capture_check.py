"""Issue 35, capture side: the non-finite guard (``[job] nonfinite``) and the source digest
(``[job] verify_capture``), on real saves to a real local tier.

Faults are injected where the issue names them: the source tensor changed after the capture
started (behind its version counter's back, as a stray kernel or a bad DMA would), and the host
buffer changed after the copy and before the CRC32C (a flip in the pinned buffer). The injection
wraps the engine's copier (the seam between the source and the host buffer); nothing of the
check itself is mocked. Each must fail the checkpoint (never committed) and surface at the next
``wait_captured``/``wait``/``dcp.save``.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierckpt
from tierckpt import HostConfig, JobConfig, LocalConfig, TierConfig, TieredReader, TieredWriter
from tierckpt.capture.verify import word_digest
from tierckpt.chain.engine import close_all, get_engine
from tierckpt.errors import CaptureError, CaptureMismatch, ConfigError, NonFiniteError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "assuming no_dist" in one process

MiB = 1 << 20


def make_cfg(tmp_path: Path, **job) -> TierConfig:
    return TierConfig(
        host=HostConfig(buffer_size=4 * MiB, chunk_size=64 * 1024),
        local=LocalConfig(path=str(tmp_path / "local"), keep=0, fsync=False),
        job=JobConfig(commit_timeout=30, **job),
    )


@pytest.fixture(autouse=True)
def _close():
    yield
    close_all()


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 1000, generator=g),  # ~1.2 MB: spans many 64 KiB chunks
        "h": torch.randn(77, generator=g).to(torch.bfloat16),
        "ids": torch.arange(13, dtype=torch.int16),  # not floating: never scanned
        "odd": torch.ones(5, dtype=torch.uint8),  # a tail shorter than a word
        "step": seed,
    }


def items_of(tmp_path: Path, cid: str) -> list[dict]:
    raw = (tmp_path / "local" / cid / "metadata.json").read_bytes()
    return json.loads(raw.partition(b"\n")[2])["items"]


def save(cfg: TierConfig, sd: dict, cid: str) -> TieredWriter:
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id=cid, storage_writer=w)
    return w


# -- the digest ------------------------------------------------------------------------------


def test_digest_is_additive_over_aligned_pieces_and_sees_every_bit_flip() -> None:
    data = torch.randint(0, 256, (4096 + 5,), dtype=torch.uint8)
    whole = int(word_digest(data))
    parts = int(word_digest(data[:1024])) + int(word_digest(data[1024:4096])) + int(word_digest(data[4096:]))
    assert (whole - parts) % (1 << 64) == 0
    for pos in (0, 7, 1000, 4095, 4099):
        for bit in (0, 3, 7):
            flipped = data.clone()
            flipped[pos] ^= 1 << bit
            assert (int(word_digest(flipped)) - whole) % (1 << 64) != 0
    # a view at an odd offset digests the same bytes the same way
    assert int(word_digest(data[1:])) == int(word_digest(data[1:].clone()))


def test_config_values_are_validated() -> None:
    for bad in (
        {"nonfinite": "maybe"},
        {"verify_capture": "some"},
        {"on_resume_check": "no colon"},
        {"max_rollbacks": -1},
    ):
        with pytest.raises(ConfigError):
            JobConfig(**bad).validate()
    JobConfig(nonfinite="refuse", verify_capture="sample", on_resume_check="pkg.mod:fn", max_rollbacks=2).validate()


# -- non-finite ------------------------------------------------------------------------------


def test_counts_are_recorded_per_item_and_old_style_metadata_still_loads(tmp_path: Path, caplog) -> None:
    cfg = make_cfg(tmp_path, nonfinite="warn", verify_capture="all")
    sd = state(1)
    sd["w"][10, 20] = float("nan")
    sd["w"][299, 999] = float("inf")
    sd["h"][3] = float("-inf")
    w = save(cfg, sd, "step-1")
    w.wait()
    counts = {it["index"][0]: it.get("nonfinite") for it in items_of(tmp_path, "step-1")}
    assert counts["w"] == 2 and counts["h"] == 1
    assert counts["ids"] is None and counts["odd"] is None  # not floating: not scanned
    assert "NaN/Inf values in 2 tensor(s)" in caplog.text
    assert w.stats is not None and w.stats.verify_cpu_s > 0
    # off (the default): nothing recorded, exactly as before the scan existed; both load
    cfg2 = make_cfg(tmp_path)
    close_all()
    w = save(cfg2, state(2), "step-2")
    w.wait()
    assert all("nonfinite" not in it for it in items_of(tmp_path, "step-2"))
    for cid, seed in (("step-1", 1), ("step-2", 2)):
        out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state(seed).items()}
        dcp.load(out, checkpoint_id=cid, storage_reader=TieredReader(cfg2))
        assert torch.equal(out["ids"], state(seed)["ids"])


def test_refuse_with_a_nan_planted_mid_run(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, nonfinite="refuse", verify_capture="sample")
    sd = state(1)
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id="step-1", storage_writer=w)
    w.wait_captured()
    sd["w"].mul_(1.01)
    dcp.save(sd, checkpoint_id="step-2", storage_writer=w)
    w.wait_captured()
    sd["w"][150, 500] = float("nan")  # the loss spiked: the model diverged
    dcp.save(sd, checkpoint_id="step-3", storage_writer=w)
    with pytest.raises(NonFiniteError, match=r"step-3.*'w' holds 1 NaN/Inf"):
        w.wait_captured()  # the pre-step after the save is told
    sd["w"][150, 500] = 0.0  # rolled back / skipped the batch
    dcp.save(sd, checkpoint_id="step-4", storage_writer=w)
    w.wait()
    assert not (tmp_path / "local" / "step-3" / "metadata.json").exists()
    assert [c.id for c in tierckpt.list_checkpoints(cfg)] == ["step-1", "step-2", "step-4"]
    assert tierckpt.latest(cfg) == "step-4"


# -- source digest: faults between the source and the CRC --------------------------------------


def _inject(cfg: TierConfig, monkeypatch, fault) -> None:
    copier = get_engine(cfg).stream.copier
    real = copier.copy

    def copy(pieces, slot, ready, probe=None):
        events = real(pieces, slot, ready, lambda src: (probe(src) if probe else None, fault("probed", src, slot)))
        for p in pieces:
            fault("copied", p, slot)
        return events

    monkeypatch.setattr(copier, "copy", copy)


def test_source_changed_after_the_capture_started_is_caught(tmp_path: Path, monkeypatch) -> None:
    cfg = make_cfg(tmp_path, verify_capture="all")
    sd = state(1)
    w = save(cfg, sd, "step-1")
    w.wait()

    def fault(when, obj, slot):
        # after the source digest, before its bytes are copied: one byte of 'w' changes behind
        # its version counter (a stray kernel), so the torn-capture guard cannot see it
        if when == "probed" and obj.fqn == "w":
            ptr = obj.tensor.data_ptr() + 12345
            ctypes.memset(ptr, ctypes.c_uint8.from_address(ptr).value ^ 0x10, 1)

    _inject(cfg, monkeypatch, fault)
    dcp.save(sd, checkpoint_id="step-2", storage_writer=w)
    with pytest.raises(CaptureMismatch, match=r"step-2.*'w' does not match the digest of its source"):
        w.wait()
    assert tierckpt.latest(cfg) == "step-1"
    assert not (tmp_path / "local" / "step-2" / "metadata.json").exists()


def test_host_buffer_changed_before_the_crc_is_caught(tmp_path: Path, monkeypatch) -> None:
    cfg = make_cfg(tmp_path, verify_capture="all")
    hit = []

    def fault(when, obj, slot):
        if when == "copied" and obj.source.fqn == "h" and not hit:  # a flip in the pinned buffer
            slot[obj.slot_off + 3] ^= 0x04
            hit.append(obj)

    _inject(cfg, monkeypatch, fault)
    w = TieredWriter(cfg)
    dcp.save(state(1), checkpoint_id="step-1", storage_writer=w)
    with pytest.raises(CaptureError, match=r"step-1.*'h' does not match"):
        w.wait()
    assert hit and tierckpt.latest(cfg) is None
    # off: the same flip is sealed by the CRC32C and committed as good data (what the digest adds)
    close_all()
    cfg = make_cfg(tmp_path / "off")
    hit.clear()
    _inject(cfg, monkeypatch, fault)
    w = save(cfg, state(1), "step-1")
    w.wait()
    assert hit and tierckpt.latest(cfg) == "step-1"


def test_sample_checks_a_rotating_eighth_of_the_items() -> None:
    from tierckpt.capture.copier import Piece, Source
    from tierckpt.capture.verify import SAMPLE_EVERY, CaptureCheck

    sources = [Source(item=i, fqn=f"t{i}", pos=i * 64, length=64, tensor=torch.zeros(16)) for i in range(16)]
    chunks = [[Piece(s, 0, s.pos, s.length) for s in sources]]
    seen: set[int] = set()
    for save_no in range(SAMPLE_EVERY):
        check = CaptureCheck("c", 0, sources, chunks, 16, "sample", "ignore", save_no)
        picked = {i for i, it in check.items.items() if it.digest}
        assert len(picked) == 16 // SAMPLE_EVERY
        seen |= picked
    assert seen == set(range(16))  # every item once in eight saves


# -- the fused host pass: CRC32C + digest + NaN/Inf scan, block by block ------------------------


def test_numpy_kernels_agree_with_torch() -> None:
    from tierckpt.capture.verify import block_nonfinite, nonfinite_count, np_digest

    data = torch.randint(0, 256, (3 * 4096 + 5,), dtype=torch.uint8)
    ref = (int(data[: 3 * 4096].view(torch.int64).sum()) + int(data[3 * 4096 :].to(torch.int64).sum())) % (1 << 64)
    assert np_digest(data.numpy()) == ref
    assert np_digest(data.numpy()[1:]) == np_digest(data.numpy()[1:].copy())  # an unaligned start
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        t = torch.randn(4099, generator=g).to(dtype)
        assert block_nonfinite(t.view(torch.uint8).numpy(), dtype) == 0
        for i, v in ((0, "nan"), (17, "inf"), (4098, "-inf"), (2000, "nan")):
            t[i] = float(v)
        t[5] = -0.0
        fi = torch.finfo(dtype)
        t[6], t[7], t[8] = fi.max, -fi.max, -fi.tiny  # the largest finite values are not counted
        assert block_nonfinite(t.view(torch.uint8).numpy(), dtype) == nonfinite_count(t) == 4, dtype


def test_pieces_longer_than_a_block_are_checked_in_every_block(tmp_path: Path, monkeypatch) -> None:
    """Chunks of 4 MiB: a 3 MiB tensor's piece spans several of the host pass's 1 MiB blocks; the
    CRC32Cs chained over the blocks load, NaN/Inf in any block is counted, and a flip in the host
    buffer in a later block is caught."""
    from tierckpt.capture.verify import BLOCK

    def cfg_(root: Path, **job) -> TierConfig:
        return TierConfig(
            host=HostConfig(buffer_size=16 * MiB, chunk_size=4 * MiB),
            local=LocalConfig(path=str(root / "local"), keep=0, fsync=False),
            job=JobConfig(commit_timeout=30, **job),
        )

    g = torch.Generator().manual_seed(5)
    sd = {"a": torch.randn(3 * MiB // 4, generator=g), "b": torch.randn(MiB + 3, generator=g).to(torch.bfloat16)}
    sd["a"][BLOCK // 4 * 2 + 7] = float("nan")  # in the third block
    sd["b"][-1] = float("inf")  # the last element, past the first block
    cfg = cfg_(tmp_path, nonfinite="warn", verify_capture="all")
    w = save(cfg, sd, "step-1")
    w.wait()
    counts = {it["index"][0]: it.get("nonfinite") for it in items_of(tmp_path, "step-1")}
    assert counts == {"a": 1, "b": 1}
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, checkpoint_id="step-1", storage_reader=TieredReader(cfg))  # every CRC32C verified
    assert all(torch.equal(out[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in sd)
    close_all()

    cfg = cfg_(tmp_path / "flip", verify_capture="all")
    hit = []

    def fault(when, obj, slot):
        if when == "copied" and obj.source.fqn == "a" and obj.n > 2 * BLOCK and not hit:
            slot[obj.slot_off + 2 * BLOCK + 100] ^= 0x01
            hit.append(obj)

    _inject(cfg, monkeypatch, fault)
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id="step-1", storage_writer=w)
    with pytest.raises(CaptureMismatch, match=r"step-1.*'a' does not match"):
        w.wait()
    assert hit and tierckpt.latest(cfg) is None
