"""The commit protocol and one hop of the chain, as a contract every tier passes.

:class:`ChainContract` runs :func:`tierckpt.commit.run_commit` with several simulated ranks
(threads sharing one in-process :class:`~tierckpt.commit.LocalChannel`) on a tier wrapped in a
:class:`~tierckpt.testing.faults.FaultyTier`, failing each step of the protocol in turn: a rank's
own work, the coordinator's merge, the metadata write, an id already committed, a rank that
never reports (killed). Each time: nothing is committed, every rank fails with a message naming
the checkpoint, and (for failures that raise) nothing is left in the channel. It also checks
:meth:`Tier.copy_from` (a hop's copy) and the encoded copy of :mod:`tierckpt.codec` (compression
``zstd`` and ``none``, unchanged frames copied from the previous object through
:meth:`Tier.open_stream`): bit-exact, and nothing visible after a failed copy.

Each ``Test*`` subclass supplies the ``tier`` fixture: the local tier and S3 on moto here; the
throwaway third tier in ``tests/test_third_tier.py``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tierckpt.chain.commit import LocalChannel, Round, run_commit
from tierckpt.codec import add_stored
from tierckpt.codec.hop import Previous, copy_encoded
from tierckpt.codec.view import decoding
from tierckpt.errors import CommitConflict, CommitError, TierckptError, TierError
from tierckpt.testing import FaultyTier
from tierckpt.tiers.base import Encoding, Tier
from tierckpt.tiers.local import LocalTier

WORLD = 3
MD = b'{"metadata": "merged"}'


def _run_ranks(
    tier: Tier,
    cid: str,
    *,
    writer: Callable[[int], int] = lambda r: 0,
    work_fail: int | None = None,
    merge_fail: bool = False,
    silent: int | None = None,
    timeout: float = 20.0,
    channel: LocalChannel | None = None,
) -> tuple[dict[int, Any], LocalChannel]:
    """Run the protocol for ``cid`` on WORLD rank threads; return each rank's result or error."""
    ch = channel or LocalChannel()
    out: dict[int, Any] = {}

    def rank(r: int) -> None:
        rnd = Round(ch, "tok", "0-test", r, WORLD, timeout, f"checkpoint {cid}")

        def work() -> dict:
            if r == work_fail:
                raise OSError(28, "No space left on device (injected)")
            data = bytes([r]) * 1000
            sink = tier.open_sink(f"{cid}/rank-{r:05d}.data", len(data))
            sink.write_at(0, memoryview(data))
            sink.close()
            return {"size": len(data), "seq": r}

        def merge(reports: list[dict]) -> bytes:
            if merge_fail:
                raise TierckptError(f"checkpoint {cid}: merging failed (injected)")
            assert [rep["size"] for rep in reports] == [1000] * WORLD
            return MD

        try:
            out[r] = run_commit(rnd, tier, f"{cid}/metadata.json", work=work, writer=writer(r), merge=merge)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD) if r != silent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out, ch


class ChainContract:
    @pytest.fixture
    def tier(self) -> Iterator[Tier]:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def faulty(self, tier: Tier) -> FaultyTier:
        return FaultyTier(tier)

    def test_commit_all_ranks(self, faulty: FaultyTier) -> None:
        out, ch = _run_ranks(faulty, "c-ok")
        assert out == {r: MD for r in range(WORLD)}
        assert faulty.get("c-ok/metadata.json") == MD
        assert ch.keys() == []

    def test_commit_writer_not_rank0(self, faulty: FaultyTier) -> None:
        out, ch = _run_ranks(faulty, "c-w1", writer=lambda r: 1)
        assert out == {r: MD for r in range(WORLD)}
        assert faulty.get("c-w1/metadata.json") == MD
        assert ch.keys() == []

    @pytest.mark.parametrize("step", ["work0", "work2", "merge", "put", "write", "close"])
    def test_failure_at_each_step_commits_nothing(self, faulty: FaultyTier, step: str) -> None:
        cid = f"c-{step}"
        kw: dict[str, Any] = {}
        if step.startswith("work"):
            kw["work_fail"] = int(step[-1])
        elif step == "merge":
            kw["merge_fail"] = True
        elif step == "put":
            faulty.arm("put", TierError(5, "I/O error (injected)"), match="metadata.json")
        elif step == "write":
            faulty.arm("write_at", TierError(28, "No space left on device (injected)"), match="rank-00001")
        elif step == "close":
            faulty.arm("sink_close", TierError(5, "fsync failed (injected)"), match="rank-00002")
        out, ch = _run_ranks(faulty, cid, **kw)
        assert set(out) == set(range(WORLD))
        for r, res in out.items():
            assert isinstance(res, (TierckptError, OSError)), (r, res)
            assert isinstance(res, OSError) or cid in str(res), (r, res)
        faulty.disarm()
        assert not faulty.exists(f"{cid}/metadata.json")
        assert ch.keys() == [], ch.keys()

    def test_already_committed_is_never_overwritten(self, faulty: FaultyTier) -> None:
        faulty.put("c-dup/metadata.json", b'{"another": "save"}')
        out, ch = _run_ranks(faulty, "c-dup")
        assert isinstance(out[0], CommitConflict)
        assert all(isinstance(out[r], CommitError) for r in range(1, WORLD))
        assert faulty.get("c-dup/metadata.json") == b'{"another": "save"}'
        assert ch.keys() == []

    def test_killed_rank_commits_nothing(self, faulty: FaultyTier) -> None:
        """A rank that dies without a word: the others fail within the timeout, nothing commits.
        (Its job is over, and the store with it, so its keys are not the survivors' to clean.)"""
        out, _ch = _run_ranks(faulty, "c-dead", silent=1, timeout=1.0)
        assert set(out) == {0, 2}
        assert all(isinstance(res, CommitError) and "c-dead" in str(res) for res in out.values()), out
        assert not faulty.exists("c-dead/metadata.json")

    def test_hop_retried_after_a_crash_is_idempotent(self, faulty: FaultyTier) -> None:
        """A later hop re-run after its metadata landed (crash before the outcome was seen): an
        identical metadata counts as committed, a different one is a conflict."""
        faulty.put("c-hop/metadata.json", MD)
        ch = LocalChannel()
        rnd = Round(ch, "tok", "1-test", 0, 1, 10.0, "checkpoint c-hop")
        assert (
            run_commit(
                rnd, faulty, "c-hop/metadata.json", work=lambda: {"size": 0}, writer=0, metadata=MD, same_ok=True
            )
            == MD
        )
        rnd = Round(ch, "tok2", "1-test", 0, 1, 10.0, "checkpoint c-hop")
        with pytest.raises(CommitConflict):
            run_commit(
                rnd, faulty, "c-hop/metadata.json", work=lambda: {"size": 0}, writer=0, metadata=b"{}", same_ok=True
            )
        assert ch.keys() == []

    @pytest.mark.parametrize("size", [0, 1, (3 << 20) + 5, (11 << 20) + 3])
    def test_copy_from_bit_exact(self, tier: Tier, tmp_path: Path, size: int) -> None:
        src = LocalTier(tmp_path / "src", fsync=False)
        data = os.urandom(size)
        src.put("h/rank-00000.data", data)
        assert tier.copy_from(src, "h/rank-00000.data") == size
        assert tier.get("h/rank-00000.data") == data

    def test_failed_copy_leaves_nothing(self, faulty: FaultyTier, tmp_path: Path) -> None:
        src = FaultyTier(LocalTier(tmp_path / "src", fsync=False))
        src.put("h/rank-00000.data", os.urandom((11 << 20) + 3))
        src.arm("read_into", TierError(5, "read error (injected)"))
        with pytest.raises(TierError, match="injected"):
            faulty.copy_from(src, "h/rank-00000.data")
        assert not faulty.exists("h/rank-00000.data")

    @pytest.mark.parametrize("compression", ["zstd", "none"])
    def test_encoded_copy_bit_exact_with_unchanged_frames(self, tier: Tier, tmp_path: Path, compression: str) -> None:
        src = LocalTier(tmp_path / "src", fsync=False)
        frame = 1 << 20
        data = bytearray(os.urandom(11 << 20) + bytes(3 << 20) + b"tail")  # random frames stay raw, zeros code
        runs = [(0, len(data), 4)]
        enc = Encoding(compression, 1, True)
        src.put("_00/e-1/rank-00000.data", bytes(data))
        idx1, _ = copy_encoded(
            src, tier, "_00/e-1/rank-00000.data", size=len(data), frame=frame, runs=runs, encoding=enc
        )
        data[5] ^= 0xFF  # frame 0 changes; 13 MiB do not
        src.put("_00/e-2/rank-00000.data", bytes(data))
        prev = Previous("e-1", "_00/e-1/rank-00000.data", idx1)
        idx2, figs = copy_encoded(
            src, tier, "_00/e-2/rank-00000.data", size=len(data), frame=frame, runs=runs, encoding=enc, prev=prev
        )
        assert figs.frames_copied == idx2.frames - 1
        assert figs.uploaded + figs.copied == idx2.stored
        from test_codec import _fake_md

        for cid, ix in (("e-1", idx1), ("e-2", idx2)):
            tier.put(f"{cid}/metadata.json", add_stored(_fake_md(cid, len(data)), {"rank-00000.data": ix}))
        assert tier.size("_00/e-2/rank-00000.data") == idx2.stored
        if tier.may_encode:
            assert decoding(tier, "e-2").get("_00/e-2/rank-00000.data") == bytes(data)

    def test_failed_encoded_copy_leaves_nothing(self, faulty: FaultyTier, tmp_path: Path) -> None:
        src = FaultyTier(LocalTier(tmp_path / "src", fsync=False))
        src.put("h/rank-00000.data", os.urandom((11 << 20) + 3))
        src.arm("read_into", TierError(5, "read error (injected)"), skip=5)
        with pytest.raises(TierError, match="injected"):
            copy_encoded(
                src,
                faulty,
                "h/rank-00000.data",
                size=(11 << 20) + 3,
                frame=1 << 20,
                runs=[],
                encoding=Encoding("zstd", 1, False),
            )
        assert not faulty.exists("h/rank-00000.data")


class TestChainLocal(ChainContract):
    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[Tier]:
        t = LocalTier(tmp_path / "root", fsync=False)
        yield t
        t.close()


class TestChainS3Moto(ChainContract):
    @pytest.fixture(params=["none", "zstd"])
    def tier(self, request: pytest.FixtureRequest, moto_endpoint: str, s3cfg: Callable[..., Any]) -> Iterator[Tier]:
        from tierckpt.tiers.s3 import S3Tier

        t = S3Tier(s3cfg(moto_endpoint, compression=request.param, copy_unchanged=request.param != "none"))
        yield t
        t.close()
