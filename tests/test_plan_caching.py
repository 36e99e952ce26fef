"""Plan caching (``DefaultSavePlanner(enable_plan_caching=True)``) through TieredWriter, and the
reuse of persisted plans by a restarted job.

Multi-rank cases run real processes joined by gloo (tests/plan_scenarios.py); every save is
loaded back and compared bit for bit, so a stale layout can never go unnoticed.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from distrun import run_world
from torch.distributed.checkpoint import DefaultSavePlanner

from tierckpt import HostConfig, LocalConfig, TierConfig, TieredReader, TieredWriter
from tierckpt.capture.planning import layout_cache
from tierckpt.save.plancache import decode_metadata, decode_plan, encode_metadata, encode_plan, from_bytes, plan_hash

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "plan_scenarios.py"
SMALL_HOST = {"buffer_size": "8MiB", "chunk_size": "1MiB"}

# save 3: rank 1 reshapes one tensor; save 5: rank 0 changes one tensor's dtype (same shape:
# DCP's plan cache does not see it); save 7: every rank gets more tensors (and the old shapes).
VERSIONS = [
    {"from": 3, "ranks": [1], "shapes": {"2": [9, 9]}},
    {"from": 5, "ranks": [0], "dtypes": {"4": "bfloat16"}},
    {"from": 7, "n": 44},
]


def conf(path) -> dict:
    return {"host": dict(SMALL_HOST), "local": {"path": str(path), "fsync": False, "keep": 0}}


def meta(root: Path, cid: str) -> dict:
    head, _, body = (root / cid / "metadata.json").read_bytes().partition(b"\n")
    return json.loads(body)


def ok(results: list[dict]) -> list[dict]:
    for r, out in enumerate(results):
        assert out.get("errors", []) == [], (r, out["errors"])
    return results


def check_saves(root: Path, results: list[dict], ids: list[str] | None = None) -> None:
    saves = [out["saves"] for out in results]
    n = len(saves[0])
    got_ids = [s["id"] for s in saves[0]]
    for r, ss in enumerate(saves):
        assert [s["id"] for s in ss] == got_ids, r  # every rank saved the same checkpoints
        for s in ss:
            assert s["bad"] == [], (r, s)
    if ids is not None:
        assert got_ids == ids
    assert len(set(got_ids)) == n
    tokens = [meta(root, cid)["save_token"] for cid in got_ids]
    assert len(set(tokens)) == n  # a fresh token (and fresh file names) for every save
    for cid, token in zip(got_ids, tokens):
        files = meta(root, cid)["files"]
        assert all(token[:8] in f for f in files), (cid, files)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_cached_saves_reuse_layouts_and_follow_changes(tmp_path, world):
    root = tmp_path / "ckpt"
    res = ok(
        run_world(
            world,
            "cached_saves",
            {"config": conf(root), "saves": 9, "versions": VERSIONS},
            tmp_path / "w",
            script=SCRIPT,
        )
    )
    check_saves(root, res, [f"step-{s:03d}" for s in range(9)])
    # DCP served cached plans whenever a rank's plan had not changed (save 5's dtype change
    # included: DCP does not compare dtypes); rank 1's reshape (save 3) and save 7 were re-planned
    assert res[0]["served_from_cache"] == [False] + [True] * 6 + [False, True]
    if world > 1:
        assert res[1]["served_from_cache"] == [False, True, True, False, True, True, True, False, True]
    # layouts: built on the first save, reused while nothing changed, rebuilt on every change
    assert [s["builds"] for s in res[0]["saves"]] == [1, 1, 1, 1, 1, 2, 2, 3, 3]
    if world > 1:
        assert [s["builds"] for s in res[1]["saves"]] == [1, 1, 1, 2, 2, 2, 2, 3, 3]
        assert [s["builds"] for s in res[-1]["saves"]][:7] == ([1] * 7 if world > 2 else [1, 1, 1, 2, 2, 2, 2])
    # the dtype change that DCP's plan cache cannot see is in the metadata of saves 5 and 6
    for cid in ("step-005", "step-006"):
        sdm = meta(root, cid)["dcp"]["state_dict_metadata"]
        assert sdm["model.r0.layer4.w"]["dtype"] == "bfloat16", cid
    assert meta(root, "step-007")["dcp"]["state_dict_metadata"]["model.r0.layer4.w"]["dtype"] == "float32"
    if world > 1:
        sdm = meta(root, "step-004")["dcp"]["state_dict_metadata"]
        assert sdm["model.r1.layer2.w"]["size"] == [9, 9]


def test_cached_async_save(tmp_path):
    root = tmp_path / "ckpt"
    res = ok(
        run_world(
            2,
            "cached_saves",
            {"config": conf(root), "saves": 6, "versions": VERSIONS[:2], "mode": "async"},
            tmp_path / "w",
            script=SCRIPT,
        )
    )
    check_saves(root, res, [f"step-{s:03d}" for s in range(6)])
    assert [s["builds"] for s in res[1]["saves"]] == [1, 1, 1, 2, 2, 2]


def test_cached_saves_with_generated_ids(tmp_path):
    root = tmp_path / "ckpt"
    res = ok(
        run_world(
            2, "cached_saves", {"config": conf(root), "saves": 4, "generated": True}, tmp_path / "w", script=SCRIPT
        )
    )
    check_saves(root, res)
    assert all(cid.startswith("ckpt-") for cid in (s["id"] for s in res[0]["saves"]))


def test_cached_saves_still_refuse_committed_and_mismatched_ids(tmp_path):
    root = tmp_path / "ckpt"
    res = run_world(2, "refusals", {"config": conf(root)}, tmp_path / "w", script=SCRIPT)
    for r, out in enumerate(res):
        steps = out["steps"]
        assert [s["ok"] for s in steps] == [True, True, False, True, False, True], (r, steps)
        assert "CommitConflict" in steps[2]["error"] and "step-1" in steps[2]["error"], steps[2]
        assert "different checkpoint ids" in steps[4]["error"], steps[4]
        assert all(s["bad"] == [] for s in steps if s["ok"])
    assert {p.name for p in root.iterdir() if (p / "metadata.json").is_file()} == {
        "step-0",
        "step-1",
        "step-2",
        "step-4",
    }


def test_restart_reuses_plans_only_when_every_rank_agrees(tmp_path):
    root = tmp_path / "ckpt"
    cfg = conf(root)
    ok(run_world(2, "cached_saves", {"config": cfg, "saves": 3}, tmp_path / "a", script=SCRIPT))
    assert sorted(p.name for p in (root / "_plans").iterdir()) == ["g00000.json", "g00001.json"]
    # an unchanged model: the first save of the new processes reuses the persisted plans
    res = run_world(2, "restart_save", {"config": cfg, "id": "restart-1"}, tmp_path / "b", script=SCRIPT)
    for r, out in enumerate(res):
        assert "error" not in out, (r, out)
        assert out["seeded"], (r, out)
        assert out["bad"] == [] and out["bad2"] == []
    # a changed model (rank 1 reshapes a tensor, rank 0 changes a dtype): plans agree on disk,
    # DCP re-plans rank 1, and the dtype change is caught by the layout check
    changed = {"1": {"shapes": {"2": [9, 9]}}, "0": {"dtypes": {"4": "bfloat16"}}}
    res = run_world(
        2, "restart_save", {"config": cfg, "id": "restart-2", "version_by_rank": changed}, tmp_path / "c", script=SCRIPT
    )
    for r, out in enumerate(res):
        assert "error" not in out, (r, out)
        assert out["bad"] == [] and out["bad2"] == [], (r, out)
    sdm = meta(root, "restart-2")["dcp"]["state_dict_metadata"]
    assert sdm["model.r1.layer2.w"]["size"] == [9, 9] and sdm["model.r0.layer4.w"]["dtype"] == "bfloat16"
    # another world size: never seeded
    res = run_world(3, "restart_save", {"config": cfg, "id": "restart-3"}, tmp_path / "d", script=SCRIPT)
    for r, out in enumerate(res):
        assert "error" not in out, (r, out)
        assert not out["seeded"] and out["bad"] == [] and out["bad2"] == [], (r, out)
    assert "world size" in res[0]["reason"]


def test_persisted_plans_are_json_and_verified(tmp_path):
    cfg = TierConfig(
        host=HostConfig(buffer_size=8 << 20, chunk_size=1 << 20),
        local=LocalConfig(path=str(tmp_path / "ckpt"), keep=0, fsync=False),
    )

    class TestPersistPlanner(DefaultSavePlanner):
        pass

    sd = {"m": {f"t{i}": torch.full((3 + i,), float(i)) for i in range(5)}, "n": 1}
    w = TieredWriter(cfg)
    for s in range(2):
        dcp.save(
            sd,
            checkpoint_id=f"s{s}",
            storage_writer=w,
            planner=TestPersistPlanner(enable_plan_caching=True),
            no_dist=True,
        )
        w.wait()
    path = tmp_path / "ckpt" / "_plans" / "g00000.json"
    raw = path.read_bytes()
    p = from_bytes(raw, str(path))
    assert p.key == "TestPersistPlanner" and p.world == 1 and p.is_coordinator
    assert decode_plan(encode_plan(p.final)) == p.final and plan_hash(p.local) == p.h_local
    assert decode_metadata(encode_metadata(p.metadata)) == p.metadata
    # the hash covers dtypes: the same plan with another dtype hashes differently
    item = next(it for it in p.local.items if it.tensor_data is not None)
    props = item.tensor_data.properties
    import dataclasses

    other = dataclasses.replace(
        p.local,
        items=[
            dataclasses.replace(
                item,
                tensor_data=dataclasses.replace(
                    item.tensor_data, properties=dataclasses.replace(props, dtype=torch.float16)
                ),
            )
        ]
        + p.local.items[1:],
    )
    assert plan_hash(other) != p.h_local
    # a corrupted file is refused, never half-used
    i = raw.index(b'"fqn"') + 8
    bad = raw[:i] + bytes([raw[i] ^ 1]) + raw[i + 1 :]
    with pytest.raises(Exception, match="SHA-256"):
        from_bytes(bad, "x")
    # and the checkpoints are fine
    out = {"m": {k: torch.zeros_like(v) for k, v in sd["m"].items()}, "n": 0}
    dcp.load(out, checkpoint_id="s1", storage_reader=TieredReader(cfg), no_dist=True)
    assert all(torch.equal(out["m"][k], v) for k, v in sd["m"].items()) and out["n"] == 1


def test_cached_saves_in_one_process(tmp_path):
    """no_dist saves with plan caching: layouts reused, shape and dtype changes followed."""
    cfg = TierConfig(
        host=HostConfig(buffer_size=8 << 20, chunk_size=1 << 20),
        local=LocalConfig(path=str(tmp_path / "ckpt"), keep=0, fsync=False),
    )

    class TestOneProcessPlanner(DefaultSavePlanner):
        pass

    w = TieredWriter(cfg)
    cache = layout_cache(w.engine.chunk_size)
    sd = {"a": torch.randn(100, 10), "b": torch.arange(7), "s": "x"}
    variants = [
        lambda d: None,
        lambda d: None,
        lambda d: d.__setitem__("a", torch.randn(50, 10)),
        lambda d: d.__setitem__("a", d["a"].half()),
        lambda d: None,
    ]
    builds = []
    for i, change in enumerate(variants):
        change(sd)
        sd["s"] = "x" * i
        b0 = cache.builds
        dcp.save(
            sd,
            checkpoint_id=f"s{i}",
            storage_writer=w,
            planner=TestOneProcessPlanner(enable_plan_caching=True),
            no_dist=True,
        )
        w.wait()
        builds.append(cache.builds - b0)
        out = {"a": torch.zeros_like(sd["a"]), "b": torch.zeros(7, dtype=torch.long), "s": None}
        dcp.load(out, checkpoint_id=f"s{i}", storage_reader=TieredReader(cfg), no_dist=True)
        assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"], sd["b"]) and out["s"] == sd["s"], i
    assert builds == [1, 0, 1, 1, 0]


def test_store_channel_carries_values_over_the_tcpstore_limit():
    """The merged metadata of a big checkpoint exceeds TCPStore's 8 MiB value limit: the channel
    splits it (a too large value would drop the store connection of every later commit)."""
    import datetime

    from distrun import free_port
    from torch.distributed import TCPStore

    from tierckpt.chain.commit import StoreChannel

    store = TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=30))
    ch = StoreChannel(store)
    big = bytes(range(256)) * (20 * 4096 + 7)  # ~20 MiB
    ch.publish("k/outcome", big)
    assert ch.try_get("k/outcome") == big
    ch.publish("k/small", b"M{}")
    assert ch.try_get("k/small") == b"M{}"
    ch.delete("k/outcome")
    assert ch.try_get("k/outcome") is None and not store.check(["k/outcome/#0"])
