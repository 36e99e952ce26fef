"""Lightning 2.6 and Accelerate 1.15 as real runs use them (issue #36): a job killed between a
save and its commit restarts (no crash loop); runs sharing one tiers configuration never touch
each other's checkpoints; pointer files explain themselves to ``torch.load``; an unchanged state
is not saved twice; checkpoints saved before ids were namespaced per run still load.

Real processes (single rank: the behaviour does not depend on the world size) through the
workers of tests/lightning_scenarios.py and tests/accelerate_scenarios.py; the rest in this
process with real plugin objects and real tiers. Skipped where Lightning / Accelerate are missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tierckpt.testing.launch import run_world

HERE = Path(__file__).resolve().parent


def _tiers(root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    toml = root / "tiers.toml"
    toml.write_text(
        f'[host]\nbuffer_size = "16MiB"\nchunk_size = "4MiB"\n[local]\npath = "{root / "local"}"\nkeep = 0\nfsync = false\n'
    )
    return str(toml)


def _fit(args: dict, wd: Path) -> dict:
    (res,) = run_world(1, "fit", args, wd, script=HERE / "lightning_scenarios.py", timeout=300)
    return res


def _ids(tiers: str) -> list[str]:
    from tierckpt.catalog.checkpoints import list_checkpoints

    return [c.id for c in list_checkpoints(tiers)]


# -- 1. killed between a save and its commit ----------------------------------------------------------


def test_lightning_kill_before_first_commit_restarts_then_resumes_from_fallback(tmp_path):
    """The first save's commit stalls and the job is killed: no pointer names it, so
    ``ckpt_path="last"`` starts from scratch (no CheckpointNotFound on every restart). That job
    commits step 2, stalls at step 4 and is killed: the next one resumes from step 2."""
    pytest.importorskip("lightning")
    tiers = _tiers(tmp_path)
    ck = tmp_path / "ckpt"
    base = {"tiers": tiers, "dirpath": str(ck), "steps": 8, "interval": 2}
    _fit(base | {"crash_after": 2, "stall_at": 2}, tmp_path / "a")
    assert _ids(tiers) == []
    assert not (ck / "epoch=0-step=2.ckpt").exists()  # the pointer waits for a commit that never came

    b = _fit(base | {"ckpt_path": "last", "crash_after": 4, "stall_at": 4}, tmp_path / "b")
    assert "errors" not in b, b
    assert b["resumed_from"] == 0
    assert [i.split("@")[1] for i in _ids(tiers)] == ["epoch=0-step=2.ckpt"]
    ptr = json.loads((ck / "epoch=1-step=4.ckpt").read_bytes().split(b"\ntR.\n", 1)[1])
    assert ptr["fallback"] == _ids(tiers)[0]  # written at once: a committed checkpoint to fall back to

    c = _fit(base | {"ckpt_path": "last"}, tmp_path / "c")
    assert "errors" not in c, c
    assert c["resumed_from"] == 2 and c["global_step"] == 8, c
    assert [i.split("@")[1] for i in _ids(tiers)] == ["epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt"]
