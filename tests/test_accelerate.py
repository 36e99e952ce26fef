"""Accelerate 1.15 with the shipped integration: FSDP2 sharded ``save_state``/``load_state`` on 2
gloo ranks (real processes, tests/accelerate_scenarios.py). A job saving every 2 steps is killed;
a new job's ``load_state()`` (automatic naming: the newest ``checkpoint_<n>``) restores the model,
optimizer, scheduler, RNG states, data loader position and registered objects bit for bit, and
it ends bit-exact with an uninterrupted run. Each ``save_state`` is one tierckpt checkpoint;
``total_limit=2`` leaves two. Skipped only where Accelerate is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install 'tierckpt[accelerate]')")
pytest.importorskip("torchdata", reason="torchdata is not installed (Accelerate's stateful data loaders need it)")

from tierckpt.testing.launch import run_world  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "accelerate_scenarios.py"
STEPS, CRASH, INTERVAL = 8, 5, 2  # save_state at steps 2, 4 (killed during step 6), then 6, 8


def _run(world: int, args: dict, wd: Path) -> list[dict]:
    res = run_world(world, "train", args, wd, script=SCRIPT, timeout=300)
    for r in res:
        assert "errors" not in r, r
    return res


def test_fsdp2_kill_and_resume_bit_exact_one_id_per_save(tmp_path):
    from tierckpt.catalog.checkpoints import list_checkpoints

    toml = tmp_path / "tiers.toml"
    toml.write_text(
        f'[host]\nbuffer_size = "16MiB"\nchunk_size = "4MiB"\n'
        f'[local]\npath = "{tmp_path / "local"}"\nkeep = 0\nfsync = false\n'
    )
    base = {"tiers": str(toml), "dump": str(tmp_path / "run"), "steps": STEPS, "interval": INTERVAL}
    crashed = _run(2, base | {"crash_after": CRASH}, tmp_path / "crashed")
    for r in crashed:  # one save_state, one tierckpt save, one id
        assert r["ids"] == [["checkpoint_0", 1], ["checkpoint_1", 1]], r
    res = _run(2, base | {"resume": True, "reference_first": True}, tmp_path / "resumed")
    for r in res:
        # checkpoint_1 (step 4), unless its commit had not finished at the kill (then checkpoint_0, step 2)
        assert r["resumed_from"] in (CRASH - 1, CRASH - 1 - INTERVAL), r
        assert r["check"] == [], r  # model, optimizer, scheduler, RNG states, counter: the reference's at that step
        assert r["final"] == [], r
        for step, loss in r["losses"].items():  # same batches (the loader's position travelled), same losses
            assert r["data"][step] == r["reference_data"][step], step
            assert loss == r["reference_losses"][step], (step, loss)
        assert [n for _, n in r["ids"]] == [1] * len(r["ids"]), r
    # iteration continued after the loaded checkpoint; total_limit=2 deleted the older ones from the tiers
    assert [c.id.split("@")[1] for c in list_checkpoints(str(toml))] == [i for i, _ in res[0]["ids"]][-2:]
