"""No committed checkpoint is ever lost (issue: commit order, backlog promotion, leases).

Each test is one of the repros found by an adversarial user, turned into an assertion:

* order comes from the commit sequence written in the metadata, not from file times (touch,
  copy, restore from a backup change nothing: ``latest``, ``list``, gc and retention agree);
* a listing-then-delete never removes the file of a save that started in between, and a save
  never commits a file it cannot still see; ``latest`` never names a checkpoint that cannot load;
* checkpoints committed locally but never uploaded (a job killed before promotion, or run
  without ``[s3]``) are promoted by the next job before local retention may drop them;
* a load, fetch, verify or consolidate holds a lease: gc and retention in other processes leave
  the checkpoint alone, and a checkpoint deleted under a reader is reported as deleted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from distrun import run_world

import tierckpt
from tierckpt import HostConfig, LocalConfig, TierConfig, TieredReader, TieredWriter
from tierckpt.catalog import lease as leases
from tierckpt.catalog.listing import find_latest, list_checkpoints, resolve_latest
from tierckpt.chain.engine import close_all
from tierckpt.chain.retention import plan_retention
from tierckpt.config import JobConfig
from tierckpt.format.layout import data_key, metadata_key
from tierckpt.tiers.local import LocalTier, drain_deletions

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


def cfg_local(tmp_path: Path, keep: int = 0, s3=None, **job) -> TierConfig:
    return TierConfig(
        host=HostConfig(buffer_size=8 * MiB, chunk_size=1 * MiB),
        local=LocalConfig(path=str(tmp_path / "ckpt"), keep=keep, fsync=False),
        s3=s3,
        job=JobConfig(**({"commit_timeout": 30} | job)),
    )


def state(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(300, 100, generator=g), "step": i}


def save(cfg: TierConfig, i: int, cid: str | None = None) -> TieredWriter:
    w = TieredWriter(cfg)
    dcp.save(state(i), checkpoint_id=cid or f"step-{i}", storage_writer=w, no_dist=True)
    w.wait()
    return w


def load(cfg: TierConfig, cid: str = "latest") -> dict:
    out = {"w": torch.zeros(300, 100), "step": -1}
    dcp.load(out, checkpoint_id=cid, storage_reader=TieredReader(cfg), no_dist=True)
    return out


def cli(cfg_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TIERCKPT_CONFIG=str(cfg_path), PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "restore", *args], capture_output=True, text=True, env=env, timeout=120
    )


def write_toml(path: Path, root: Path, keep: int) -> Path:
    path.write_text(f'[local]\npath = "{root}"\nkeep = {keep}\nfsync = false\n')
    return path


@pytest.fixture(autouse=True)
def _fresh_engines():
    """Each test starts like a fresh process (engines, their promoters and seq counters)."""
    close_all()
    yield
    close_all()


# -- 1. order by commit, never by file times -------------------------------------------------------


def test_touch_does_not_change_latest_list_or_gc(tmp_path):
    cfg = cfg_local(tmp_path)
    save(cfg, 1)
    save(cfg, 2)
    root = cfg.local.resolved_path()
    future = time.time() + 3600
    for p in (root / "step-1").rglob("*"):
        os.utime(p, (future, future))
    os.utime(root / "step-1" / "metadata.json", (future, future))
    tier = LocalTier(root)
    assert resolve_latest(tier) == "step-2"
    assert load(cfg)["step"] == 2
    cfg_path = write_toml(tmp_path / "t.toml", root, keep=1)
    r = cli(cfg_path, "latest")
    assert r.returncode == 0 and r.stdout.strip() == "step-2", r.stderr
    r = cli(cfg_path, "list", "--json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.index('"step-1"') < r.stdout.index('"step-2"')
    r = cli(cfg_path, "gc")
    assert r.returncode == 0, r.stderr
    assert [c.checkpoint_id for c in list_checkpoints(tier) if c.committed] == ["step-2"]


def test_copied_backup_keeps_commit_order(tmp_path):
    """Restore an older checkpoint from a backup copy (new file times, new inode): still older."""
    cfg = cfg_local(tmp_path)
    for i in (1, 2, 3):
        save(cfg, i)
    root = cfg.local.resolved_path()
    backup = tmp_path / "backup"
    shutil.copytree(root, backup)
    shutil.rmtree(root / "step-1")
    shutil.rmtree(root / "_00" / "step-1")
    time.sleep(0.01)
    shutil.copytree(backup / "step-1", root / "step-1")  # copytree sets new mtimes on directories; files via copy2...
    shutil.copytree(backup / "_00" / "step-1", root / "_00" / "step-1", copy_function=shutil.copyfile)
    for p in (root / "step-1" / "metadata.json",):
        os.utime(p, None)  # now
    assert resolve_latest(LocalTier(root)) == "step-3"
    assert load(cfg)["step"] == 3
    assert load(cfg, "step-1")["step"] == 1


def test_retention_keeps_the_newest_by_commit_even_when_touched(tmp_path):
    cfg = cfg_local(tmp_path, keep=2)
    save(cfg, 1)
    save(cfg, 2)
    root = cfg.local.resolved_path()
    future = time.time() + 3600
    os.utime(root / "step-1" / "metadata.json", (future, future))
    save(cfg, 3)  # keep=2: step-1 (oldest commit, newest file time) goes
    drain_deletions()
    assert [c.checkpoint_id for c in list_checkpoints(LocalTier(root)) if c.committed] == ["step-2", "step-3"]


def test_seq_grows_across_jobs_and_generated_ids(tmp_path):
    cfg = cfg_local(tmp_path)
    save(cfg, 5, "zzz-late-name")  # a name that sorts last, saved first
    close_all()  # a new job
    save(cfg, 6, "aaa-early-name")
    tier = LocalTier(cfg.local.resolved_path())
    infos = [c for c in list_checkpoints(tier) if c.committed]
    assert [c.checkpoint_id for c in infos] == ["zzz-late-name", "aaa-early-name"]
    assert infos[0].seq < infos[1].seq
    assert resolve_latest(tier) == "aaa-early-name"


def test_unreadable_header_is_neither_latest_nor_deleted(tmp_path):
    cfg = cfg_local(tmp_path, keep=1)
    save(cfg, 1)
    root = cfg.local.resolved_path()
    md = root / "step-1" / "metadata.json"
    md.write_bytes(b"garbage that is no header\n" + md.read_bytes())
    save(cfg, 2)
    save(cfg, 3)
    drain_deletions()
    tier = LocalTier(root)
    ids = [c.checkpoint_id for c in list_checkpoints(tier) if c.committed]
    assert "step-1" in ids and "step-2" not in ids and resolve_latest(tier) == "step-3"


def test_latest_skips_hostile_newest_metadata(tmp_path):
    """A newest metadata.json with a valid header and a hostile body (deeply nested, valid CRC)."""
    import json

    from tierckpt.checksum import crc32c

    cfg = cfg_local(tmp_path)
    save(cfg, 1)
    save(cfg, 2)
    md = cfg.local.resolved_path() / "step-2" / "metadata.json"
    head = json.loads(md.read_bytes().split(b"\n", 1)[0])
    body = b"[" * 200_000 + b"]" * 200_000
    head.update(length=len(body), crc32c=crc32c(body))
    md.write_bytes(json.dumps(head).encode() + b"\n" + body)
    assert find_latest([LocalTier(cfg.local.resolved_path())]).checkpoint_id == "step-1"
    assert load(cfg)["step"] == 1


# -- 2. a deletion never takes the file of a save that started meanwhile -------------------------


def _stale_partial(tier: LocalTier, cid: str, token: str = "deadbeef") -> Path:
    p = tier.root / data_key(cid, f"rank-00000-{token}.data.partial")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x" * 4096)
    old = time.time() - 7200
    os.utime(p, (old, old))
    return p


def test_listing_then_delete_spares_a_save_that_started_in_between(tmp_path):
    """The kill-loop repro, step by step: retention lists a stale partial of step-5 (left by a
    killed attempt), a new save of step-5 starts (lease, then its file), retention deletes."""
    root = tmp_path / "ckpt"
    tier = LocalTier(root)
    cfg = cfg_local(tmp_path)
    save(cfg, 4)
    stale = _stale_partial(tier, "step-5")
    infos = list_checkpoints(tier)  # retention's listing: step-5 is a stale partial
    plan = plan_retention(infos, keep=0, protect=set())
    assert ("step-5", plan.delete[0][1]) in plan.delete
    # the new save of step-5 starts now: lease first, then its file
    lease = leases.acquire(tier, "step-5", kind="save", require_committed=False, check_tombs=False)
    new = tier.root / data_key("step-5", "rank-00000-cafef00d.data")
    new.write_bytes(b"y" * 8192)
    from tierckpt.chain.retention import apply_retention

    assert apply_retention(tier, plan, infos) == []  # leased: skipped
    assert stale.exists() and new.exists()
    lease.release()
    # without any lease, only what was listed goes: the new file stays
    assert apply_retention(tier, plan, infos) == ["step-5"]
    drain_deletions()
    assert not stale.exists() and new.exists()


def test_retention_spares_a_partial_that_committed_after_the_listing(tmp_path):
    """Retention lists step-6 while its save is between its data and its metadata (no lease seen
    after the save released it); the save commits; the planned "partial" deletion must not touch
    the committed checkpoint (seen once in CI: a committed, unpromoted checkpoint lost)."""
    from tierckpt.chain.retention import apply_retention

    root = tmp_path / "ckpt"
    tier = LocalTier(root)
    cfg = cfg_local(tmp_path)
    save(cfg, 5)
    save(cfg, 6)
    close_all()
    md = root / metadata_key("step-6")
    aside = md.with_name("aside")
    md.rename(aside)  # the listing sees step-6 before its commit
    infos = list_checkpoints(tier)
    plan = plan_retention(infos, keep=0, protect=set())
    assert [d for d, _ in plan.delete] == ["step-6"]
    aside.rename(md)  # the save commits (and its lease is gone) before retention deletes
    assert apply_retention(tier, plan, infos) == []
    drain_deletions()
    assert load(cfg, "step-6")["step"] == 6


def test_save_does_not_commit_a_vanished_file(tmp_path):
    """If the data file disappears between the flush and the commit, the save fails loudly and
    nothing is committed (``latest`` stays loadable)."""
    cfg = cfg_local(tmp_path)
    save(cfg, 1)
    w = TieredWriter(cfg)
    eng = w.engine
    real = eng._check_file

    def vanish_then_check(job):
        os.unlink(eng.first_tier.root / data_key(job.id, job.assign.file))
        real(job)

    eng._check_file = vanish_then_check
    try:
        dcp.save(state(2), checkpoint_id="step-2", storage_writer=w, no_dist=True)
        with pytest.raises(tierckpt.CommitError, match="vanished"):
            w.wait()
    finally:
        eng._check_file = real
    assert resolve_latest(LocalTier(cfg.local.resolved_path())) == "step-1"
    assert load(cfg)["step"] == 1


def test_latest_never_names_a_checkpoint_whose_files_are_gone(tmp_path):
    cfg = cfg_local(tmp_path)
    save(cfg, 1)
    save(cfg, 2)
    root = cfg.local.resolved_path()
    shutil.rmtree(root / "_00" / "step-2")  # committed metadata, no data (the repro's end state)
    assert find_latest([LocalTier(root)]).checkpoint_id == "step-1"
    assert load(cfg)["step"] == 1


def test_save_holds_a_lease_until_committed(tmp_path):
    cfg = cfg_local(tmp_path)
    w = TieredWriter(cfg)
    eng = w.engine
    seen = []
    real = eng._check_file

    def look(job):
        seen.append(sorted(p.name for p in (eng.first_tier.root / "_leases" / job.id).iterdir()))
        real(job)

    eng._check_file = look
    try:
        save(cfg, 1)
    finally:
        eng._check_file = real
    assert seen and seen[0][0].startswith("save-")
    assert not (eng.first_tier.root / "_leases").exists()  # released (and pruned) after the commit


def test_keep_one_while_another_process_saves(tmp_path):
    """keep=1 in this process while another process has a save in flight on the same tier."""
    cfg = cfg_local(tmp_path, keep=1)
    root = cfg.local.resolved_path()
    save(cfg, 1)
    code = f"""
import os, sys, time
sys.path.insert(0, {str(ROOT)!r})
from tierckpt.catalog import lease
from tierckpt.tiers.local import LocalTier
from tierckpt.format.layout import data_key
t = LocalTier({str(root)!r})
l = lease.acquire(t, "other-9", kind="save", require_committed=False, check_tombs=False)
p = t.root / data_key("other-9", "rank-00000-0badf00d.data.partial")
p.parent.mkdir(parents=True, exist_ok=True)
p.write_bytes(b"z" * 4096)
print("ready", flush=True)
sys.stdin.readline()
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        save(cfg, 2)
        save(cfg, 3)
        drain_deletions()
        assert (root / data_key("other-9", "rank-00000-0badf00d.data.partial")).exists()
        assert [c.checkpoint_id for c in list_checkpoints(LocalTier(root)) if c.committed] == ["step-3"]
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    save(cfg, 4)  # the other process is gone: its partial is garbage now
    drain_deletions()
    assert not (root / "_00" / "other-9").exists()


# -- 3. every committed checkpoint reaches S3 -----------------------------------------------------


def _s3_ids(cfg: TierConfig) -> list[str]:
    from tierckpt.tiers import make_s3

    s3 = make_s3(cfg)
    try:
        return [c.checkpoint_id for c in list_checkpoints(s3) if c.committed]
    finally:
        s3.close()


def test_unpromoted_backlog_is_promoted_by_the_next_job(tmp_path, moto_endpoint, s3cfg):
    s3 = s3cfg(moto_endpoint, keep=10)
    local_only = cfg_local(tmp_path, keep=3)
    for i in (1, 2, 3):
        save(local_only, i)  # committed locally, never uploaded (a job without [s3], or killed)
    close_all()
    both = cfg_local(tmp_path, keep=3, s3=s3)
    for i in (4, 5, 6):
        save(both, i)
    drain_deletions()
    assert _s3_ids(both) == ["step-1", "step-2", "step-3", "step-4", "step-5", "step-6"]
    assert [c.checkpoint_id for c in list_checkpoints(LocalTier(both.local.resolved_path())) if c.committed] == [
        "step-4",
        "step-5",
        "step-6",
    ]
    out = {"w": torch.zeros(300, 100), "step": -1}
    dcp.load(out, checkpoint_id="step-2", storage_reader=TieredReader(both), no_dist=True)
    assert out["step"] == 2 and torch.equal(out["w"], state(2)["w"])


def test_backlog_respects_keep_every_and_s3_newest(tmp_path, moto_endpoint, s3cfg):
    """S3 already holds a newer checkpoint: only keep_every milestones of the backlog go up."""
    s3 = s3cfg(moto_endpoint, keep=10, keep_every=10)
    both = cfg_local(tmp_path, keep=0, s3=s3)
    local_only = cfg_local(tmp_path, keep=0)
    for i in (10, 11):
        save(local_only, i)
    close_all()
    save(both, 12)
    assert _s3_ids(both) == ["step-10", "step-11", "step-12"]  # both newer than S3's newest (nothing)
    close_all()
    for i in (20, 21):
        save(local_only, i)
    close_all()
    save(both, 22)
    assert _s3_ids(both) == ["step-10", "step-11", "step-12", "step-20", "step-21", "step-22"]


def test_local_retention_never_drops_what_s3_lacks(tmp_path, moto_endpoint, s3cfg):
    """S3 is unreachable for a while: local retention keeps every unpromoted checkpoint; once
    S3 is back, the next promotion brings the backlog up and retention catches up."""
    from faultproxy import FaultProxy

    with FaultProxy(moto_endpoint, error_rate=0.0, drop_rate=0.0) as proxy:
        s3 = s3cfg(moto_endpoint, keep=10, max_attempts=1, connect_timeout=1.0, read_timeout=2.0)
        s3 = type(s3)(**(s3.__dict__ | {"endpoint_url": proxy.url}))
        both = cfg_local(tmp_path, keep=1, s3=s3)
        save(both, 1)
        proxy.outage = True
        for i in (2, 3, 4):
            w = TieredWriter(both)
            dcp.save(state(i), checkpoint_id=f"step-{i}", storage_writer=w, no_dist=True)
            with pytest.raises(tierckpt.TierckptError):
                w.wait()
        drain_deletions()
        local_ids = [c.checkpoint_id for c in list_checkpoints(LocalTier(both.local.resolved_path())) if c.committed]
        assert local_ids == ["step-2", "step-3", "step-4"]  # step-1 is on S3: it may go
        proxy.outage = False
        save(both, 5)
        drain_deletions()
        assert _s3_ids(both) == ["step-1", "step-2", "step-3", "step-4", "step-5"]
        assert [c.checkpoint_id for c in list_checkpoints(LocalTier(both.local.resolved_path())) if c.committed] == [
            "step-5"
        ]


def test_backlog_on_two_simulated_nodes(tmp_path, moto_endpoint, s3cfg):
    """2 ranks on 2 simulated nodes (node-local paths): a job without [s3] commits 2
    checkpoints; the next job with [s3] promotes them, each rank uploading the files its node holds."""
    s3 = s3cfg(moto_endpoint, keep=10)
    base = {
        "host": {"buffer_size": 8 * MiB, "chunk_size": 1 * MiB},
        "local": {"path": str(tmp_path / "nodes" / "{node}"), "keep": 0, "fsync": False},
        "job": {"commit_timeout": 60},
    }
    node_of = lambda r: f"n{r}"  # noqa: E731
    run_world(2, "save_and_load", {"config": base, "id": "step-1"}, tmp_path / "a", node_of=node_of)
    run_world(2, "save_and_load", {"config": base, "id": "step-2", "seed": 1}, tmp_path / "b", node_of=node_of)
    with_s3 = base | {"s3": {k: v for k, v in s3.__dict__.items() if not k.startswith("_")}}
    run_world(2, "save_and_load", {"config": with_s3, "id": "step-3", "seed": 2}, tmp_path / "c", node_of=node_of)
    both = cfg_local(tmp_path, s3=s3)
    assert _s3_ids(both) == ["step-1", "step-2", "step-3"]
    shutil.rmtree(tmp_path / "nodes")  # both nodes lost: S3 alone serves step-2 bit-exact
    res = run_world(
        2,
        "save_and_load",
        {"config": with_s3, "id": "step-4", "seed": 9, "load_id": "step-4"},
        tmp_path / "d",
        node_of=node_of,
    )
    assert all(r["same"] for r in res)


# -- 4. readers hold leases ------------------------------------------------------------------------


def test_gc_skips_a_checkpoint_being_read(tmp_path):
    cfg = cfg_local(tmp_path)
    for i in (1, 2):
        save(cfg, i)
    root = cfg.local.resolved_path()
    cfg_path = write_toml(tmp_path / "t.toml", root, keep=1)
    from restore.source import CheckpointSource

    with CheckpointSource(cfg, "step-1", purpose="test read"):
        r = cli(cfg_path, "gc")
        assert r.returncode == 0, r.stderr
        assert (root / "step-1" / "metadata.json").exists()
        assert load(cfg, "step-1")["step"] == 1
    r = cli(cfg_path, "gc")
    assert r.returncode == 0, r.stderr
    assert not (root / "step-1").exists()


def test_reader_lease_blocks_retention_in_the_writer(tmp_path):
    cfg = cfg_local(tmp_path, keep=1)
    save(cfg, 1)
    r = TieredReader(cfg)
    r.reset("step-1")
    md = r.read_metadata()
    r.set_up_storage_reader(md, True)  # the lease is taken here, held until read_data ends
    save(cfg, 2)
    save(cfg, 3)
    drain_deletions()
    root = cfg.local.resolved_path()
    assert (root / "step-1" / "metadata.json").exists()
    r.release()
    save(cfg, 4)
    drain_deletions()
    assert not (root / "step-1").exists()


def test_reader_backs_off_from_a_checkpoint_being_deleted(tmp_path):
    cfg = cfg_local(tmp_path)
    save(cfg, 1)
    tier = LocalTier(cfg.local.resolved_path())
    tomb = tier.root / "_leases" / "step-1" / "tomb-0123456789abcdef.json"
    tomb.parent.mkdir(parents=True)
    tomb.write_text('{"owner": "elsewhere:1", "expires": %f}' % (time.time() + 60))
    with pytest.raises(leases.CheckpointBeingDeleted):
        leases.acquire(tier, "step-1")
    with pytest.raises(BaseException, match="being deleted"):
        load(cfg, "step-1")
    tomb.unlink()
    assert load(cfg, "step-1")["step"] == 1


def test_deleted_under_a_reader_says_deleted(tmp_path):
    """A deletion that ignores leases (rm -rf) under a load: the error says deleted, not corrupt."""
    cfg = cfg_local(tmp_path)
    save(cfg, 1)
    root = cfg.local.resolved_path()
    r = TieredReader(cfg)
    r.reset("step-1")
    md = r.read_metadata()
    r.set_up_storage_reader(md, True)
    shutil.rmtree(root / "step-1")
    shutil.rmtree(root / "_00" / "step-1")
    out = {"w": torch.zeros(300, 100), "step": -1}
    with pytest.raises(BaseException) as ei:
        dcp.load(out, checkpoint_id="step-1", storage_reader=r, no_dist=True)
    assert "deleted" in str(ei.value) and "corrupt" not in str(ei.value).lower()


def test_fetch_racing_gc(tmp_path, moto_endpoint, s3cfg):
    """gc on the local tier while a fetch into it holds its lease: the partial fetch survives."""
    s3 = s3cfg(moto_endpoint, keep=10)
    both = cfg_local(tmp_path, keep=1, s3=s3)
    for i in (1, 2):
        save(both, i)
    root = both.local.resolved_path()
    shutil.rmtree(root)
    local = LocalTier(root)
    held = leases.acquire(local, "step-1", kind="fetch", require_committed=False)
    part = _stale_partial(local, "step-1", "aaaabbbb")
    save(both, 3)  # commits and runs local retention (keep=1) in this process
    from restore.gc import gc_checkpoints

    gc_checkpoints(both)
    assert part.exists()
    held.release()
    gc_checkpoints(both)
    assert not part.exists()
    from restore.fetch import fetch_checkpoint

    fetch_checkpoint(both, "step-1", progress=False)
    assert load(both, "step-1")["step"] == 1


def test_leases_taken_and_released_concurrently(tmp_path):
    """Releasing a lease prunes its empty directory while another process or thread creates one
    there (a chaos run hit this as 'File exists'): every acquire and release succeeds."""
    import threading

    cfg = cfg_local(tmp_path)
    save(cfg, 1)
    tier = LocalTier(cfg.local.resolved_path())
    errors: list[BaseException] = []

    def churn(kind: str) -> None:
        try:
            for _ in range(200):
                leases.acquire(tier, "step-1", kind=kind, require_committed=False, check_tombs=False).release()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(k,)) for k in ("read", "save", "fetch", "read")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert load(cfg, "step-1")["step"] == 1
