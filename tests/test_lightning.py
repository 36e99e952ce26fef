"""Lightning 2.6 with the shipped integration on 2 gloo ranks (real processes,
tests/lightning_scenarios.py): a job checkpointing through ``ModelCheckpoint`` is killed, a new
job resumes with ``ckpt_path="last"``: Lightning loads the very checkpoint dict it dumped (weights,
optimizer, scheduler, global step, loop state) and the job ends bit-exact with an uninterrupted
run (weights, optimizer, losses, loop state); ``save_top_k=2`` leaves exactly two
checkpoints on each tier. Skipped only where Lightning is not installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed (pip install 'tierckpt[lightning]')")

import archive_tier  # noqa: E402,F401 - registers [archive], the second tier here

from tierckpt.testing.launch import run_world  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "lightning_scenarios.py"
STEPS, CRASH, INTERVAL = 8, 5, 2  # saves at steps 2, 4, 6, 8 (epoch ends); killed during step 6


def _tiers(root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    toml = root / "tiers.toml"
    toml.write_text(
        f'[host]\nbuffer_size = "16MiB"\nchunk_size = "4MiB"\n'
        f'[local]\npath = "{root / "local"}"\nkeep = 0\nfsync = false\n'
        f'[archive]\npath = "{root / "archive"}"\n'
    )
    return str(toml)


def _run(world: int, args: dict, wd: Path) -> list[dict]:
    res = run_world(world, "fit", args, wd, script=SCRIPT, timeout=300)
    for r in res:
        assert "errors" not in r, r
    return res


def _check_resumed(res: list[dict], crash: int) -> None:
    for r in res:
        # the newest save before the kill (step 4) unless its commit had not finished (then step 2)
        assert r["resumed_from"] in (crash - 1, crash - 1 - INTERVAL), r
        assert r["check"] == [], r  # the loaded state is the uninterrupted run's at that step, bit for bit
        assert r["loaded"] == [] and "loops" in r["loaded_keys"], r  # Lightning got back what it saved
        assert r["final"] == [] and r["loops"] == [], r
        assert r["global_step"] == STEPS
        assert set(r["losses"]) == {str(s) for s in range(r["resumed_from"] + 1, STEPS + 1)}
        for step, loss in r["losses"].items():
            assert loss == r["reference_losses"][step], (step, loss)


def test_ddp_kill_and_resume_last_bit_exact_top_k(tmp_path):
    from tierckpt.catalog.checkpoints import list_checkpoints
    from tierckpt.catalog.listing import list_checkpoints as tier_listing
    from tierckpt.config import load_config
    from tierckpt.tiers import make_tiers

    tiers = _tiers(tmp_path)
    ck = tmp_path / "ckpt"
    base = {"strategy": "ddp", "tiers": tiers, "dirpath": str(ck), "steps": STEPS, "interval": INTERVAL}
    _run(2, base | {"crash_after": CRASH}, tmp_path / "crashed")
    res = _run(2, base | {"ckpt_path": "last", "reference_first": True}, tmp_path / "resumed")
    _check_resumed(res, CRASH)
    # save_top_k=2: the teardown waited for the commits and deletions; each tier holds the newest two
    kept = list_checkpoints(tiers)
    assert [c.id.split("@")[1] for c in kept] == ["epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt"], kept
    assert all(c.tiers == ("local", "archive") for c in kept), kept
    for tier in make_tiers(load_config(tiers)):  # each tier's own listing: committed ones
        assert sorted(c.checkpoint_id for c in tier_listing(tier) if c.committed) == [c.id for c in kept], tier.url
    if res[0]["resumed_from"] == CRASH - 1:  # no pointer was left for a save that never committed
        assert sorted(os.listdir(ck)) == ["epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"]
        assert os.readlink(ck / "last.ckpt") == "epoch=3-step=8.ckpt"


def test_fsdp2_model_parallel_kill_resume_then_one_rank_load(tmp_path):
    """The same with TierckptModelParallelStrategy (FSDP2 over 2 ranks): sharded model and optimizer
    states and Lightning's metadata in one checkpoint; then a 1-rank job loads the last one (DCP
    re-shards) and has the 2-rank job's final model."""
    from tierckpt.catalog.checkpoints import list_checkpoints

    tiers = _tiers(tmp_path)
    ck = tmp_path / "ckpt"
    base = {"strategy": "fsdp2", "tiers": tiers, "dirpath": str(ck), "steps": STEPS, "interval": INTERVAL}
    _run(2, base | {"crash_after": CRASH}, tmp_path / "crashed")
    res = _run(
        2,
        base | {"ckpt_path": "last", "reference_first": True, "final_model": str(tmp_path / "final.pt")},
        tmp_path / "resumed",
    )
    _check_resumed(res, CRASH)
    assert [c.id.split("@")[1] for c in list_checkpoints(tiers)] == ["epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt"]
    one = _run(
        1, base | {"validate": True, "ckpt_path": "last", "expect": str(tmp_path / "final.pt")}, tmp_path / "one-rank"
    )
    assert one[0]["check"] == [], one
