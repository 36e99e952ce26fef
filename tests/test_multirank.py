"""Multi-rank behaviour in real processes (gloo): bit-exact saves, simulated nodes, DTensor
resharding, a job killed before commit, and generated ids with one writer per rank.

Scenarios live in tests/dist_scenarios.py; each world costs a few seconds of process start-up.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_scenarios import compare, dtensor_full, placeholder, rank_state
from distrun import run_world

from tierckpt import CheckpointNotFound, TieredReader
from tierckpt.config import config_from_dict

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

SMALL_HOST = {"buffer_size": "8MiB", "chunk_size": "1MiB"}


def conf(path, **local) -> dict:
    return {"host": dict(SMALL_HOST), "local": {"path": str(path), "fsync": False, "keep": 0, **local}}


def committed(root) -> set[str]:
    return {p.name for p in root.iterdir() if (p / "metadata.json").is_file()} if root.is_dir() else set()


def files_of(root, cid) -> dict:
    """name -> path of every file of checkpoint ``cid`` under a tier root (whatever the layout)."""
    return {p.name: p for p in root.rglob("*") if p.is_file() and cid in p.relative_to(root).parts[:-1]}


def meta(path) -> dict:
    raw = path.read_bytes()
    head, sep, body = raw.partition(b"\n")
    return json.loads(body if sep and body.strip() else raw)


@pytest.mark.parametrize("world", [2, 4])
def test_save_load_bit_exact(tmp_path, world):
    root = tmp_path / "ckpt"
    res = run_world(world, "save_load_exact", {"config": conf(root), "id": "step-1", "load": "peer"}, tmp_path / "w")
    for r, out in enumerate(res):
        assert out["mismatches"] == [], (r, out)
        assert out["resolved"] == "step-1" and out["peer"] == (r + 1) % world
    assert committed(root) == {"step-1"}
    files = sorted(files_of(root, "step-1"))
    data = [f for f in files if f.endswith(".data")]
    assert len(data) == world and files == sorted(data + ["metadata.json"]), files
    doc = meta(root / "step-1" / "metadata.json")
    assert doc["world_size"] == world
    assert {f for f in doc["files"]} == set(data)

    # a single process reads what every rank wrote, bit-exact
    cfg = config_from_dict(conf(root))
    expected = {f"r{r}": rank_state(r, 0) for r in range(world)}
    target = placeholder(expected)
    dcp.load(target, checkpoint_id="latest", storage_reader=TieredReader(cfg), no_dist=True)
    assert compare(expected, target) == []


def test_simulated_nodes(tmp_path):
    world = 4
    args = {"config": conf(f"{tmp_path}/{{node}}"), "id": "step-3", "load": "own"}
    res = run_world(world, "save_load_exact", args, tmp_path / "w", node_of=lambda r: f"node{r // 2}")
    for r, out in enumerate(res):
        assert out["mismatches"] == [], (r, out)
        assert out["resolved"] == "step-3"
    for node, ranks in (("node0", (0, 1)), ("node1", (2, 3))):
        d = tmp_path / node / "step-3"
        found = files_of(tmp_path / node, "step-3")
        names = sorted(found)
        data = [n for n in names if n.endswith(".data")]
        owners = sorted(int(n.split("-")[1].split(".")[0]) for n in data)
        # only this node's ranks' files (a rank whose items were all deduplicated away writes none)
        assert set(owners) <= set(ranks) and owners, (node, names)
        assert names == sorted(data + ["metadata.json"]), names
        doc = meta(d / "metadata.json")
        assert doc["checkpoint_id"] == "step-3" and doc["world_size"] == world
        for f in data:
            assert f in doc["files"] and found[f].stat().st_size == doc["files"][f]
    # both metadata copies describe the same checkpoint
    m0, m1 = meta(tmp_path / "node0/step-3/metadata.json"), meta(tmp_path / "node1/step-3/metadata.json")
    assert m0["items"] == m1["items"] and m0["files"] == m1["files"]
    assert not (tmp_path / "{node}").exists()


def test_dtensor_reshard(tmp_path):
    root = tmp_path / "shared"
    cfg_d = conf(root)
    res = run_world(4, "dtensor_save", {"config": cfg_d, "id": "step-10"}, tmp_path / "w4")
    rows = [r["local_rows"] for r in res]
    assert [x["b"] for x in rows] == [1, 1, 1, 0]  # 3 rows on 4 ranks: a rank with an empty shard
    assert [x["a"] for x in rows] == [3, 3, 3, 1]
    assert committed(root) == {"step-10"}

    # resharded onto 2 ranks, Shard(1)
    res = run_world(2, "dtensor_load", {"config": cfg_d, "id": "step-10"}, tmp_path / "w2")
    for r, out in enumerate(res):
        assert out["mismatches"] == [], (r, out)
        assert out["whole_mismatches"] == [], (r, out)
        assert out["step"] == 10

    # and into plain full tensors in one process
    full = dtensor_full(0)
    full["rep"] = full["d"] + 1
    full["plain"] = full["e"].clone()
    target = {"model": {k: torch.zeros_like(v) for k, v in full.items()}, "step": 0}
    dcp.load(target, checkpoint_id="step-10", storage_reader=TieredReader(config_from_dict(cfg_d)), no_dist=True)
    assert compare(full, target["model"]) == []
    assert target["step"] == 10


KILL_CONFIG = {"host": {"buffer_size": "2MiB", "chunk_size": "64KiB"}, "local": {"fsync": True, "keep": 0}}


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory):
    """A 2-rank job commits step-1, starts step-2 and is killed; then a new job commits step-3.

    Returns (snapshot, root, after): ``snapshot`` is a copy of the tier taken right after the kill,
    ``root`` the tier after the new job, ``after`` the new job's per-rank results.
    """
    base = tmp_path_factory.mktemp("killed")
    root = base / "ckpt"
    config = {"host": dict(KILL_CONFIG["host"]), "local": dict(KILL_CONFIG["local"], path=str(root))}
    # a tiny pool (32 slots of 64 KiB) and 24 MiB per rank, fsynced: step-2 cannot be durable at the kill
    res = run_world(2, "commit_then_die", {"config": config, "big_mib": 24}, base / "w1", expect_ok=False)
    assert [r.get("exit") for r in res] == [9, 9], res
    snapshot = base / "snapshot"
    shutil.copytree(root, snapshot)  # copy2 keeps mtimes
    after = run_world(2, "save_load_exact", {"config": config, "id": "step-3"}, base / "w2")
    return snapshot, root, after


def _cfg_at(root):
    return config_from_dict({"host": dict(KILL_CONFIG["host"]), "local": dict(KILL_CONFIG["local"], path=str(root))})


def test_killed_before_commit_keeps_latest(killed_job):
    snapshot, _root, _after = killed_job
    assert committed(snapshot) == {"step-1"}
    # step-2 was killed before its commit: a partial (if its capture had started) and no metadata
    assert "metadata.json" not in files_of(snapshot, "step-2")
    cfg = _cfg_at(snapshot)
    r = TieredReader(cfg)
    expected = {f"r{k}": rank_state(k, 0) for k in range(2)} | {"step": 1}
    target = placeholder(expected)
    target["step"] = 0
    dcp.load(target, checkpoint_id="latest", storage_reader=r, no_dist=True)
    assert r.resolved_id == "step-1"
    assert compare(expected, target) == []

    r2 = TieredReader(cfg)
    r2.reset("step-2")
    with pytest.raises(CheckpointNotFound):
        r2.read_metadata()
    with pytest.raises(BaseException) as ei:
        dcp.load(placeholder(expected), checkpoint_id="step-2", storage_reader=TieredReader(cfg), no_dist=True)
    assert "step-2" in str(ei.value)


def test_new_job_after_kill_commits(killed_job):
    _snapshot, root, after = killed_job
    assert all(out["mismatches"] == [] and out["resolved"] == "step-3" for out in after), after
    assert {"step-1", "step-3"} <= committed(root)
    assert "step-2" not in committed(root)
    expected = {f"r{k}": rank_state(k, 0) for k in range(2)} | {"step": 1}
    target = placeholder(expected)
    target["step"] = 0
    dcp.load(target, checkpoint_id="step-1", storage_reader=TieredReader(_cfg_at(root)), no_dist=True)
    assert compare(expected, target) == []


def test_partial_checkpoint_is_cleaned_up_after_next_commit(killed_job):
    _snapshot, root, _after = killed_job
    leftovers = sorted(p.relative_to(root).as_posix() for p in files_of(root, "step-2").values())
    assert not leftovers, f"partial step-2 still on disk: {leftovers}"
    assert not list(root.rglob("step-2")), list(root.rglob("step-2"))


def test_generated_ids_one_writer_per_rank(tmp_path):
    """Several saves without checkpoint_id through the same writer instance on every rank."""
    root = tmp_path / "ckpt"
    res = run_world(2, "error_report", {"inner": "generated_ids", "config": conf(root)}, tmp_path / "w")
    assert all(r["ok"] for r in res), res
    outs = [r["result"] for r in res]
    assert outs[0]["errors"] == [] and outs[1]["errors"] == [], outs
    ids0 = outs[0]["ids"]
    assert ids0 == outs[1]["ids"] and len(set(ids0)) == 4 and ids0[2] == "step-x"
    assert committed(root) == set(ids0)
