"""Simulated nodes that read each other's files while loading (``tierckpt.peers``).

Two nodes of two ranks (``TIERCKPT_NODE`` n0/n1, ``[local] path = ".../{node}"``, no S3). Where
this machine allows it (root and ``unshare``), every rank runs in its own mount namespace in which
the other node's directory is covered by an empty tmpfs: it cannot see the other node's files,
as on two machines, so every item it reads from there came over the transport.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tierckpt.testing import can_hide_paths, run_world

SCRIPT = Path(__file__).with_name("peer_scenarios.py")
NODES = ("n0", "n1")
ISOLATED = can_hide_paths()


def conf(base: Path, replicas: int = 0, s3: dict | None = None, timeout: float = 60.0) -> dict:
    return {
        "host": {"buffer_size": "8MiB", "chunk_size": "1MiB"},
        "local": {"path": f"{base}/{{node}}", "fsync": False, "keep": 3},
        "peer": {"replicas": replicas},
        "job": {"commit_timeout": timeout},
        **({"s3": s3} if s3 else {}),
    }


def run(
    base: Path,
    world: int,
    scenario: str,
    args: dict,
    work: str,
    node_of,
    replicas: int = 0,
    s3: dict | None = None,
    commit_timeout: float = 60.0,
    **kw,
) -> list[dict]:
    """``scenario`` on ``world`` ranks; each rank blind to the other nodes' directories when possible."""
    for n in NODES:
        (base / n).mkdir(parents=True, exist_ok=True)
    hide = None
    if ISOLATED:
        hide = lambda r: [str(base / n) for n in NODES if n != node_of(r)]  # noqa: E731
    return run_world(
        world,
        scenario,
        {"config": conf(base, replicas, s3, commit_timeout), **args},
        base / work,
        script=SCRIPT,
        node_of=node_of,
        hide_of=hide,
        **kw,
    )


def two_per_node(r: int) -> str:
    return NODES[r // 2]


def one_per_node(r: int) -> str:
    return NODES[r]


def fresh(master: Path, tmp_path: Path) -> Path:
    """A copy of a module's saved checkpoints for one test (tests may delete a node's directory)."""
    base = tmp_path / "ckpt"
    shutil.copytree(master, base, symlinks=True)
    return base


@pytest.fixture(scope="module")
def saved_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("peers") / "ckpt"
    run(base, 4, "save_steps", {"steps": [1, 2]}, "save", two_per_node)
    return base


@pytest.fixture
def saved(saved_master: Path, tmp_path: Path) -> Path:
    """Steps 1 and 2 saved by 2 nodes x 2 ranks."""
    return fresh(saved_master, tmp_path)


def test_restart_same_nodes_reads_files_of_the_other_node(saved: Path) -> None:
    """The plain restart that failed before: DCP put ``shared`` and ``step`` in one rank's file on
    one node, and every rank of the other node needs them; here every rank also loads every other
    rank's tensor, so each node needs the other's files."""
    res = run(saved, 4, "load_all", {"saved_world": 4, "expect_step": 2}, "load", two_per_node)
    for r, out in enumerate(res):
        assert "error" not in out, (r, out)
        assert out["id"] == "step-2" and out["bad"] == [], (r, out)
        assert out["from_peers"], (r, out)  # it read the other node's ranks' tensors over the transport
        assert all(f"rank-0000{q}" not in " ".join(out["from_peers"]) for q in ((0, 1) if r < 2 else (2, 3))), out


def test_restart_with_another_world_size(saved: Path) -> None:
    """DCP resharding across nodes: 4 ranks saved, 2 ranks (one per node) load everything."""
    res = run(saved, 2, "load_all", {"saved_world": 4, "expect_step": 2}, "load2", one_per_node)
    for r, out in enumerate(res):
        assert "error" not in out and out["bad"] == [] and out["id"] == "step-2", (r, out)
        assert out["from_peers"], (r, out)


def test_explicit_older_id(saved: Path) -> None:
    res = run(saved, 4, "load_all", {"saved_world": 4, "expect_step": 1, "id": "step-1"}, "load1", two_per_node)
    assert all("error" not in o and o["bad"] == [] and o["id"] == "step-1" for o in res), res


def test_node_lost_without_copies_is_a_clear_error(saved: Path) -> None:
    """replicas = 0 and no S3: node n1's disk is gone, so its ranks' files exist nowhere; the load
    fails on every rank with one CheckpointNotFound naming what is missing (no hang, no half load)."""
    shutil.rmtree(saved / "n1")
    res = run(saved, 4, "load_all", {"saved_world": 4, "expect_step": 2}, "lost", two_per_node)
    for r, out in enumerate(res):
        assert "error" in out, (r, out)
        assert "no committed checkpoint this job can read in full" in out["error"], out
        assert "step-2: data file rank-0000" in out["error"] and "is on no node of this job" in out["error"], out


# -- [peer] replicas = 1: every rank's file also on the other node ------------------------------


@pytest.fixture(scope="module")
def replicated_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("replicated") / "ckpt"
    run(base, 4, "save_steps", {"steps": [1, 2]}, "save", two_per_node, replicas=1)
    return base


@pytest.fixture
def replicated(replicated_master: Path, tmp_path: Path) -> Path:
    """Steps 1 and 2 saved by 2 nodes x 2 ranks with one peer copy of every file."""
    return fresh(replicated_master, tmp_path)


def _files(node: Path, cid: str) -> set[str]:
    """The data files of ``cid`` in a node's directory (wherever the layout puts them)."""
    return {p.name for p in node.rglob("rank-*.data") if p.parent.name == cid}


def test_peer_copies_land_on_the_other_node(replicated: Path) -> None:
    for step in (1, 2):
        n0, n1 = _files(replicated / "n0", f"step-{step}"), _files(replicated / "n1", f"step-{step}")
        assert n0 == n1 and len(n0) >= 3, (n0, n1)  # every node holds every file (its own + the copies)
        for n in NODES:
            rec = json.loads((replicated / n / f"step-{step}" / "peers.json").read_text())
            assert rec["replicas"] == 1 and set(rec["copies"]) == n0, rec


def test_node_lost_resumes_newest_from_peer_copies(replicated: Path) -> None:
    """Node n1's disk is lost; a replacement n1 with an empty directory (blind to n0's) rejoins: all
    4 ranks resume the newest checkpoint bit-exact, n1's ranks receiving every byte from n0."""
    shutil.rmtree(replicated / "n1")
    res = run(
        replicated,
        4,
        "load_all",
        {"saved_world": 4, "expect_step": 2, "resolve_first": True},
        "load",
        two_per_node,
        replicas=1,
    )
    for r, out in enumerate(res):
        assert "error" not in out and out["bad"] == [] and out["id"] == "step-2", (r, out)
        assert out["resolved"] == "step-2", out  # resolve() answers for the job, even on the empty node
    assert all(not res[r]["from_peers"] for r in (0, 1)), res  # n0 holds everything itself
    assert all(res[r]["from_peers"] and not res[r]["served"] for r in (2, 3)), res
    # the replacement node's load refilled its directory ([local] fill_on_load): its ranks' own files,
    # received from n0, and the metadata, so that it holds what it held before the loss
    own = {r: [f for f in _files(replicated / "n0", "step-2") if f.startswith(f"rank-{r:05d}-")] for r in (2, 3)}
    assert all(res[r]["filled"] == own[r] and len(own[r]) == 1 for r in (2, 3)), res
    assert not res[0]["filled"] and not res[1]["filled"], res
    assert _files(replicated / "n1", "step-2") == set(own[2] + own[3])
    assert (replicated / "n1" / "step-2" / "metadata.json").read_bytes() == (
        replicated / "n0" / "step-2" / "metadata.json"
    ).read_bytes()
    for f in own[2] + own[3]:
        [a] = [p for p in (replicated / "n0").rglob(f)]
        [b] = [p for p in (replicated / "n1").rglob(f)]
        assert a.read_bytes() == b.read_bytes(), f


def test_node_lost_resharded_onto_the_survivor(replicated: Path) -> None:
    """Node n1 is gone for good: 2 ranks on n0 resume the newest checkpoint from its copies."""
    shutil.rmtree(replicated / "n1")
    res = run(replicated, 2, "load_all", {"saved_world": 4, "expect_step": 2}, "load", lambda r: "n0", replicas=1)
    assert all("error" not in o and o["bad"] == [] and o["id"] == "step-2" for o in res), res


# -- with S3 behind the nodes --------------------------------------------------------------------


@pytest.fixture
def with_s3(tmp_path: Path, moto_endpoint: str, s3cfg) -> tuple[Path, dict]:
    """Steps 1 and 2 saved by 2 nodes x 2 ranks, one peer copy each, and promoted to S3 (moto)."""
    s3 = dataclasses.asdict(s3cfg(moto_endpoint))
    s3["part_size"] = "5MiB"
    base = tmp_path / "ckpt"
    run(base, 4, "save_steps", {"steps": [1, 2]}, "save", two_per_node, replicas=1, s3=s3)
    return base, s3


def test_both_nodes_lost_falls_back_to_s3(with_s3: tuple[Path, dict]) -> None:
    base, s3 = with_s3
    for n in NODES:
        shutil.rmtree(base / n)
    res = run(base, 4, "load_all", {"saved_world": 4, "expect_step": 2}, "load", two_per_node, replicas=1, s3=s3)
    for r, out in enumerate(res):
        assert "error" not in out and out["bad"] == [] and out["id"] == "step-2", (r, out)
        assert set(out["served"].values()) == {"s3"}, out


def test_flipped_byte_in_a_peer_copy_is_served_from_another_tier(with_s3: tuple[Path, dict]) -> None:
    """n0's copy of rank 2's file (written on n1) has a flipped byte: n0's ranks, which read that
    file from their own disk, detect it and take the item from S3; everything loads bit-exact."""
    base, s3 = with_s3
    copy = next(p for p in (base / "n0").rglob("rank-00002-*.data") if p.parent.name == "step-2")
    data = bytearray(copy.read_bytes())
    data[100] ^= 0x40
    copy.write_bytes(bytes(data))
    res = run(base, 4, "load_all", {"saved_world": 4, "expect_step": 2}, "load", two_per_node, replicas=1, s3=s3)
    for r, out in enumerate(res):
        assert "error" not in out and out["bad"] == [] and out["id"] == "step-2", (r, out)
    assert all(res[r]["recovered"] == {copy.name: "s3"} for r in (0, 1)), res  # n0 read the copy, and caught it
    assert all(res[r]["recovered"] == {} for r in (2, 3)), res  # n1 read its own, intact original


def test_partner_killed_during_replication(tmp_path: Path) -> None:
    """Node n1's rank dies while receiving n0's copy of step-2 (after both committed step-2
    locally): n0's wait() reports the failed copy, the copy never becomes visible or committed; the
    job restarts, resumes step-2 bit-exact, and the next checkpoint's copies commit."""
    base = tmp_path / "ckpt"
    cfg_over = {"steps": [1, 2]}
    res = run(
        base,
        2,
        "save_partner_dies",
        cfg_over,
        "die",
        one_per_node,
        replicas=1,
        expect_ok=False,
        timeout=240,
        commit_timeout=15.0,
    )
    assert res[1].get("exit") == 137, res[1]
    assert len(res[0]["errors"]) == 1 and "step-2" in res[0]["errors"][0], res[0]
    for n in NODES:
        assert (base / n / "step-1" / "peers.json").exists() and not (base / n / "step-2" / "peers.json").exists()
    assert not any(f.startswith("rank-00000") for f in _files(base / "n1", "step-2"))  # the copy never became visible
    out = run(base, 2, "load_all", {"saved_world": 2, "expect_step": 2}, "resume", one_per_node, replicas=1)
    assert all("error" not in o and o["bad"] == [] and o["id"] == "step-2" for o in out), out
    run(base, 2, "save_steps", {"steps": [3]}, "next", one_per_node, replicas=1)
    assert _files(base / "n0", "step-3") == _files(base / "n1", "step-3") and len(_files(base / "n0", "step-3")) == 2
    assert all((base / n / "step-3" / "peers.json").exists() for n in NODES)
    # the dead receiver's half-written copy is an orphan: gc removes it once nobody touched it for
    # long enough (never a live writer's file), and nothing committed goes with it
    leftovers = [p for p in (base / "n1").rglob("*.partial") if p.parent.name == "step-2"]
    assert leftovers, sorted(str(p) for p in (base / "n1").rglob("*"))
    old = leftovers[0].stat().st_mtime - 3600
    for p in leftovers:
        os.utime(p, (old, old))
    conf_path = base / "n1.toml"
    conf_path.write_text(f'[local]\npath = "{base}/n1"\nkeep = 3\n')
    gc = subprocess.run(
        [sys.executable, "-m", "restore", "--config", str(conf_path), "gc", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert json.loads(gc.stdout)["aborted_uploads"] == len(leftovers) and not any(p.exists() for p in leftovers)
    assert all((base / "n1" / c / "metadata.json").exists() for c in ("step-1", "step-2", "step-3"))


def test_list_and_verify_peer_copies(replicated: Path) -> None:
    """``tierckpt-restore list`` on a node shows which checkpoints have committed peer copies;
    ``verify`` checks the copies with the node's own files."""
    conf_path = replicated / "n0.toml"
    conf_path.write_text(f'[local]\npath = "{replicated}/n0"\n')
    out = subprocess.run(
        [sys.executable, "-m", "restore", "--config", str(conf_path), "list", "--json"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["checkpoint_id"]: r for r in json.loads(out.stdout)}
    assert all(rows[c]["tiers"]["local"]["peer_copies"] for c in ("step-1", "step-2")), rows
    # verify checks every byte of the node's files, the copies included; a flipped byte in a copy is caught
    cli = [sys.executable, "-m", "restore", "--config", str(conf_path), "verify", "step-2", "--json", "-q"]
    ok = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    copy = next(p for p in (replicated / "n0").rglob("rank-00002-*.data") if p.parent.name == "step-2")
    data = bytearray(copy.read_bytes())
    data[100] ^= 1
    copy.write_bytes(bytes(data))
    bad = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and copy.name in bad.stdout, bad.stdout + bad.stderr


def test_stale_leftovers_only(tmp_path: Path) -> None:
    """The local tier's ``abort_stale`` removes only files of dead writers: an old ``.partial``
    without a resume record and an old small-put temp file; never a fresh one (a live writer), a
    fetch's resumable file with its record and lock, or a committed object, however old."""
    from tierckpt.tiers.local import LocalTier

    d = tmp_path / "c1"
    d.mkdir()
    names = [
        "rank-00001-a.data.partial",
        ".tmp-x-metadata.json",
        "rank-00002-b.data.partial",
        "rank-00002-b.data.ranges.partial",
        ".tmp-rank-00002-b.data.lock",
        "rank-00000-c.data",
        "metadata.json",
        "rank-00003-d.data.partial",
    ]
    for n in names:
        (d / n).write_bytes(b"x")
    old = (d / names[0]).stat().st_mtime - 3600
    for n in names[:-1]:  # the last one stays fresh: someone is writing it
        os.utime(d / n, (old, old))
    leased = tmp_path / "_00" / "c2" / "rank-00004-e.data.partial"  # data of a leased checkpoint: spared
    leased.parent.mkdir(parents=True)
    leased.write_bytes(b"x")
    os.utime(leased, (old, old))
    tier = LocalTier(tmp_path)
    assert tier.abort_stale(60.0, spare={"c2"}) == 2
    assert sorted(p.name for p in d.iterdir()) == sorted(names[2:]) and leased.exists()
    tier.close()
