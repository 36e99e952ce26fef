"""Direct I/O on the local tier: O_DIRECT writes from the page-aligned pool, direct cold reads,
and the buffered fallback for file systems that refuse O_DIRECT.

Every case runs in three modes: ``direct`` (``direct_io = "auto"`` on the test's file system,
which must accept O_DIRECT: ext4/xfs do), ``buffered`` (``direct_io = false``) and ``refused``
(``"auto"`` on a path whose ``open(O_DIRECT)`` fails with EINVAL, as on tmpfs before Linux 6.6
and on some FUSE/network file systems: simulated, so that it runs everywhere). All round trips
are bit-exact, and the data files are identical in every mode (the format does not depend on
the I/O path).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierckpt.tiers.local as local_mod
import tierckpt.tiers.localfs as localfs_mod
import tierckpt.tiers.localreads as reads_mod
from tierckpt import ConfigError, HostConfig, LocalConfig, TierConfig, TieredReader, TieredWriter
from tierckpt.capture.pool import POOL_ALIGN, HostPool, aligned_buffer
from tierckpt.config import config_from_dict
from tierckpt.errors import TierError
from tierckpt.format.layout import data_key, metadata_key
from tierckpt.format.metadata import metadata_from_json
from tierckpt.tiers.local import DIO_ALIGN, LocalTier

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

KiB, MiB = 1 << 10, 1 << 20
MODES = ["direct", "buffered", "refused"]


def _fs_accepts_direct(d: Path) -> bool:
    p = d / ".probe"
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        return False
    os.close(fd)
    p.unlink()
    return hasattr(os, "O_DIRECT")


@pytest.fixture
def refuse_direct(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Make ``open(..., O_DIRECT)`` under ``tmp_path`` fail with EINVAL (a tmpfs-like file system).
    Returns the list of refused paths (so tests can see the probe happened)."""
    real_open = os.open
    refused: list[str] = []

    def fake_open(path, flags, *args, **kwargs):  # noqa: ANN001 - os.open's signature
        if flags & getattr(os, "O_DIRECT", 0) and str(path).startswith(str(tmp_path)):
            refused.append(str(path))
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(localfs_mod, "_fallback_logged", False)
    return refused


@pytest.fixture(autouse=True)
def direct_at_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The files here are small: under ``"auto"`` they would be written buffered
    (:data:`~tierckpt.tiers.localfs.DIRECT_WRITE_MIN`); these cases are about the direct path."""
    monkeypatch.setattr(localfs_mod, "DIRECT_WRITE_MIN", 0)


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "direct" and not _fs_accepts_direct(tmp_path):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT")
    if request.param == "refused":
        request.getfixturevalue("refuse_direct")
    yield request.param


def _direct_io(mode: str) -> bool | str:
    return False if mode == "buffered" else "auto"


def _data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# -- the pool -----------------------------------------------------------------------------------


def test_pool_and_slots_are_page_aligned() -> None:
    for chunk in (64 * KiB, 1 * MiB + 4 * KiB):
        pool = HostPool(4 * chunk + 123, chunk, pinned=False)
        assert pool.buffer.data_ptr() % POOL_ALIGN == 0
        assert pool.buffer.numel() == 4 * chunk
        for s in range(pool.nslots):
            assert pool.slot(s).data_ptr() % 4096 == 0
        assert int(pool.buffer.sum()) == 0  # touched (zero-filled) before use
    t, owner = aligned_buffer(3 * 4096 + 5)
    assert t.data_ptr() % POOL_ALIGN == 0 and t.numel() == 3 * 4096 + 5 and owner is not None


# -- the sink -----------------------------------------------------------------------------------

SIZES = [1, 4095, 4096, 4097, 3 * 4096 + 5, 256 * KiB, MiB + 123]


def _cached_pages(path: Path) -> list[bool]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return [localfs_mod._cached(fd, off) for off in range(0, path.stat().st_size, 4096)]
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct_io", ["auto", True])
def test_small_files_are_written_buffered_and_stay_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_io: bool | str
) -> None:
    """Under ``"auto"`` a data file below ``DIRECT_WRITE_MIN`` is written through the page cache
    and is all there after the sink's close (a resume soon after reads memory); a file of at least
    that size goes ``O_DIRECT``, as does every file under ``direct_io = true``."""
    if not _fs_accepts_direct(tmp_path):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT")
    monkeypatch.setattr(localfs_mod, "DIRECT_WRITE_MIN", 1 * MiB)
    tier = LocalTier(tmp_path / "root", fsync=True, direct_io=direct_io)
    slot, _owner = aligned_buffer(2 * MiB)
    arr = slot.numpy()
    for size in (256 * KiB, 2 * MiB):
        data = _data(size, size)
        arr[:size] = np.frombuffer(data, np.uint8)
        sink = tier.open_sink(f"c/rank-{size}.data", size)
        direct = sink.direct  # type: ignore[attr-defined]
        assert direct == (direct_io is True or size >= MiB)
        sink.write_at(0, memoryview(arr[:size]))
        sink.close()
        path = tmp_path / "root" / "c" / f"rank-{size}.data"
        if not direct:
            assert all(_cached_pages(path))
        assert path.read_bytes() == data


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"size{s}")
def test_sink_chunks_from_aligned_slots(mode: str, tmp_path: Path, size: int) -> None:
    """Chunks from an aligned buffer at chunk offsets, the last one with an unaligned tail."""
    tier = LocalTier(tmp_path / "root", fsync=True, direct_io=_direct_io(mode))
    data = _data(size, size)
    chunk = 64 * KiB
    slot, _owner = aligned_buffer(chunk)
    arr = slot.numpy()
    sink = tier.open_sink("c/rank-0.data", size)
    assert sink.direct == (mode == "direct" and size >= DIO_ALIGN)  # type: ignore[attr-defined]
    for off in reversed(range(0, size, chunk)):  # out of order, as the flush threads do
        n = min(chunk, size - off)
        arr[:n] = np.frombuffer(data, np.uint8, n, off)
        sink.write_at(off, memoryview(arr[:n]))
        arr[:n] = 0xA5  # the slot is reused at once
    sink.close()
    assert tier.get("c/rank-0.data") == data
    assert os.path.getsize(tmp_path / "root" / "c" / "rank-0.data") == size  # no padding on disk


@pytest.mark.parametrize("shift", [0, 1, 100, 4095], ids=lambda s: f"shift{s}")
def test_sink_unaligned_offsets_and_buffers(mode: str, tmp_path: Path, shift: int) -> None:
    """Writes at odd offsets from buffers at odd addresses (restore's fetch, S3 ranges): the
    aligned middle goes direct when offset and address agree, the rest buffered; all exact."""
    tier = LocalTier(tmp_path / "root", fsync=False, direct_io=_direct_io(mode))
    size = 5 * 4096 * 8 + 777
    data = _data(size, 7 + shift)
    base, _owner = aligned_buffer(size + 2 * 4096)
    arr = base.numpy()
    cuts = sorted({0, size, 100, 100 + 4096 * 3, 4096 * 11 + shift, 4096 * 20, size - 10})
    sink = tier.open_sink("u/rank-0.data", size)
    for a, b in zip(cuts, cuts[1:]):
        # same residue mod 4096 as the file offset when shift == 0, else off by ``shift``
        at = (a + shift) % 4096 + 4096
        arr[at : at + b - a] = np.frombuffer(data, np.uint8, b - a, a)
        sink.write_at(a, memoryview(arr[at : at + b - a]))
    sink.write_at(size - 10, memoryview(data)[size - 10 :])  # read-only bytes, rewritten: same bytes
    sink.close()
    assert tier.get("u/rank-0.data") == data


def test_sink_empty_and_abort(mode: str, tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "root", fsync=True, direct_io=_direct_io(mode))
    sink = tier.open_sink("e/rank-0.data", 0)
    sink.close()
    assert tier.get("e/rank-0.data") == b""
    sink = tier.open_sink("a/rank-0.data", 64 * KiB)
    slot, _owner = aligned_buffer(64 * KiB)
    sink.write_at(0, memoryview(slot.numpy()[: 32 * KiB]))
    sink.abort()
    assert not tier.exists("a/rank-0.data")
    assert not (tmp_path / "root" / "a" / "rank-0.data.partial").exists()


def test_refused_fallback_logs_once(refuse_direct: list[str], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tierckpt")
    slot, _owner = aligned_buffer(64 * KiB)
    slot.numpy()[:] = 7
    for i in range(3):  # new tiers, new sinks: still one warning per process
        tier = LocalTier(tmp_path / f"root{i}", fsync=True)
        for j in range(2):
            sink = tier.open_sink(f"f/rank-{j}.data", 64 * KiB)
            assert not sink.direct  # type: ignore[attr-defined]
            sink.write_at(0, memoryview(slot.numpy()))
            sink.close()
            assert tier.get(f"f/rank-{j}.data") == bytes([7]) * 64 * KiB
    assert refuse_direct, "the O_DIRECT probe did not run"
    warns = [r for r in caplog.records if r.levelno == logging.WARNING and "refuses O_DIRECT" in r.getMessage()]
    assert len(warns) == 1, [r.getMessage() for r in warns]
    assert str(tmp_path / "root0") in warns[0].getMessage()


def test_refused_with_direct_io_true_is_an_error(refuse_direct: list[str], tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "root", direct_io=True)
    with pytest.raises(TierError) as ei:
        tier.open_sink("t/rank-0.data", 64 * KiB)
    assert "rank-0.data.partial" in str(ei.value) and "O_DIRECT" in str(ei.value)
    assert not (tmp_path / "root" / "t" / "rank-0.data.partial").exists()


def test_refused_at_first_transfer_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A file system that accepts the open but fails the direct write (EINVAL): that write and
    every later one go buffered; nothing is lost."""
    if not _fs_accepts_direct(tmp_path):
        pytest.skip("needs a file system that accepts O_DIRECT")
    monkeypatch.setattr(localfs_mod, "_fallback_logged", False)
    tier = LocalTier(tmp_path / "root", fsync=False)
    size = 3 * 64 * KiB + 11
    data = _data(size, 3)
    sink = tier.open_sink("w/rank-0.data", size)
    dfd = sink._dfd  # type: ignore[attr-defined]
    real = os.pwrite
    calls = []

    def fake_pwrite(fd, buf, off):  # noqa: ANN001
        if fd == dfd:
            calls.append(off)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buf, off)

    monkeypatch.setattr(os, "pwrite", fake_pwrite)
    slot, _owner = aligned_buffer(64 * KiB)
    for off in range(0, size, 64 * KiB):
        n = min(64 * KiB, size - off)
        slot.numpy()[:n] = np.frombuffer(data, np.uint8, n, off)
        sink.write_at(off, memoryview(slot.numpy()[:n]))
    sink.close()
    assert calls == [0]  # tried once, then buffered
    assert tier._direct_ok is False
    assert tier.get("w/rank-0.data") == data


# -- reads ----------------------------------------------------------------------------------------


def test_direct_reads_cold_and_buffered_when_cached(mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reads_mod, "DIRECT_READ_MIN", 4096)  # small test data: take the direct path
    monkeypatch.setattr(reads_mod, "BOUNCE_SIZE", 64 * KiB)  # several bounce rounds per read
    tier = LocalTier(tmp_path / "root", fsync=True, direct_io=_direct_io(mode))
    size = 300 * KiB + 37
    data = _data(size, 11)
    slot, _owner = aligned_buffer(size)
    slot.numpy()[:] = np.frombuffer(data, np.uint8)
    sink = tier.open_sink("r/rank-0.data", size)
    sink.write_at(0, memoryview(slot.numpy()))
    sink.close()
    path = tmp_path / "root" / "r" / "rank-0.data"
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold (direct writes left nothing cached anyway)
    os.close(fd)
    direct_reads = []
    real = local_mod.LocalTier._read_direct

    def spy(self, *a, **k):  # noqa: ANN001, ANN002, ANN003
        direct_reads.append(a[2])
        return real(self, *a, **k)

    monkeypatch.setattr(local_mod.LocalTier, "_read_direct", spy)
    for start, lens in (
        (0, [size]),
        (1, [4095, 1, 70 * KiB, 3]),
        (4096 * 3 + 64, [100 * KiB + 1, 0, 5000]),
        (size - 9000, [9000]),
        (123, [size - 123]),
    ):
        bufs = [memoryview(bytearray(n)) for n in lens]
        tier.read_ranges("r/rank-0.data", start, bufs)
        at = start
        for b in bufs:
            assert bytes(b) == data[at : at + len(b)]
            at += len(b)
        assert tier.get("r/rank-0.data", start, at) == data[start:at]
    if mode == "direct":
        assert direct_reads, "cold ranges should have been read with O_DIRECT"
        # now warm the page cache: the same reads go buffered
        n = len(direct_reads)
        with open(path, "rb") as f:
            f.read()
        buf = memoryview(bytearray(size))
        tier.read_ranges("r/rank-0.data", 0, [buf])
        assert bytes(buf) == data and len(direct_reads) == n
    else:
        assert not direct_reads


def test_direct_reads_in_place_into_aligned_buffers(mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An aligned destination at an aligned offset (promotion's part buffers) is filled by
    O_DIRECT reads straight into it, with no bounce buffer; the tail past its last whole block,
    reads running into the end of the file and unaligned shapes stay exact."""
    import mmap

    monkeypatch.setattr(reads_mod, "DIRECT_READ_MIN", 4096)
    monkeypatch.setattr(reads_mod, "INPLACE_STEP", 64 * KiB)  # several in-place reads per call
    tier = LocalTier(tmp_path / "root", fsync=True, direct_io=_direct_io(mode))
    size = 700 * KiB + 123
    data = _data(size, 12)
    sink = tier.open_sink("p/rank-0.data", size)
    sink.write_at(0, memoryview(data))
    sink.close()
    path = tmp_path / "root" / "p" / "rank-0.data"
    bounced: list[int] = []
    real_take = localfs_mod._bounce.take

    def spy_take():  # noqa: ANN202
        bounced.append(1)
        return real_take()

    monkeypatch.setattr(reads_mod._bounce, "take", spy_take)
    buf = mmap.mmap(-1, 256 * KiB)
    for start, n in (
        (0, 256 * KiB),
        (256 * KiB, 256 * KiB),
        (512 * KiB, size - 512 * KiB),
        (4096, 100 * KiB + 7),
        (4096 * 5, 3),
    ):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        bounced.clear()
        view = memoryview(buf)[:n]
        tier.read_into("p/rank-0.data", start, view)
        assert bytes(view) == data[start : start + n], (start, n)
        del view
        if mode == "direct" and n % DIO_ALIGN == 0 and n >= 4096:
            assert not bounced, f"an aligned read of [{start}, {start + n}) went through the bounce buffer"
    buf.close()


def test_direct_read_refused_falls_back(
    refuse_direct: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads_mod, "DIRECT_READ_MIN", 4096)
    (tmp_path / "root" / "x").mkdir(parents=True)
    data = _data(200 * KiB + 1, 2)
    (tmp_path / "root" / "x" / "f.data").write_bytes(data)
    tier = LocalTier(tmp_path / "root")
    fd = os.open(tmp_path / "root" / "x" / "f.data", os.O_RDONLY)
    os.fsync(fd)  # clean pages can be dropped: the read is cold
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    buf = memoryview(bytearray(len(data) - 5))
    tier.read_ranges("x/f.data", 5, [buf])
    assert bytes(buf) == data[5:]
    assert refuse_direct


# -- through TieredWriter / TieredReader ---------------------------------------------------------


def _state() -> dict:
    g = torch.Generator().manual_seed(9)
    sd: dict = {
        "aligned_4k": torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=g),  # 2 x 4 KiB exactly
        "chunk_crossing": torch.randn(300_001, generator=g),  # ~1.14 MiB: crosses 1 MiB chunks, odd length
        "bf16_odd": torch.randn(777, 13, generator=g).to(torch.bfloat16),
        "tiny": torch.tensor([1.5]),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(3, 0, dtype=torch.float16),
        "bool": torch.rand(33, generator=g) > 0.5,
        "step": 42,
        "meta": {"name": "direct", "lr": 1e-3},
        "unaligned_tail": torch.randint(-9, 9, (1031,), dtype=torch.int16, generator=g),  # the file's last item
    }
    return sd


def _cfg(tmp_path: Path, mode: str, **host) -> TierConfig:
    return TierConfig(
        host=HostConfig(buffer_size=host.get("buffer_size", 4 * MiB), chunk_size=host.get("chunk_size", 1 * MiB)),
        local=LocalConfig(path=str(tmp_path / "ckpt"), keep=0, fsync=True, direct_io=_direct_io(mode)),
    )


def _load_into_zeros(cfg: TierConfig, sd: dict, cid: str) -> dict:
    out = {
        k: (
            torch.zeros_like(v)
            if isinstance(v, torch.Tensor)
            else {kk: type(vv)() for kk, vv in v.items()}
            if isinstance(v, dict)
            else type(v)()
        )
        for k, v in sd.items()
    }
    dcp.load(out, checkpoint_id=cid, storage_reader=TieredReader(cfg), no_dist=True)
    return out


def _file_digest(cfg: TierConfig, cid: str) -> tuple[str, int]:
    root = cfg.local.resolved_path()
    raw = (root / metadata_key(cid)).read_bytes()
    _md, man = metadata_from_json(raw, "m")
    ((file, size),) = man.files.items()
    data = (root / data_key(cid, file)).read_bytes()
    assert len(data) == size
    return hashlib.sha256(data).hexdigest(), size


def test_roundtrip_bit_exact_all_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same state saved in every mode: bit-exact loads, identical data files, a file size
    that is not a multiple of 4 KiB, and restore's verify agrees."""
    from restore import verify_checkpoint

    sd = _state()
    digests = {}
    for mode in MODES:
        d = tmp_path / mode
        d.mkdir()
        with monkeypatch.context() as mp:
            if mode == "refused":
                real_open = os.open

                def fake_open(path, flags, *a, _d=str(d), **k):  # noqa: ANN001, ANN002, ANN003
                    if flags & getattr(os, "O_DIRECT", 0) and str(path).startswith(_d):
                        raise OSError(errno.EINVAL, "Invalid argument", str(path))
                    return real_open(path, flags, *a, **k)

                mp.setattr(os, "open", fake_open)
            elif mode == "direct" and not _fs_accepts_direct(d):
                continue
            mp.setattr(reads_mod, "DIRECT_READ_MIN", 4096)
            cfg = _cfg(d, mode)
            w = TieredWriter(cfg)
            dcp.save(sd, checkpoint_id="step-1", storage_writer=w, no_dist=True)
            w.wait()
            assert w.engine.first_tier._direct_ok is (mode == "direct")  # type: ignore[union-attr]
            st = w.stats
            assert st.capture_cpu_s > 0 and st.crc_cpu_s > 0 and st.write_cpu_s > 0
            assert st.cpu_s == pytest.approx(st.plan_cpu_s + st.capture_cpu_s + st.crc_cpu_s + st.write_cpu_s)
            assert st.to_json()["cpu_s"] == st.cpu_s
            out = _load_into_zeros(cfg, sd, "step-1")
            for k, v in sd.items():
                if isinstance(v, torch.Tensor):
                    assert v.dtype == out[k].dtype and v.shape == out[k].shape, k
                    assert torch.equal(v.reshape(-1).view(torch.uint8), out[k].reshape(-1).view(torch.uint8)), k
                else:
                    assert out[k] == v, k
            digests[mode], size = _file_digest(cfg, "step-1")
            assert size % 4096, "the test state should not fill whole 4 KiB blocks"
            assert verify_checkpoint(cfg, "step-1").ok
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize("nbytes", [1, 63, 64, 4095, 4096, 4097, 2 * MiB + 4096, 2 * MiB + 4097])
def test_single_tensor_sizes(mode: str, tmp_path: Path, nbytes: int) -> None:
    """One uint8 tensor of each size around the 64-byte, 4 KiB and chunk boundaries."""
    g = torch.Generator().manual_seed(nbytes)
    sd = {"t": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)}
    cfg = _cfg(tmp_path, mode)
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id="s", storage_writer=w, no_dist=True)
    w.wait()
    out = _load_into_zeros(cfg, sd, "s")
    assert torch.equal(out["t"], sd["t"])


def test_slot_larger_state_than_pool(mode: str, tmp_path: Path) -> None:
    """More chunks than pool slots: slots are reused while direct writes are in flight."""
    g = torch.Generator().manual_seed(4)
    sd = {f"w{i}": torch.randn(131_071 + 17 * i, generator=g) for i in range(12)}  # ~6 MiB, pool 2 MiB
    cfg = _cfg(tmp_path, mode, buffer_size=2 * MiB, chunk_size=256 * KiB)
    w = TieredWriter(cfg)
    for step in range(2):
        dcp.save(sd, checkpoint_id=f"p{step}", storage_writer=w, no_dist=True)
        w.wait()
        out = _load_into_zeros(cfg, sd, f"p{step}")
        for k, v in sd.items():
            assert torch.equal(out[k], v), k


# -- configuration ------------------------------------------------------------------------------


def test_direct_io_config(tmp_path: Path) -> None:
    assert LocalConfig(path="/x").direct_io == "auto"
    for v in ("auto", True, False):
        assert config_from_dict({"local": {"path": "/x", "direct_io": v}}).local.direct_io == v
    for bad in ("yes", "on", 1, 0, None, "AUTO"):
        with pytest.raises(ConfigError) as ei:
            config_from_dict({"local": {"path": "/x", "direct_io": bad}}, source="t.toml")
        assert "t.toml" in str(ei.value) and "[local] direct_io" in str(ei.value) and "\n" not in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        TierConfig(local=LocalConfig(path="/x", direct_io="sometimes"))
    assert "[local] direct_io" in str(ei.value)
    p = tmp_path / "t.toml"
    p.write_text(f'[local]\npath = "{tmp_path}"\ndirect_io = false\n')
    from tierckpt import load_config

    assert load_config(p).local.direct_io is False


def test_real_tmpfs_roundtrip_auto() -> None:
    """On a real tmpfs (``/dev/shm``), ``auto`` works whichever way the kernel answers: tmpfs
    refuses O_DIRECT before Linux 6.6 (buffered fallback) and accepts it since."""
    import shutil
    import tempfile

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="tierckpt-test-", dir="/dev/shm"))
    try:
        sd = _state()
        cfg = _cfg(d, "direct")
        w = TieredWriter(cfg)
        dcp.save(sd, checkpoint_id="shm-1", storage_writer=w, no_dist=True)
        w.wait()
        out = _load_into_zeros(cfg, sd, "shm-1")
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v.reshape(-1).view(torch.uint8), out[k].reshape(-1).view(torch.uint8)), k
            else:
                assert out[k] == v, k
        assert w.engine.first_tier._direct_ok in (True, False)  # type: ignore[union-attr]  # decided, either way
    finally:
        shutil.rmtree(d, ignore_errors=True)
