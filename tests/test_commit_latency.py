"""A commit costs the commit, not a sweep of the tier (issue #32, item 8).

A job saving every step through one local tier fell further and further behind: after each
commit the commit thread also ran the tier's retention (list every checkpoint, read every lease,
walk for leftovers), whose cost grows with the saves captured but not committed yet, so commits
slowed as they fell behind (first commit after 6 s, then one a second, 300 steps behind). Now
the commit thread only commits; retention runs on a thread of its own, one pass for whatever
committed meanwhile, and a job is settled (``wait()`` returns) only after a pass that saw it.

The first commit also waited for the host pool: its first touch (1 GiB by default: 4-8 s on a
loaded 2-core VM) ran whole before the first slot was handed out, so a job killed in its first
seconds had nothing committed. Now the touch up front stops once a save waits, and each slot
not touched yet is touched by its first acquire.

Behaviour only, no timing: the commit thread lists nothing and reads no lease; a retention pass
held back holds back no commit; held-back passes are served together; ``wait()`` still means
retention ran; a save made while the pool is being touched commits with most of it untouched.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt import HostConfig, LocalConfig, TierConfig, TieredWriter, loading
from tierckpt.catalog.listing import committed_in_order
from tierckpt.testing import bits

MiB = 1 << 20

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _cfg(tmp_path, keep: int) -> TierConfig:
    return TierConfig(
        host=HostConfig(buffer_size=4 * MiB, chunk_size=1 * MiB),
        local=LocalConfig(path=str(tmp_path / "ckpt"), keep=keep, fsync=False),
    )


def _state(step: int) -> dict:
    return {
        "w": bits((MiB // 4,), torch.float32, seed=step),
        "b": bits((3, 5), torch.bfloat16, seed=step),
        "step": step,
    }


@pytest.fixture
def writer(tmp_path) -> Any:
    made: list[TieredWriter] = []

    def make(keep: int) -> TieredWriter:
        w = TieredWriter(_cfg(tmp_path, keep))
        made.append(w)
        return w

    yield make
    for w in made:
        w.engine.close()


def _save_every_step(w: TieredWriter, steps: range) -> list:
    """``dcp.save`` + ``wait_captured()`` per step, as a save-every-step loop does; the jobs."""
    jobs = []
    for s in steps:
        dcp.save(_state(s), checkpoint_id=f"step-{s}", storage_writer=w, no_dist=True)
        w.wait_captured()
        jobs.append(w.last)
    return jobs


def _on_thread(obj: Any, name: str, thread: str, calls: list[str]) -> None:
    """Record each call of ``obj.name`` made on the thread named ``thread``."""
    real = getattr(obj, name)

    def counted(*a: Any, **kw: Any) -> Any:
        if threading.current_thread().name == thread:
            calls.append(f"{name}{a[:1]}")
        return real(*a, **kw)

    setattr(obj, name, counted)


def test_commit_thread_sweeps_nothing(writer):
    """Per commit, the commit thread does the commit's own I/O only: no listing of the tier, no
    lease read, no walk for leftovers (whose cost grows with what the tier holds, saves in flight
    included). Once per engine it lists the tier for the commit order (its first commit)."""
    w = writer(keep=2)
    tier = w.engine.first_tier
    calls: list[str] = []
    for name in ("list", "abort_stale"):
        _on_thread(tier, name, "tierckpt-commit", calls)
    reads: list[str] = []
    _on_thread(tier, "get", "tierckpt-commit", reads)
    _save_every_step(w, range(1, 3))
    w.wait()
    first = list(calls)
    assert len(first) <= 1, first  # the commit order's floor, listed once
    _save_every_step(w, range(3, 11))
    w.wait()
    assert calls == first, calls[len(first) :]
    assert not [k for k in reads if "_leases" in k], reads
    assert [c.checkpoint_id for c in committed_in_order(tier)] == ["step-9", "step-10"]


def test_commits_go_on_while_retention_is_held(writer, tmp_path):
    """Retention held back (a slow sweep of a big tier) holds back no commit: every save of a
    save-every-step loop commits meanwhile; the held-back passes are then served together, and
    ``wait()`` returns only after retention saw every commit ([local] keep = 2 holds)."""
    w = writer(keep=2)
    gate = threading.Event()
    real = w.engine.retain_first_tier

    def held(job: Any) -> None:
        gate.wait(60)
        real(job)

    w.engine.retain_first_tier = held  # type: ignore[method-assign]
    try:
        jobs = _save_every_step(w, range(1, 7))
        for j in jobs:
            j.committed.result(timeout=30)  # before: the first commit waited for its retention
        assert not any(j.replicated.done() for j in jobs)  # not settled: retention has not run
    finally:
        gate.set()
    w.wait()
    assert all(j.replicated.done() for j in jobs)
    passes = w.engine.retainer.passes
    assert passes <= 3, passes  # the held pass, then (at most two) for the five commits queued behind it
    tier = w.engine.first_tier
    assert [c.checkpoint_id for c in committed_in_order(tier)] == ["step-5", "step-6"]
    assert not list(tier.list("_leases/")), "a committed save's lease outlived wait()"


def test_first_save_does_not_wait_for_the_whole_pool_touch(tmp_path):
    """The pool's first touch is held (a load in flight pauses it, as a resume does); a save made
    meanwhile is captured and committed, touching only the slots it takes: the rest of the pool
    is still untouched (it used to be touched whole first: 1 GiB by default)."""
    cfg = TierConfig(
        host=HostConfig(buffer_size=64 * MiB, chunk_size=1 * MiB),
        local=LocalConfig(path=str(tmp_path / "ckpt"), keep=2, fsync=False),
    )
    with loading.loading():  # before the engine: its capture thread starts the touch at once
        w = TieredWriter(cfg)
        try:
            dcp.save(_state(1), checkpoint_id="step-1", storage_writer=w, no_dist=True)
            w.wait_captured()
            w.last.committed.result(timeout=60)
            pool = w.engine.pool
            assert pool.untouched >= pool.nslots - 8, (pool.untouched, pool.nslots)
            left = pool.untouched
            taken = [pool.acquire() for _ in range(pool.free_slots() - left + 1)]  # the touched ones, then one more
            assert pool.untouched == left - 1
            assert not pool.slot(taken[-1]).any()  # an untouched slot is zero-filled before it is handed out
            for slot in taken:
                pool.release(slot)
        finally:
            w.engine.close()
    assert [c.checkpoint_id for c in committed_in_order(w.engine.first_tier)] == ["step-1"]
