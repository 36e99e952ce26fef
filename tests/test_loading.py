"""Loads in flight (tierckpt.loading): the host pool's first touch yields to them, never to a save.

A restart builds its writer (whose capture thread touches the host pool) and then resumes; the
touch waits between slots while a load is in flight, so the resume has the cores to itself.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from tierckpt import TieredReader, TieredWriter, loading
from tierckpt.capture.pool import HostPool
from tierckpt.chain.engine import get_engine
from tierckpt.config import HostConfig, LocalConfig, TierConfig
from tierckpt.errors import TierckptError

MiB = 1 << 20


@pytest.fixture
def cfg(tmp_path):
    # a pool size no other test uses: this test's engine allocates (and touches) its own pool
    c = TierConfig(
        host=HostConfig(buffer_size=3 * MiB + 4 * 4096, chunk_size=MiB + 4096),
        local=LocalConfig(path=str(tmp_path / "ckpt"), fsync=False),
    )
    yield c
    try:
        get_engine(c).close()
    except TierckptError:
        pass


def test_pool_touch_waits_while_a_load_is_in_flight():
    asked = threading.Event()

    def pause() -> bool:
        asked.set()
        return loading.in_flight()

    box: list[HostPool] = []
    with loading.loading():
        t = threading.Thread(target=lambda: box.append(HostPool(4 * MiB, MiB, False, pause)))
        t.start()
        assert asked.wait(60)
        t.join(0.2)
        assert t.is_alive() and not box  # paused before its first slot
    t.join(60)
    assert box and box[0].nslots == 4 and int(box[0].buffer.sum()) == 0
    assert not loading.in_flight()


class _Probe(DefaultLoadPlanner):
    """Records whether a load was in flight when read_data resolved its destinations."""

    seen: ClassVar[list[bool]] = []

    def resolve_tensor(self, read_item):
        _Probe.seen.append(loading.in_flight())
        return super().resolve_tensor(read_item)


def test_a_reader_counts_from_metadata_to_the_end_of_read_data(cfg):
    sd = {"w": torch.arange(1000, dtype=torch.float32)}
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id="step-1", storage_writer=w)
    w.wait()
    out = {"w": torch.zeros(1000)}
    _Probe.seen = []
    dcp.load(
        out,
        checkpoint_id="step-1",
        storage_reader=TieredReader(cfg),
        planner=_Probe(),
        no_dist=True,
    )
    assert torch.equal(out["w"], sd["w"])
    assert _Probe.seen and all(_Probe.seen)
    assert not loading.in_flight()
    with pytest.raises(CheckpointException, match="step-9 is not committed"):  # a failed load stops counting too
        dcp.load(out, checkpoint_id="step-9", storage_reader=TieredReader(cfg), no_dist=True)
    assert not loading.in_flight()


def test_a_save_during_a_load_does_not_wait_for_it(cfg):
    """The touch stops yielding once a save waits for the pool: a save inside a load completes."""
    sd = {"w": torch.randn(300, 1000)}
    with loading.loading():
        w = TieredWriter(cfg)
        dcp.save(sd, checkpoint_id="step-1", storage_writer=w)
        w.wait(timeout=120)
        assert loading.in_flight()
    out = {"w": torch.zeros(300, 1000)}
    dcp.load(out, checkpoint_id="step-1", storage_reader=TieredReader(cfg), no_dist=True)
    assert torch.equal(out["w"], sd["w"])


@pytest.fixture
def deterministic():
    """``torch.use_deterministic_algorithms(True)``, as Lightning's ``deterministic=True`` sets it."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def test_unfilled_destinations_are_not_filled_first(deterministic):
    """Under deterministic algorithms ``torch.empty`` fills new memory (NaN) before the load
    overwrites it; :func:`unfilled` gives the same tensor without that pass."""
    from tierckpt.load.deliver import unfilled

    filled = torch.empty(1 << 20)
    assert torch.isnan(filled).all()  # the pass unfilled avoids
    t = unfilled((1024, 1024), torch.float32)
    assert t.shape == (1024, 1024) and t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
    assert not torch.isnan(t).all()
    assert unfilled((0, 3), torch.int64).shape == (0, 3)


def test_large_unfilled_destinations_are_advised_into_huge_pages():
    """A destination of at least ``HUGE_MIN`` bytes is an ordinary storage of torch's allocator
    (resizable) whose whole aligned 2 MiB pages are advised ``MADV_HUGEPAGE`` where Linux has
    transparent huge pages (the kernel's own map of the process says so), unless the machine is
    a VM reporting free pages to its host (then no advice); smaller ones are left alone; the
    contents are what is written."""
    from tierckpt.load.deliver import HUGE_MIN, HUGE_PAGE, advise_huge, free_pages_reported, unfilled

    t = unfilled((2 * HUGE_MIN // 4,), torch.float32)
    assert t.untyped_storage().resizable()
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * t.numel()
    assert advise_huge(t.data_ptr(), HUGE_MIN - 1) is False
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if free_pages_reported():
        assert advise_huge(t.data_ptr(), t.numel() * 4) is False
        return
    if not thp.exists() or "[never]" in thp.read_text():
        return
    inside = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the first aligned huge page of the tensor
    vma = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            vma = (lo, hi)
        elif line.startswith("VmFlags:") and vma is not None and vma[0] <= inside < vma[1]:
            assert "hg" in line.split(), line
            return
    raise AssertionError(f"no mapping of {inside:#x} in /proc/self/smaps")


def test_free_page_reporting_is_read_from_the_balloon_features(tmp_path):
    """``free_pages_reported`` reads each bound virtio-balloon device's feature bits (sysfs
    layout): bit 5, free page reporting, set on any device means yes; none, or no such driver
    directory, means no."""
    from tierckpt.load.deliver import free_pages_reported

    assert free_pages_reported(str(tmp_path / "absent")) is False
    (tmp_path / "virtio0").mkdir()
    (tmp_path / "virtio0" / "features").write_text("0110000100000000\n")
    (tmp_path / "uevent").write_text("")
    assert free_pages_reported(str(tmp_path)) is False
    (tmp_path / "virtio3").mkdir()
    (tmp_path / "virtio3" / "features").write_text("0110010100000000\n")
    assert free_pages_reported(str(tmp_path)) is True


def test_skeleton_load_under_deterministic_algorithms(cfg, deterministic):
    """Lightning's whole-state load (the skeleton rebuilt from the metadata, tensors allocated
    unfilled) gets every tensor back bit-exact with deterministic algorithms on, nested keys too."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from tierckpt.integrations.lightning import _SkeletonPlanner

    sd = {
        "model": {"w": torch.randn(64, 32), "b": torch.arange(7, dtype=torch.int32)},
        "opt": {"step": torch.tensor(3.0), "m": torch.randn(5, 5, dtype=torch.bfloat16)},
        "epoch": 4,
    }
    w = TieredWriter(cfg)
    try:
        dcp.save(sd, checkpoint_id="step-1", storage_writer=w, no_dist=True)
        w.wait()
    finally:
        w.close()
    reader = TieredReader(cfg)
    reader.reset("step-1")
    got: dict = {}
    _load_state_dict(got, storage_reader=reader, planner=_SkeletonPlanner(), no_dist=True)
    assert got["epoch"] == 4
    for part in ("model", "opt"):
        for k, v in sd[part].items():
            assert got[part][k].dtype == v.dtype and torch.equal(got[part][k], v), (part, k)
