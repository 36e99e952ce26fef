"""The Tier contract, one suite run against every tier.

:class:`TierContract` holds the tests; each ``Test*`` subclass supplies a ``tier`` fixture (and
how to look for leftover partial uploads):

* :class:`TestLocalTier`: a directory under ``tmp_path``.
* :class:`TestS3Moto`: :class:`S3Tier` on moto's S3 server.
* :class:`TestS3SeaweedFS`: :class:`S3Tier` on SeaweedFS ``weed mini`` (skipped if it cannot run).
* :class:`TestS3MotoFaults`: the bit-exactness subset (:class:`BitExactContract`) on moto behind a
  :class:`FaultProxy` injecting 10% errors and 5% dropped connections.

Plus S3-only tests: a full outage (bounded failure, nothing visible, nothing dangling after
abort), the ``If-None-Match`` fallback, part-size growth beyond 10,000 parts, credentials kept
out of repr and messages.

Objects use 5 MiB parts (S3's minimum, which moto and SeaweedFS enforce).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from faultproxy import FaultProxy
from s3servers import s3_client

from tierckpt.config import MiB
from tierckpt.errors import CheckpointNotFound, CommitConflict, CorruptCheckpoint, TierError
from tierckpt.tiers.base import Tier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.s3 import MAX_PARTS, S3Tier, effective_part_size

PS = 5 * MiB
SINK_SIZES = [0, 1, PS - 1, PS, 3 * PS + 7]


def _data(size: int, seed: int = 0) -> bytes:
    return random.Random(seed * 7919 + size).randbytes(size)


def _pieces(size: int, seed: int) -> list[tuple[int, int]]:
    """Disjoint [start, end) pieces covering [0, size): random cuts, plus (for large sizes) one
    piece that is exactly part 2, so that both the buffered and the whole-part paths run."""
    rng = random.Random(seed)
    cuts = {0, size}
    whole = (PS, 2 * PS) if size >= 2 * PS else None
    for _ in range(max(1, size // (MiB + 12345))):
        c = rng.randrange(0, size + 1) if size else 0
        if whole is None or not (whole[0] < c < whole[1]):
            cuts.add(c)
    if whole is not None:
        cuts.update(whole)
    pts = sorted(cuts)
    pieces = [(a, b) for a, b in zip(pts, pts[1:]) if b > a]
    rng.shuffle(pieces)
    return pieces


def _write_concurrently(sink: Any, data: bytes, pieces: list[tuple[int, int]], nthreads: int = 4) -> None:
    """Write ``pieces`` of ``data`` from ``nthreads`` threads, each reusing (and then scribbling
    over) one buffer, as the flush threads do."""
    lock = threading.Lock()
    todo = list(pieces)
    errors: list[BaseException] = []
    biggest = max((b - a for a, b in pieces), default=1)

    def worker() -> None:
        buf = bytearray(biggest)
        while True:
            with lock:
                if not todo or errors:
                    return
                a, b = todo.pop()
            try:
                n = b - a
                buf[:n] = data[a:b]
                sink.write_at(a, memoryview(buf)[:n])
                buf[:n] = b"\xa5" * n  # the caller reuses its buffer: the sink must have copied
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                with lock:
                    errors.append(e)
                return

    threads = [threading.Thread(target=worker) for _ in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class BitExactContract:
    """Data written through every path reads back bit-exact. Subclasses provide ``tier``."""

    @pytest.fixture
    def tier(self) -> Iterator[Tier]:  # pragma: no cover - overridden
        raise NotImplementedError

    def leftover_partials(self, tier: Tier) -> list[str]:
        """Partial uploads (multipart uploads, .partial files) left under the tier's root."""
        raise NotImplementedError

    @pytest.mark.parametrize("size", SINK_SIZES, ids=lambda s: f"size{s}")
    def test_sink_concurrent_out_of_order(self, tier: Tier, size: int) -> None:
        data = _data(size, 1)
        sink = tier.open_sink(f"sink-{size}/rank-0.data", size)
        try:
            _write_concurrently(sink, data, _pieces(size, size))
            assert not tier.exists(f"sink-{size}/rank-0.data")  # nothing visible before close
            sink.close()
        except BaseException:
            sink.abort()
            raise
        assert tier.size(f"sink-{size}/rank-0.data") == size
        assert tier.get(f"sink-{size}/rank-0.data") == data

    def test_upload_file_bit_exact_with_progress(self, tier: Tier, tmp_path: Path) -> None:
        for size in (2 * PS + 123, 1000):
            data = _data(size, 2)
            src = tmp_path / f"src-{size}.bin"
            src.write_bytes(data)
            seen: list[int] = []
            tier.upload_file(f"up/file-{size}.data", str(src), progress=seen.append)
            assert sum(seen) == size
            assert tier.get(f"up/file-{size}.data") == data

    def test_get_and_read_into_bit_exact(self, tier: Tier) -> None:
        data = _data(PS + 4321, 3)
        sink = tier.open_sink("rd/obj.data", len(data))
        sink.write_at(0, memoryview(data))
        sink.close()
        rng = random.Random(3)
        for _ in range(6):
            a = rng.randrange(0, len(data))
            b = rng.randrange(a, len(data) + 1)
            assert tier.get("rd/obj.data", a, b) == data[a:b]
        buf = bytearray(PS)
        tier.read_into("rd/obj.data", 1000, memoryview(buf))
        assert bytes(buf) == data[1000 : 1000 + PS]
        assert tier.get("rd/obj.data") == data

    def test_read_ranges_scatter_bit_exact(self, tier: Tier) -> None:
        data = _data(2 * PS + 999, 5)
        sink = tier.open_sink("sc/obj.data", len(data))
        sink.write_at(0, memoryview(data))
        sink.close()
        for start, lens in ((0, [len(data)]), (7, [PS - 3, 1, 0, 4096, PS - 4200]), (PS + 1, [3, PS - 5, 100])):
            bufs = [memoryview(bytearray(n)) for n in lens]
            tier.read_ranges("sc/obj.data", start, bufs)
            at = start
            for b in bufs:
                assert bytes(b) == data[at : at + len(b)], (start, lens)
                at += len(b)

    @pytest.mark.parametrize("size", [0, 1000, 3 * PS + 4097], ids=lambda s: f"size{s}")
    def test_copy_from_local_bit_exact(self, tier: Tier, tmp_path: Path, size: int) -> None:
        """Promotion's path: a file committed on a local tier copied here under the same key."""
        src = LocalTier(tmp_path / f"copy-src-{size}", fsync=True)
        data = _data(size, 6)
        key = f"cp-{size}/_00/rank-0.data"
        sink = src.open_sink(key, size)
        sink.write_at(0, memoryview(data))
        sink.close()
        assert tier.copy_from(src, key) == size
        assert tier.size(key) == size and tier.get(key) == data
        assert not self.leftover_partials(tier)

    def test_put_roundtrip_and_if_absent(self, tier: Tier) -> None:
        tier.put("pc/commit.json", b'{"ok": 1}', if_absent=True)
        with pytest.raises(CommitConflict):
            tier.put("pc/commit.json", b'{"ok": 2}', if_absent=True)
        assert tier.get("pc/commit.json") == b'{"ok": 1}'


class TierContract(BitExactContract):
    """The full contract."""

    def test_put_get_roundtrip(self, tier: Tier) -> None:
        for key, data in (("a/small.json", b'{"x": 1}'), ("a/empty", b""), ("a/bin", _data(100_000, 4))):
            tier.put(key, data)
            assert tier.get(key) == data
            assert tier.size(key) == len(data)
            assert tier.exists(key)
        tier.put("a/small.json", b"replaced")
        assert tier.get("a/small.json") == b"replaced"

    def test_ranged_get(self, tier: Tier) -> None:
        data = _data(100, 5)
        tier.put("r/obj", data)
        assert tier.get("r/obj", 10, 20) == data[10:20]
        assert tier.get("r/obj", 0, 1) == data[:1]
        assert tier.get("r/obj", 99, 100) == data[99:]
        assert tier.get("r/obj", 30) == data[30:]
        assert tier.get("r/obj", 0, 100) == data
        assert tier.get("r/obj", 5, 5) == b""
        assert tier.get("r/obj", 100) == b""

    def test_get_past_end_is_corrupt(self, tier: Tier) -> None:
        tier.put("pe/obj", _data(100, 6))
        for start, end in ((50, 101), (100, 150), (200, None), (-1, 10), (20, 10)):
            with pytest.raises(CorruptCheckpoint):
                tier.get("pe/obj", start, end)
        with pytest.raises(CorruptCheckpoint):
            tier.read_into("pe/obj", 90, memoryview(bytearray(20)))

    def test_missing_key(self, tier: Tier) -> None:
        assert not tier.exists("nope/x")
        with pytest.raises(CheckpointNotFound):
            tier.get("nope/x")
        with pytest.raises(CheckpointNotFound):
            tier.get("nope/x", 0, 10)
        with pytest.raises(CheckpointNotFound):
            tier.size("nope/x")
        with pytest.raises(CheckpointNotFound):
            tier.read_into("nope/x", 0, memoryview(bytearray(4)))

    def test_sink_abort_leaves_nothing(self, tier: Tier) -> None:
        size = 2 * PS + 11
        data = _data(size, 7)
        sink = tier.open_sink("ab/rank-0.data", size)
        sink.write_at(0, memoryview(data)[: PS + 100])  # part 1 uploaded, part 2 buffered
        assert not tier.exists("ab/rank-0.data")
        sink.abort()
        sink.abort()  # idempotent
        assert not tier.exists("ab/rank-0.data")
        assert [i.key for i in tier.list("ab/")] == []
        assert self.leftover_partials(tier) == []

    def test_sink_rejects_out_of_range_write(self, tier: Tier) -> None:
        sink = tier.open_sink("oor/obj", 10)
        try:
            with pytest.raises(CorruptCheckpoint):
                sink.write_at(5, memoryview(b"x" * 6))
        finally:
            sink.abort()

    def test_list(self, tier: Tier) -> None:
        objs = {"ckpt-1/a": 3, "ckpt-1/sub/b": 5, "ckpt-2/c": 7, "top": 1}
        for k, n in objs.items():
            tier.put(k, b"z" * n)
        t0 = time.time()
        infos = {i.key: i for i in tier.list()}
        assert {k: i.size for k, i in infos.items()} == objs
        assert all(abs(i.mtime - t0) < 3600 for i in infos.values())
        assert sorted(i.key for i in tier.list("ckpt-1/")) == ["ckpt-1/a", "ckpt-1/sub/b"]
        assert sorted(i.key for i in tier.list("ckpt-1/sub/")) == ["ckpt-1/sub/b"]
        assert list(tier.list("none/")) == []
        assert tier.list_dirs() == ["ckpt-1", "ckpt-2"]

    def test_delete_and_delete_prefix(self, tier: Tier) -> None:
        for k in ("ckpt-1/a", "ckpt-1/sub/b", "ckpt-2/c", "top"):
            tier.put(k, b"data")
        tier.delete("top")
        tier.delete("top")  # missing is fine
        assert not tier.exists("top")
        with pytest.raises(ValueError):
            tier.delete_prefix("ckpt-1")
        assert tier.delete_prefix("ckpt-1/") == 2
        assert sorted(i.key for i in tier.list()) == ["ckpt-2/c"]
        assert tier.list_dirs() == ["ckpt-2"]
        assert tier.delete_prefix("ckpt-9/") == 0

    def test_delete_many_removes_exactly_the_listed_keys(self, tier: Tier) -> None:
        """What retention relies on: objects created under the same prefix after the listing stay."""
        for k in ("c-1/a", "c-1/sub/b", "c-1/c"):
            tier.put(k, b"old")
        listed = [i.key for i in tier.list("c-1/")]
        tier.put("c-1/new", b"arrived after the listing")
        assert tier.delete_many(listed + ["c-1/missing"]) >= len(listed)
        assert [i.key for i in tier.list("c-1/")] == ["c-1/new"]
        assert tier.get("c-1/new") == b"arrived after the listing"
        assert tier.delete_many([]) == 0

    def test_put_volatile_and_free_bytes(self, tier: Tier) -> None:
        tier.put_volatile("_leases/c-1/read-1.json", b"{}")
        tier.put_volatile("_leases/c-1/read-1.json", b'{"a": 1}')  # replaces
        assert tier.get("_leases/c-1/read-1.json") == b'{"a": 1}'
        tier.delete("_leases/c-1/read-1.json")
        assert list(tier.list("_leases/")) == []
        free = tier.free_bytes()
        assert free is None or free > 0

    def test_delete_prefix_many(self, tier: Tier) -> None:
        keys = [f"many/k{i:04d}" for i in range(60)]
        for k in keys:
            tier.put(k, b"1")
        assert tier.delete_prefix("many/") == len(keys)
        assert list(tier.list("many/")) == []

    def test_hostile_keys_rejected(self, tier: Tier) -> None:
        for key in ("../x", "/abs", "a//b", "a/../b", "a\\b", "", "x/"):
            ops: list[Callable[[], object]] = [
                lambda: tier.put(key, b"x"),
                lambda: tier.put(key, b"x", if_absent=True),
                lambda: tier.get(key),
                lambda: tier.get(key, 0, 0),
                lambda: tier.read_into(key, 0, memoryview(bytearray(1))),
                lambda: tier.open_sink(key, 10),
                lambda: tier.exists(key),
                lambda: tier.size(key),
                lambda: tier.delete(key),
            ]
            for op in ops:
                with pytest.raises(CorruptCheckpoint):
                    op()
        assert list(tier.list()) == []

    # -- resumable sinks (open_resumable) and wait_deletions -----------------------------------
    def _resumable_written(self, tier: Tier, key: str, data: bytes, blocks: list[int], tag: dict) -> set[int]:
        """Open, write ``blocks``, suspend; return what a reopen with the same tag has recorded."""
        sink = tier.open_resumable(key, len(data), block=PS, tag=tag)
        assert sink.recorded == set() and sink.blocks() == 3
        for i in blocks:
            s, e = sink.span(i)
            sink.write_block(i, memoryview(data[s:e]))
        with pytest.raises(TierError, match="being written"):
            tier.open_resumable(key, len(data), block=PS, tag=tag)  # one writer per key
        assert not tier.exists(key)
        sink.suspend()
        assert not tier.exists(key)
        again = tier.open_resumable(key, len(data), block=PS, tag=tag)
        try:
            return set(again.recorded)
        finally:
            again.suspend()

    def test_resumable_sink_resumes_and_closes(self, tier: Tier) -> None:
        data = _data(2 * PS + 7, 11)
        key = "res/rank-0.data"
        recorded = self._resumable_written(tier, key, data, [0, 2], {"save": "a"})
        assert recorded <= {0, 2}
        sink = tier.open_resumable(key, len(data), block=PS, tag={"save": "a"})
        assert sink.recorded == recorded
        for i in sorted(recorded):
            s, e = sink.span(i)
            buf = bytearray(e - s)
            sink.read_block(i, memoryview(buf))
            assert bytes(buf) == data[s:e]
        sink.keep(set(recorded))
        with pytest.raises(CorruptCheckpoint, match="never written"):
            sink.close()  # a block is missing: refused, the sink stays usable
        for i in range(sink.blocks()):
            if i not in sink.recorded:
                s, e = sink.span(i)
                sink.write_block(i, memoryview(data[s:e]))
        assert not tier.exists(key)
        sink.close()
        assert tier.get(key) == data
        assert self.leftover_partials(tier) == []
        assert [i.key for i in tier.list("res/")] == [key]

    def test_resumable_sink_other_tag_starts_over_and_abort_leaves_nothing(self, tier: Tier) -> None:
        data = _data(2 * PS + 7, 12)
        key = "res2/rank-0.data"
        self._resumable_written(tier, key, data, [1], {"save": "a"})
        sink = tier.open_resumable(key, len(data), block=PS, tag={"save": "b"})
        assert sink.recorded == set()
        sink.write_block(0, memoryview(data[:PS]))
        sink.abort()
        assert not tier.exists(key)
        assert self.leftover_partials(tier) == []
        assert list(tier.list("res2/")) == []

    def test_resumable_sink_adopts_an_existing_object(self, tier: Tier) -> None:
        old = _data(2 * PS + 7, 13)
        new = _data(2 * PS + 7, 14)
        key = "res3/rank-0.data"
        sink0 = tier.open_sink(key, len(old))
        sink0.write_at(0, memoryview(old))
        sink0.close()
        sink = tier.open_resumable(key, len(new), block=PS, tag={"save": "a"}, adopt=True)
        assert sink.recorded <= {0, 1, 2}
        sink.keep(sink.recorded & {0})
        kept = set(sink.recorded)
        for i in range(sink.blocks()):
            if i not in kept:
                s, e = sink.span(i)
                sink.write_block(i, memoryview(new[s:e]))
        sink.close()
        want = (old[:PS] if 0 in kept else new[:PS]) + new[PS:]
        assert tier.get(key) == want
        assert self.leftover_partials(tier) == []

    def test_empty_resumable_object(self, tier: Tier) -> None:
        sink = tier.open_resumable("res4/empty.data", 0, block=PS)
        assert sink.blocks() == 0
        sink.close()
        assert tier.exists("res4/empty.data") and tier.size("res4/empty.data") == 0

    def test_wait_deletions(self, tier: Tier) -> None:
        for i in range(3):
            tier.put(f"del/x{i}", b"abc")
        tier.delete_prefix("del/")
        tier.wait_deletions()
        assert list(tier.list("del/")) == []


# -- the tiers ---------------------------------------------------------------------------------


class TestLocalTier(TierContract):
    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[Tier]:
        t = LocalTier(tmp_path / "root", fsync=False)
        yield t
        t.close()

    def leftover_partials(self, tier: Tier) -> list[str]:
        root = Path(tier.url)
        return [str(p) for p in root.rglob("*") if p.name.endswith(".partial") or p.name.startswith(".tmp-")]

    def test_resumable_sink_records_exactly_what_landed(self, tier: Tier) -> None:
        """The local tier keeps partial objects across processes: a reopen resumes every written
        block, and an adopted object has every block recorded."""
        data = _data(2 * PS + 7, 15)
        assert self._resumable_written(tier, "loc/rank-0.data", data, [0, 2], {"save": "a"}) == {0, 2}
        sink = tier.open_resumable("loc/rank-0.data", len(data), block=PS, tag={"save": "a"})
        sink.write_block(1, memoryview(data[PS : 2 * PS]))
        sink.close()
        sink = tier.open_resumable("loc/rank-0.data", len(data), block=PS, tag={"save": "x"}, adopt=True)
        assert sink.recorded == {0, 1, 2} and not tier.exists("loc/rank-0.data")
        sink.close()
        assert tier.get("loc/rank-0.data") == data


class _S3Base:
    direct: Any = None

    def leftover_partials(self, tier: Tier) -> list[str]:
        assert isinstance(tier, S3Tier)
        resp = self.direct.list_multipart_uploads(Bucket=tier.bucket, Prefix=tier.prefix + "/")
        return [u["Key"] for u in resp.get("Uploads", []) or []]


class TestS3Moto(_S3Base, TierContract):
    @pytest.fixture(params=["none", "zstd"])
    def tier(self, request: pytest.FixtureRequest, moto_endpoint: str, s3cfg: Callable[..., Any]) -> Iterator[Tier]:
        """Also with compression on: encoding changes what a hop stores, never the primitives."""
        self.direct = s3_client(moto_endpoint)
        t = S3Tier(s3cfg(moto_endpoint, compression=request.param, copy_unchanged=request.param != "none"))
        yield t
        t.close()


class TestS3SeaweedFS(_S3Base, TierContract):
    @pytest.fixture
    def tier(self, seaweed_endpoint: str, s3cfg: Callable[..., Any]) -> Iterator[Tier]:
        self.direct = s3_client(seaweed_endpoint)
        t = S3Tier(s3cfg(seaweed_endpoint))
        yield t
        t.close()


@pytest.fixture(scope="module")
def faulty_proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    with FaultProxy(moto_endpoint, error_rate=0.10, drop_rate=0.05, seed=1234) as proxy:
        yield proxy


class TestS3MotoFaults(_S3Base, BitExactContract):
    """Bit-exactness through 10% injected 500/503s and 5% dropped connections."""

    @pytest.fixture
    def tier(self, moto_endpoint: str, s3cfg: Callable[..., Any], faulty_proxy: FaultProxy) -> Iterator[Tier]:
        self.direct = s3_client(moto_endpoint)
        t = S3Tier(s3cfg(moto_endpoint, endpoint_url=faulty_proxy.url, max_attempts=10, read_timeout=5.0))
        yield t
        t.close()

    def test_faults_were_injected(self, tier: Tier, faulty_proxy: FaultProxy) -> None:
        for i in range(40):
            tier.put(f"f/k{i}", b"v" * i)
        assert sorted(i.key for i in tier.list("f/")) == sorted(f"f/k{i}" for i in range(40))
        s = faulty_proxy.stats
        assert s["errors"] > 0 and s["drops"] > 0, s


# -- S3-only -----------------------------------------------------------------------------------


@pytest.fixture
def outage_proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    with FaultProxy(moto_endpoint, error_rate=0.0, drop_rate=0.0, seed=1) as proxy:
        yield proxy


def _outage_tier(s3cfg: Callable[..., Any], moto_endpoint: str, proxy: FaultProxy) -> S3Tier:
    return S3Tier(s3cfg(moto_endpoint, endpoint_url=proxy.url, max_attempts=2, connect_timeout=1.0, read_timeout=3.0))


@pytest.mark.parametrize("mode", ["503", "reset"])
def test_outage_fails_bounded_and_leaves_nothing(
    moto_endpoint: str, s3cfg: Callable[..., Any], outage_proxy: FaultProxy, mode: str
) -> None:
    tier = _outage_tier(s3cfg, moto_endpoint, outage_proxy)
    direct = s3_client(moto_endpoint)
    size = 2 * PS + 5
    data = _data(size, 8)
    sink = tier.open_sink("out/rank-0.data", size)  # the multipart upload exists
    outage_proxy.outage_mode = mode
    outage_proxy.outage = True
    t0 = time.monotonic()
    with pytest.raises(TierError) as ei:
        sink.write_at(0, memoryview(data)[:PS])
    assert time.monotonic() - t0 < 30
    msg = str(ei.value)
    assert "s3://" in msg and "out/rank-0.data" in msg and "part 1" in msg
    with pytest.raises(TierError):
        sink.close()  # fails (and its own abort cannot reach the server)
    t0 = time.monotonic()
    with pytest.raises(TierError):
        tier.put("out/commit", b"x", if_absent=True)
    with pytest.raises(TierError):
        tier.get("out/rank-0.data", 0, 10)
    assert time.monotonic() - t0 < 60
    outage_proxy.outage = False
    sink.abort()  # reaches the server now
    assert not tier.exists("out/rank-0.data")
    assert direct.list_multipart_uploads(Bucket=tier.bucket, Prefix="ckpt/out/").get("Uploads") in (None, [])
    tier.close()


def test_outage_during_upload_file_then_abort_stale(
    moto_endpoint: str, s3cfg: Callable[..., Any], outage_proxy: FaultProxy, tmp_path: Path
) -> None:
    tier = _outage_tier(s3cfg, moto_endpoint, outage_proxy)
    direct = s3_client(moto_endpoint)
    src = tmp_path / "big.bin"
    src.write_bytes(_data(2 * PS + 1, 9))
    done: list[int] = []

    def progress(n: int) -> None:
        done.append(n)
        outage_proxy.outage = True  # the outage starts after the first part

    with pytest.raises(TierError):
        tier.upload_file("up/big.data", str(src), progress=progress)
    outage_proxy.outage = False
    assert not tier.exists("up/big.data")
    # upload_file's own abort may not have reached the server; the sweep finds the upload.
    tier.abort_stale_uploads("up/")
    assert direct.list_multipart_uploads(Bucket=tier.bucket, Prefix="ckpt/").get("Uploads") in (None, [])
    tier.close()


def test_if_none_match_unsupported_falls_back(
    moto_endpoint: str, s3cfg: Callable[..., Any], outage_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    outage_proxy.reject_if_none_match = True
    tier = S3Tier(s3cfg(moto_endpoint, endpoint_url=outage_proxy.url))
    tier.put("c/commit", b"one", if_absent=True)
    assert outage_proxy.stats["rejected_conditional"] == 1
    with pytest.raises(CommitConflict) as ei:
        tier.put("c/commit", b"two", if_absent=True)
    assert "s3://" in str(ei.value) and "c/commit" in str(ei.value)
    assert outage_proxy.stats["rejected_conditional"] == 1  # the fallback is remembered
    assert tier.get("c/commit") == b"one"
    assert any("If-None-Match" in r.getMessage() for r in caplog.records)
    tier.close()


def test_abort_stale_uploads(moto_endpoint: str, s3cfg: Callable[..., Any]) -> None:
    tier = S3Tier(s3cfg(moto_endpoint))
    for i in range(3):
        tier.client.create_multipart_upload(Bucket=tier.bucket, Key=f"ckpt/st/k{i}")
    tier.client.create_multipart_upload(Bucket=tier.bucket, Key="ckpt/other/k")
    busy = tier.client.create_multipart_upload(Bucket=tier.bucket, Key="ckpt/busy/k")["UploadId"]
    tier.client.upload_part(Bucket=tier.bucket, Key="ckpt/busy/k", UploadId=busy, PartNumber=1, Body=b"x")
    assert tier.abort_stale_uploads("st/") == 3
    # "other" is idle (moto dates every initiation 2010); "busy" just received a part: kept.
    assert tier.abort_stale_uploads("", older_than_s=600) == 1
    assert tier.abort_stale_uploads("", older_than_s=0) == 1
    assert tier.abort_stale_uploads() == 0
    tier.close()


def test_effective_part_size() -> None:
    assert effective_part_size(100 * MiB, 8 * MiB) == 8 * MiB
    assert effective_part_size(8 * MiB * MAX_PARTS, 8 * MiB) == 8 * MiB
    grown = effective_part_size(8 * MiB * MAX_PARTS + 1, 8 * MiB)
    assert grown % MiB == 0 and grown > 8 * MiB
    assert -(-(8 * MiB * MAX_PARTS + 1) // grown) <= MAX_PARTS
    big = 4 * 1024**4  # 4 TiB with 5 MiB parts
    ps = effective_part_size(big, 5 * MiB)
    assert ps % MiB == 0 and -(-big // ps) <= MAX_PARTS
    with pytest.raises(TierError):
        effective_part_size(60 * 1024**4, 5 * MiB)


def test_url_and_no_credentials_in_repr_or_messages(
    moto_endpoint: str, s3cfg: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "SeCrEt-" + os.urandom(6).hex()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIATESTKEYID")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    cfg = s3cfg(moto_endpoint, prefix="jobs/run-1/")
    tier = S3Tier(cfg)
    assert tier.url == f"s3://{cfg.bucket}/jobs/run-1"
    assert tier.name == "s3"
    texts = [repr(tier), str(vars(tier).get("cfg"))]
    with pytest.raises(CheckpointNotFound) as e1:
        tier.get("x/y")
    texts.append(str(e1.value))
    assert f"s3://{cfg.bucket}/jobs/run-1/x/y" in str(e1.value)
    tier.put("x/y", b"1")
    assert direct_keys(moto_endpoint, cfg.bucket) == ["jobs/run-1/x/y"]
    with pytest.raises(CommitConflict) as e2:
        tier.put("x/y", b"2", if_absent=True)
    texts.append(str(e2.value))
    assert not any(secret in t or "AKIATESTKEYID" in t for t in texts)
    tier.close()


def direct_keys(endpoint: str, bucket: str) -> list[str]:
    resp = s3_client(endpoint).list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def test_upload_file_interrupted_aborts(moto_endpoint: str, s3cfg: Callable[..., Any], tmp_path: Path) -> None:
    tier = S3Tier(s3cfg(moto_endpoint, concurrency=2))
    src = tmp_path / "big.bin"
    src.write_bytes(_data(3 * PS, 10))

    def progress(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tier.upload_file("ki/big.data", str(src), progress=progress)
    assert not tier.exists("ki/big.data")
    uploads = s3_client(moto_endpoint).list_multipart_uploads(Bucket=tier.bucket, Prefix="ckpt/")
    assert uploads.get("Uploads") in (None, [])
    tier.close()


def test_faultproxy_relays_keepalive_chunked_head_and_stalls(seaweed_endpoint: str) -> None:
    import http.client

    make = s3_client(seaweed_endpoint)
    make.create_bucket(Bucket="proxy-selftest")
    with FaultProxy(seaweed_endpoint, error_rate=0.0, drop_rate=0.0, stall_rate=1.0, stall_s=0.05) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]), timeout=10)
        conn.putrequest("PUT", "/proxy-selftest/obj")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        conn.send(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        conn.request("HEAD", "/proxy-selftest/obj")
        r = conn.getresponse()
        assert r.read() == b"" and r.getheader("Content-Length") == "11"
        conn.request("PUT", "/proxy-selftest/obj2", body=b"x" * 100_000, headers={"Expect": "100-continue"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        conn.request("GET", "/proxy-selftest/obj")
        assert conn.getresponse().read() == b"hello world"
        assert proxy.stats["connections"] == 1 and proxy.stats["requests"] == 4  # one keep-alive connection
        assert proxy.stats["stalls"] == 4
        proxy.stall_rate, proxy.error_rate = 0.0, 1.0
        conn.request("GET", "/proxy-selftest/obj")
        r = conn.getresponse()
        body = r.read()
        assert r.status in (500, 503) and b"<Code>" in body and proxy.stats["errors"] == 1
        conn.close()


def test_abort_stale_spares_leased_uploads_under_shard_prefixes(moto_endpoint: str, s3cfg: Callable[..., Any]) -> None:
    """Data files live under ``_XX/ID/``: a leased checkpoint's upload there is spared (the spare
    check once read ``_01`` as the checkpoint id and aborted a save in flight: a torchtitan run on
    CI lost step-6 of rank 1 to rank 0's retention)."""
    from tierckpt.format.layout import data_key

    tier = S3Tier(s3cfg(moto_endpoint))
    key = "ckpt/" + data_key("step-6", "rank-00001-c30a3de5.data")
    up = tier.client.create_multipart_upload(Bucket=tier.bucket, Key=key)["UploadId"]
    assert tier.abort_stale(600.0, spare={"step-6"}) == 0
    left = tier.client.list_multipart_uploads(Bucket=tier.bucket, Prefix="ckpt/").get("Uploads") or []
    assert [u["UploadId"] for u in left] == [up]
    assert tier.abort_stale(600.0, spare={"step-4"}) == 1  # not leased: moto dates it 2010, so stale
    tier.close()


def test_abort_stale_reads_spare_after_listing_uploads(moto_endpoint: str, s3cfg: Callable[..., Any]) -> None:
    """A save takes its lease, then starts its upload. A sweep that read the leases before listing
    the uploads could see the upload but not the lease; ``spare`` given as a callable is read after
    the listing, so an upload it lists had its lease taken before the leases were read."""
    tier = S3Tier(s3cfg(moto_endpoint))
    key = "ckpt/_00/step-8/rank-00000.data"

    def leases_read_then_save_starts() -> set[str]:
        if not started:
            started.append(tier.client.create_multipart_upload(Bucket=tier.bucket, Key=key)["UploadId"])
        return set()  # read before the save's lease existed

    started: list[str] = []
    assert tier.abort_stale(600.0, spare=leases_read_then_save_starts) == 0
    assert started  # spare was read
    left = tier.client.list_multipart_uploads(Bucket=tier.bucket, Prefix="ckpt/").get("Uploads") or []
    assert [u["UploadId"] for u in left] == started
    tier.close()


def test_local_list_skips_lost_and_found_of_a_mount_point(tmp_path: Path) -> None:
    """A tier placed at a file system's root holds ext4's ``lost+found`` (root's, mode 0700): it is
    not a checkpoint, and a user who cannot read it still lists the tier (an unreadable directory
    elsewhere is an error naming it)."""
    (tmp_path / "lost+found").mkdir()
    (tmp_path / "lost+found" / "#12345").write_bytes(b"x")
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / "metadata.json").write_bytes(b"{}")
    assert [o.key for o in LocalTier(str(tmp_path)).list()] == ["step-1/metadata.json"]
