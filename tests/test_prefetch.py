"""A small load's local reads: announced at planning, prefetched into the page cache
(``POSIX_FADV_WILLNEED``) and read buffered; a large load's cold ranges stay ``O_DIRECT``. And the
``weights_only`` check of non-tensor items runs once per distinct object of a load.

Real files on the test's file system (which must accept ``O_DIRECT`` for the direct cases: ext4
and xfs do), real ``dcp.load`` through :class:`~tierckpt.TieredReader`.
"""

from __future__ import annotations

import io
import os
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierckpt.tiers.local as local_mod
import tierckpt.tiers.localfs as localfs_mod
import tierckpt.tiers.localreads as reads_mod
from tierckpt import TieredReader, TieredWriter
from tierckpt.config import HostConfig, LocalConfig, TierConfig
from tierckpt.errors import CheckpointNotFound, CorruptCheckpoint, find_error
from tierckpt.format.layout import data_key, metadata_key
from tierckpt.format.metadata import metadata_from_json
from tierckpt.tiers.local import LocalTier

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

KiB, MiB = 1 << 10, 1 << 20


def _accepts_direct(d: Path) -> bool:
    d.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(d / ".probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        return False
    os.close(fd)
    (d / ".probe").unlink()
    return hasattr(os, "O_DIRECT") and hasattr(os, "posix_fadvise")


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cached_pages(path: Path, size: int) -> list[bool]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return [localfs_mod._cached(fd, off) for off in range(0, size, 4096)]
    finally:
        os.close(fd)


@pytest.fixture
def direct_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A local tier holding one 600 KiB file written with O_DIRECT, dropped from the page cache;
    reads of 4 KiB and more take the direct path unless announced; every direct read recorded."""
    if not _accepts_direct(tmp_path / "root"):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT")
    monkeypatch.setattr(reads_mod, "DIRECT_READ_MIN", 4096)
    monkeypatch.setattr(localfs_mod, "PREFETCH_STEP", 64 * KiB)  # several WILLNEED calls per range
    tier = LocalTier(tmp_path / "root", fsync=True)
    size = 600 * KiB + 5
    data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8).tobytes()
    sink = tier.open_sink("c/rank-0.data", size)
    sink.write_at(0, memoryview(data))
    sink.close()
    path = tmp_path / "root" / "c" / "rank-0.data"
    _drop(path)
    direct: list[int] = []
    real = local_mod.LocalTier._read_direct

    def spy(self, *a, **k):  # noqa: ANN001, ANN002, ANN003
        direct.append(a[2])
        return real(self, *a, **k)

    monkeypatch.setattr(local_mod.LocalTier, "_read_direct", spy)
    yield tier, path, data, direct
    tier.end_prefetch()


def _read(tier: LocalTier, start: int, n: int) -> bytes:
    buf = memoryview(bytearray(n))
    tier.read_ranges("c/rank-0.data", start, [buf])
    return bytes(buf)


def test_announced_reads_are_prefetched_and_buffered(direct_tier) -> None:
    tier, path, data, direct = direct_tier
    spans = [(0, 100 * KiB), (100 * KiB + 64, 300 * KiB), (500 * KiB, len(data))]
    assert tier.prefetch({"c/rank-0.data": spans}) == sum(b - a for a, b in spans)
    deadline = time.monotonic() + 10
    pages = (0, 400 * KiB // 4096, len(data) // 4096 - 1)  # first, in the gap merged over, last whole page
    while not all(_cached_pages(path, len(data))[p] for p in pages):
        assert time.monotonic() < deadline, "the announced ranges never reached the page cache"
        time.sleep(0.01)
    for a, b in spans:
        assert _read(tier, a, b - a) == data[a:b]
    assert not direct, "announced ranges were read with O_DIRECT"
    tier.end_prefetch()  # forgotten: a cold range is direct again
    _drop(path)
    assert _read(tier, 0, 200 * KiB) == data[: 200 * KiB]
    assert direct


def test_a_cached_load_starts_no_prefetch(direct_tier, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranges whose first and last pages are in the page cache already (the file was just written
    buffered, or read) are read buffered with no prefetch thread; a cold file still gets one."""
    tier, path, data, direct = direct_tier
    calls: list[dict] = []
    monkeypatch.setattr(reads_mod, "willneed", lambda paths, stop: calls.append(paths))
    assert path.read_bytes() == data  # a buffered read: the page cache holds it all
    assert all(_cached_pages(path, len(data) - len(data) % 4096))  # mincore: the partial last page never is
    direct.clear()
    spans = [(0, 100 * KiB), (500 * KiB, len(data))]
    assert tier.prefetch({"c/rank-0.data": spans}) == sum(b - a for a, b in spans)
    time.sleep(0.05)
    assert calls == [], "a prefetch thread ran for cached ranges"
    for a, b in spans:
        assert _read(tier, a, b - a) == data[a:b]
    assert not direct
    tier.end_prefetch()
    _drop(path)
    tier.prefetch({"c/rank-0.data": spans})
    deadline = time.monotonic() + 10
    while not calls:
        assert time.monotonic() < deadline, "no prefetch for a cold file"
        time.sleep(0.01)


def test_a_large_load_is_not_prefetched(direct_tier, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, path, data, direct = direct_tier
    monkeypatch.setattr(reads_mod, "PREFETCH_MAX", 256 * KiB)
    assert tier.prefetch({"c/rank-0.data": [(0, len(data))]}) == 0
    time.sleep(0.05)
    assert not any(_cached_pages(path, len(data))), "a load over PREFETCH_MAX was prefetched"
    assert _read(tier, 0, len(data)) == data
    assert direct, "the cold read of a large load should be direct"


def test_announcing_an_absent_file_is_harmless(direct_tier) -> None:
    tier, _path, data, direct = direct_tier
    assert tier.prefetch({"c/rank-0.data": [(0, 8192)], "c/rank-9.data": [(0, 4 * MiB)]}) == 8192 + 4 * MiB
    with pytest.raises(CheckpointNotFound, match="rank-9.data"):
        tier.read_ranges("c/rank-9.data", 0, [memoryview(bytearray(10))])
    assert _read(tier, 0, 8192) == data[:8192]
    assert not direct


def test_willneed_merges_and_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The advice covers the merged ranges in PREFETCH_STEP pieces, skips absent files, and stops
    when asked."""
    p = tmp_path / "f"
    p.write_bytes(b"x" * (3 * MiB))
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, off: int, n: int, advice: int) -> None:
        calls.append((off, n))
        real(fd, off, n, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    step = localfs_mod.PREFETCH_STEP
    stop = threading.Event()
    localfs_mod.willneed({p: [(MiB, MiB + 10), (0, 100), (100 + 4096, 2 * MiB + 1)], tmp_path / "gone": [(0, 1)]}, stop)
    assert calls == [(0, step), (step, 2 * MiB + 1 - step)]
    calls.clear()
    stop.set()
    localfs_mod.willneed({p: [(0, 3 * MiB)]}, stop)
    assert calls == []


# -- through dcp.load --------------------------------------------------------------------------


def _cfg(tmp_path: Path) -> TierConfig:
    return TierConfig(
        host=HostConfig(buffer_size=4 * MiB, chunk_size=1 * MiB),
        local=LocalConfig(path=str(tmp_path / "ckpt"), keep=0, fsync=True),
    )


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    sd: dict = {f"w{i}": torch.randn(40_000 + i, generator=g) for i in range(6)}
    sd["groups"] = {f"g{i}": {"lr": 1e-3, "betas": (0.9, 0.95), "step": i % 2} for i in range(40)}
    return sd


def test_dcp_load_announces_its_reads_and_checks_each_object_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(tmp_path)
    sd = _state()
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id="step-1", storage_writer=w, no_dist=True)
    w.wait()
    root = cfg.local.resolved_path()
    _md, man = metadata_from_json((root / metadata_key("step-1")).read_bytes(), "m")
    for f in man.files:
        _drop(root / data_key("step-1", f))
    announced: list[dict] = []
    real_prefetch = LocalTier.prefetch

    def spy_prefetch(self, ranges):  # noqa: ANN001, ANN202
        announced.append({k: sorted(v) for k, v in ranges.items()})
        return real_prefetch(self, ranges)

    monkeypatch.setattr(LocalTier, "prefetch", spy_prefetch)
    checks: list[bytes] = []
    real_load = torch.load

    def spy_load(f, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        if k.get("weights_only") is True and isinstance(f, io.BytesIO):
            checks.append(f.getvalue())
        return real_load(f, *a, **k)

    monkeypatch.setattr(torch, "load", spy_load)
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {} for k, v in sd.items()}
    out["groups"] = {g: {"lr": 0.0, "betas": (0.0, 0.0), "step": -1} for g in sd["groups"]}
    reader = TieredReader(cfg)
    dcp.load(out, checkpoint_id="step-1", storage_reader=reader, no_dist=True)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out[k], v), k
    assert out["groups"] == sd["groups"]
    # one announcement, of every stored item's bytes, in the local tier's keys
    assert len(announced) == 1
    ranges = announced[0]
    storage = reader.metadata.storage_data  # type: ignore[union-attr]
    for rec in storage.values():
        key = data_key("step-1", rec.file)
        assert any(a <= rec.pos and rec.pos + rec.length <= b for a, b in ranges[key]), rec
    assert reader.tiers[0]._prefetched == frozenset()  # type: ignore[attr-defined]  # forgotten at the end
    # 120 stored objects, a handful of distinct values: each distinct one unpickled once for the check
    assert len(checks) == len(set(checks)) < 10


class Benign:
    """A harmless custom class: only loadable without weights_only."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Benign) and self.x == other.x


def test_every_copy_of_a_refused_object_is_refused(tmp_path: Path) -> None:
    """The once-per-distinct-object check lets no object through that weights_only refuses, however
    many copies of it, or of objects that pass, the checkpoint holds."""
    cfg = _cfg(tmp_path)
    sd = {"a": 1.5, "b": 1.5, "c": Benign(1), "d": Benign(1), "t": torch.ones(3)}
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id="step-2", storage_writer=w, no_dist=True)
    w.wait()
    out = {"a": 0.0, "b": 0.0, "c": None, "d": None, "t": torch.zeros(3)}
    with pytest.raises(BaseException) as ei:
        dcp.load(out, checkpoint_id="step-2", storage_reader=TieredReader(cfg), no_dist=True)
    err = find_error(ei.value, CorruptCheckpoint)
    assert err is not None and "weights_only" in str(err), repr(ei.value)
    assert out["c"] is None and out["d"] is None
    out = {"a": 0.0, "b": 0.0, "c": None, "d": None, "t": torch.zeros(3)}
    dcp.load(out, checkpoint_id="step-2", storage_reader=TieredReader(cfg, allow_pickle=True), no_dist=True)
    assert out == {**sd, "t": out["t"]} and torch.equal(out["t"], sd["t"])


def test_a_load_in_the_page_cache_is_read_on_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small save is written buffered, so its load right after finds every file in the page
    cache and reads (and verifies) it on the calling thread, starting no reader threads; once the
    files are dropped from the cache the runs are read in parallel again. Bit-exact both ways."""
    import tierckpt.load.readback as readback

    monkeypatch.setattr(readback, "RUN_BYTES", 64 * KiB)  # several runs: threads would be used
    monkeypatch.setattr(readback, "MAX_GAP", 0)
    cfg = _cfg(tmp_path)
    sd = {k: v for k, v in _state().items() if isinstance(v, torch.Tensor)}
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id="step-1", storage_writer=w, no_dist=True)
    w.wait()
    readers: list[threading.Thread] = []
    real_read_run = readback.Readback._read_run

    def spy(self, run):  # noqa: ANN001, ANN202
        readers.append(threading.current_thread())
        return real_read_run(self, run)

    monkeypatch.setattr(readback.Readback, "_read_run", spy)

    def load() -> None:
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, checkpoint_id="step-1", storage_reader=TieredReader(cfg, threads=4), no_dist=True)
        assert all(torch.equal(out[k], v) for k, v in sd.items())

    load()
    assert len(readers) > 1 and set(readers) == {threading.main_thread()}
    root = cfg.local.resolved_path()
    _md, man = metadata_from_json((root / metadata_key("step-1")).read_bytes(), "m")
    for f in man.files:
        _drop(root / data_key("step-1", f))
    readers.clear()
    load()
    assert threading.main_thread() not in readers
