"""A commit and a deletion of the same checkpoint id never both go ahead (issue 22, item 2).

The window: a deleter (retention, ``tierckpt-restore gc``, in any process) lists a checkpoint
as partial, finds no live lease, writes its tombstone, checks that the metadata is still absent
and then deletes the listed data objects. A save (or a hop copying into the next tier) that
commits in between would be committed without its data. Each test stops the deleter right
after that metadata check, lets the writer commit (or fail), then lets the deleter go on; the
interleaving is forced with events, not timed.

* a hop into the next tier (promotion) wrote its copy without any lease on that tier: the
  deleter never saw it (fixed: a writer's lease on the destination, from before the copy until
  the commit there);
* a save whose lease lapsed (its renewals stalled) looked dead to the deleter (fixed: a save
  never commits once its lease lapsed);
* a save that starts while a deletion of the same id is under way waits for that deletion to
  finish before its first file.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from archive_tier import ArchiveConfig, ArchiveTier

import tierckpt
from tierckpt import HostConfig, JobConfig, LocalConfig, TierConfig, TieredReader, TieredWriter
from tierckpt.catalog import lease as leases
from tierckpt.catalog.listing import find_latest, list_checkpoints
from tierckpt.chain.engine import Engine, close_all, register_engine
from tierckpt.chain.retention import apply_retention, plan_retention
from tierckpt.format.layout import data_key, metadata_key
from tierckpt.tiers.local import LocalTier, drain_deletions

MiB = 1 << 20
WAIT = 60  # a safety net for a broken interleaving, never reached when the code is right


def cfg_two(tmp_path: Path) -> TierConfig:
    return TierConfig(
        host=HostConfig(buffer_size=8 * MiB, chunk_size=1 * MiB),
        local=LocalConfig(path=str(tmp_path / "local"), keep=0, fsync=False),
        sections={"archive": ArchiveConfig(path=str(tmp_path / "archive"))},
        job=JobConfig(commit_timeout=30),
    )


def state(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(256, 64, generator=g), "step": i}


def load(cfg: TierConfig, cid: str = "latest") -> dict:
    out = {"w": torch.zeros(256, 64), "step": -1}
    dcp.load(out, checkpoint_id=cid, storage_reader=TieredReader(cfg), no_dist=True)
    return out


@pytest.fixture(autouse=True)
def _fresh_engines():
    close_all()
    yield
    close_all()


class _PausingDeleter:
    """Hooks on one tier: the deleter thread stops right after it found ``cid``'s metadata absent
    (its last look before deleting the data) until ``resume`` is set."""

    def __init__(self, cid: str) -> None:
        self.cid = cid
        self.thread: threading.Thread | None = None
        self.checked = threading.Event()  # the deleter saw no metadata and is about to delete
        self.resume = threading.Event()

    def after_exists(self, key: str, found: bool) -> None:
        if threading.current_thread() is self.thread and key == metadata_key(self.cid) and not found:
            self.checked.set()
            assert self.resume.wait(WAIT), "the writer never committed nor failed"

    def run(self, tier, out: list) -> None:
        infos = list_checkpoints(tier)
        plan = plan_retention(infos, keep=0, protect=set())  # the partial goes, nothing committed does
        assert [c for c, _ in plan.delete] == [self.cid], plan.delete
        self.thread = threading.Thread(target=lambda: out.append(apply_retention(tier, plan, infos)))
        self.thread.start()


class RacingArchive(ArchiveTier):
    """The destination of the hop: the promotion stops after its copy until ``go``."""

    def __init__(self, root: Path, deleter: _PausingDeleter) -> None:
        super().__init__(root, fsync=False)
        self.deleter = deleter
        self.copied = threading.Event()
        self.go = threading.Event()

    def copy_from(self, src, key: str) -> int:
        n = super().copy_from(src, key)
        self.copied.set()
        assert self.go.wait(WAIT)
        return n

    def exists(self, key: str) -> bool:
        found = super().exists(key)
        self.deleter.after_exists(key, found)
        return found


def test_promotion_and_a_deletion_on_the_next_tier_never_both_succeed(tmp_path):
    """gc on the next tier lists a copy mid-promotion (files there, no metadata yet)."""
    cfg = cfg_two(tmp_path)
    deleter = _PausingDeleter("step-2")
    archive = RacingArchive(tmp_path / "archive", deleter)
    register_engine(Engine(cfg, tiers=[LocalTier(tmp_path / "local", fsync=False), archive]))
    archive.go.set()
    w = TieredWriter(cfg)
    dcp.save(state(1), checkpoint_id="step-1", storage_writer=w, no_dist=True)
    w.wait()
    archive.go.clear()
    archive.copied.clear()
    dcp.save(state(2), checkpoint_id="step-2", storage_writer=w, no_dist=True)
    assert archive.copied.wait(WAIT)  # step-2's data is on the archive, not committed there yet
    deleted: list = []
    deleter.run(archive, deleted)
    # Either the deleter stops after its metadata check, or it already skipped the checkpoint.
    while not deleter.checked.is_set() and deleter.thread.is_alive():
        deleter.checked.wait(0.01)
    archive.go.set()  # the promotion commits now: between the deleter's check and its deletion
    w.last.replicated.exception(timeout=WAIT)  # committed on the archive (or failed)
    deleter.resume.set()
    deleter.thread.join(WAIT)
    w.wait()
    drain_deletions()
    on_archive = [c.checkpoint_id for c in list_checkpoints(archive) if c.committed]
    both = "step-2" in on_archive and deleted == [["step-2"]]
    assert not both, "the promotion committed step-2 on the archive AND the deletion removed its data"
    assert deleted == [[]], "the deleter must skip a checkpoint whose writer holds a lease on that tier"
    assert "step-2" in on_archive
    close_all()
    shutil.rmtree(tmp_path / "local")  # the archive alone must serve step-2
    assert find_latest([ArchiveTier(tmp_path / "archive", fsync=False)]).checkpoint_id == "step-2"
    got = load(cfg)
    assert got["step"] == 2 and torch.equal(got["w"], state(2)["w"])


class RacingLocal(LocalTier):
    def __init__(self, root: Path, deleter: _PausingDeleter) -> None:
        super().__init__(root, fsync=False)
        self.deleter = deleter

    def exists(self, key: str) -> bool:
        found = super().exists(key)
        self.deleter.after_exists(key, found)
        return found


def test_a_save_whose_lease_lapsed_never_commits_what_a_deletion_removes(tmp_path, monkeypatch):
    """The save's lease stopped being renewed (the process stalled); a deleter elsewhere judges
    it dead, checks the metadata is absent, and is about to delete the data file when the save
    goes on to its commit."""
    cfg = TierConfig(
        host=HostConfig(buffer_size=8 * MiB, chunk_size=1 * MiB),
        local=LocalConfig(path=str(tmp_path / "local"), keep=0, fsync=False),
        job=JobConfig(commit_timeout=30),
    )
    deleter = _PausingDeleter("step-2")
    tier = RacingLocal(tmp_path / "local", deleter)
    eng = register_engine(Engine(cfg, tiers=[tier]))
    w = TieredWriter(cfg)
    dcp.save(state(1), checkpoint_id="step-1", storage_writer=w, no_dist=True)
    w.wait()
    deleted: list = []
    real = eng._check_file

    def stall_then_check(job):
        if job.id == "step-2":
            # the stall: the lease's expiry passes without a renewal
            time.sleep(leases.LEASE_TTL + 0.05)
            deleter.run(tier, deleted)
            assert deleter.checked.wait(WAIT), "the deleter saw the lease as live"
            job.committed.add_done_callback(lambda _f: deleter.resume.set())
        real(job)

    eng._check_file = stall_then_check
    monkeypatch.setattr(leases, "LEASE_TTL", 0.3)  # the save's lease lives 0.3 s
    # the stall stops renewals: the process-wide renewer thread (started by an earlier test) may
    # wake inside the 0.3 s and would renew it
    monkeypatch.setattr(leases.Lease, "renew", lambda self: None)
    dcp.save(state(2), checkpoint_id="step-2", storage_writer=w, no_dist=True)
    with pytest.raises(tierckpt.CommitError, match="lapsed"):
        w.wait()
    deleter.resume.set()
    deleter.thread.join(WAIT)
    drain_deletions()
    committed = [c.checkpoint_id for c in list_checkpoints(LocalTier(tmp_path / "local")) if c.committed]
    assert committed == ["step-1"]
    assert deleted == [["step-2"]]  # the deletion went ahead; the commit did not
    got = load(cfg)
    assert got["step"] == 1 and torch.equal(got["w"], state(1)["w"])


def test_a_save_waits_for_a_deletion_of_the_same_id_under_way(tmp_path, monkeypatch):
    """A stale partial of step-3 (a killed attempt) is being deleted when a new save of step-3
    starts: the save's lease is written after the deleter's lease check, so the save waits for
    the tombstone to go before its first file, then commits intact."""
    cfg = TierConfig(
        host=HostConfig(buffer_size=8 * MiB, chunk_size=1 * MiB),
        local=LocalConfig(path=str(tmp_path / "local"), keep=0, fsync=False),
        job=JobConfig(commit_timeout=30),
    )
    root = tmp_path / "local"
    tier = LocalTier(root, fsync=False)
    stale = root / data_key("step-3", "rank-00000-deadbeef.data")
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x" * 4096)
    infos = list_checkpoints(tier)
    plan_retention(infos, keep=0, protect=set())
    entered, leave = threading.Event(), threading.Event()
    waited: list[str] = []

    def delete_slowly():  # the deleter, between its lease checks and the end of its deletion
        def slow():
            entered.set()
            assert leave.wait(WAIT)
            tier.delete_many([o.key for o in infos[0].objects.values()])

        return leases.guarded_delete(tier, "step-3", slow, reason="test")

    out: list = []
    d = threading.Thread(target=lambda: out.append(delete_slowly()))
    d.start()
    assert entered.wait(WAIT)
    tombs = [p.name for p in (root / "_leases" / "step-3").iterdir()]
    assert any(n.startswith("tomb-") for n in tombs)
    real_tombs = leases._live_tombs

    def spy(tier_, cid, exclude=""):  # the save's capture thread found the tombstone: let the deletion finish
        found = real_tombs(tier_, cid, exclude)
        if found and threading.current_thread().name == "tierckpt-capture" and not waited:
            waited.append("waited")
            leave.set()
        return found

    monkeypatch.setattr(leases, "_live_tombs", spy)
    try:
        w = TieredWriter(cfg)
        dcp.save(state(3), checkpoint_id="step-3", storage_writer=w, no_dist=True)
        w.wait()
    finally:
        leave.set()
    d.join(WAIT)
    assert out == [True] and waited == ["waited"]
    drain_deletions()
    assert not stale.exists()
    got = load(cfg)
    assert got["step"] == 3 and torch.equal(got["w"], state(3)["w"])


def test_a_framework_deletion_waits_for_this_process_s_own_use_of_the_checkpoint(tmp_path):
    """Lightning's ``save_top_k`` deletes a checkpoint that this process's own hop still copies
    to the next tier (a restarted job's backlog replicates what its predecessor committed on the
    first tier only) and so holds a writer's lease on. The deletion must not leave it behind on
    that tier (nor commit there afterwards): it waits for this process's leases, then deletes it
    on every tier. (Before: "not deleted on archive: in use there", kept for good.)"""
    from tierckpt.integrations.deletions import Deletions

    cfg = cfg_two(tmp_path)
    w = TieredWriter(cfg)
    dcp.save(state(1), checkpoint_id="step-1", storage_writer=w, no_dist=True)
    w.wait()
    archive = w.engine.chain[1]
    assert [c.checkpoint_id for c in list_checkpoints(archive) if c.committed] == ["step-1"]
    hop = leases.acquire_for_write(archive, "step-1", purpose="a backlog copy of this process")
    dels = Deletions(w)
    done = dels.delete("step-1")  # held here: it waits in the background
    hop.release()  # the copy is over
    assert done.result(WAIT) is True, dels.skipped
    dels.wait()
    for tier in (w.engine.chain[0], archive):
        assert [c.checkpoint_id for c in list_checkpoints(tier) if c.committed] == [], tier.url
    w.close()


def test_a_framework_deletion_still_spares_another_process_s_reader(tmp_path):
    """A live lease of another process (a reader elsewhere) keeps the checkpoint on that tier, as before."""
    import json
    import os

    from tierckpt.integrations.deletions import Deletions

    cfg = cfg_two(tmp_path)
    w = TieredWriter(cfg)
    dcp.save(state(1), checkpoint_id="step-1", storage_writer=w, no_dist=True)
    w.wait()
    archive = w.engine.chain[1]
    other = {"owner": "elsewhere:1", "kind": "read", "purpose": "load", "expires": time.time() + 600}
    archive.put_volatile(f"{leases.LEASE_PREFIX}/step-1/read-0123456789abcdef.json", json.dumps(other).encode())
    dels = Deletions(w)
    assert dels.delete("step-1").result(WAIT) is False
    assert dels.skipped == {"step-1": ["archive"]}
    assert [c.checkpoint_id for c in list_checkpoints(archive) if c.committed] == ["step-1"]
    assert not os.path.exists(tmp_path / "local" / "step-1" / "metadata.json")
    w.close()


def test_a_lease_released_during_an_outage_is_dead_to_this_process(tmp_path, monkeypatch):
    """A hop that failed in an S3 outage releases its lease but cannot delete it: the object stays
    until LEASE_TTL, yet this process knows it let go, so its own retention does not spare the
    upload that hop left behind (nor does the object outlive the next listing)."""
    from tierckpt.errors import TierError

    tier = LocalTier(str(tmp_path / "t"))
    lease = leases.acquire_for_write(tier, "step-1", purpose="hop")
    assert "step-1" in leases.live_leases(tier)
    real_delete = tier.delete

    def down(key):
        raise TierError(f"delete {key} failed: outage")

    monkeypatch.setattr(tier, "delete", down)
    lease.release()
    assert tier.exists(lease.key)  # still on the tier
    monkeypatch.setattr(tier, "delete", real_delete)
    assert "step-1" not in leases.live_leases(tier)
    assert not tier.exists(lease.key)  # removed on the way, once the tier is back
    assert lease.key not in leases._let_go
