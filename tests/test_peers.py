"""Simulated nodes that read each other's files while loading (``tierckpt.peers``).

Two nodes of two ranks (``TIERCKPT_NODE`` n0/n1, ``[local] path = ".../{node}"``, no S3). Where
this machine allows it (root and ``unshare``), every rank runs in its own mount namespace in which
the other node's directory is covered by an empty tmpfs: it cannot see the other node's files,
as on two machines, so every item it reads from there came over the transport.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tierckpt.testing import can_hide_paths, hide_paths, run_world

SCRIPT = Path(__file__).with_name("peer_scenarios.py")
NODES = ("n0", "n1")
ISOLATED = can_hide_paths()


def conf(base: Path) -> dict:
    return {"host": {"buffer_size": "8MiB", "chunk_size": "1MiB"},
            "local": {"path": f"{base}/{{node}}", "fsync": False, "keep": 3},
            "job": {"commit_timeout": 60.0}}


def run(base: Path, world: int, scenario: str, args: dict, work: str, node_of, **kw) -> list[dict]:
    """``scenario`` on ``world`` ranks; each rank blind to the other nodes' directories when possible."""
    for n in NODES:
        (base / n).mkdir(parents=True, exist_ok=True)
    prefix = None
    if ISOLATED:
        prefix = lambda r: hide_paths([str(base / n) for n in NODES if n != node_of(r)])  # noqa: E731
    return run_world(world, scenario, {"config": conf(base), **args}, base / work, script=SCRIPT, node_of=node_of,
                     prefix_of=prefix, **kw)


def two_per_node(r: int) -> str:
    return NODES[r // 2]


def one_per_node(r: int) -> str:
    return NODES[r]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """Steps 1 and 2 saved by 2 nodes x 2 ranks."""
    base = tmp_path / "ckpt"
    run(base, 4, "save_steps", {"steps": [1, 2]}, "save", two_per_node)
    return base


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
