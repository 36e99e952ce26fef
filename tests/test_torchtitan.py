"""torchtitan's CheckpointManager path with the shipped integration, on 2 gloo ranks (real
processes, tests/titan_scenarios.py): crash and resume bit-exact with equal losses, in sync and
async modes, and a 2 -> 1 rank load. Skipped only where torchtitan is not installed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'tierckpt[torchtitan]')")

from tierckpt.testing.launch import run_world  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "titan_scenarios.py"
STEPS, CRASH, INTERVAL = 6, 5, 2


def _tiers(root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    toml = root / "tiers.toml"
    toml.write_text(f'[host]\nbuffer_size = "64MiB"\nchunk_size = "8MiB"\n'
                    f'[local]\npath = "{root / "tiers"}"\nkeep = 0\nfsync = false\n')
    return str(toml)


def _run(world: int, args: dict, wd: Path) -> list[dict]:
    res = run_world(world, "train", args, wd, script=SCRIPT, timeout=300)
    for r in res:
        assert "errors" not in r, r
    return res


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run, no checkpointing: losses and the full state at every interval step."""
    root = tmp_path_factory.mktemp("titan-ref")
    res = _run(2, {"tiers": "", "dump": str(root / "dump"), "mode": "disabled", "steps": STEPS, "interval": INTERVAL,
                   "record": str(root / "record.pt"), "final": str(root / "final.pt")}, root / "w")
    return {"losses": res[0]["losses"], "record": str(root / "record.pt"), "final": str(root / "final.pt")}


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_crash_and_resume_bit_exact(tmp_path, reference, mode):
    tiers = _tiers(tmp_path)
    base = {"tiers": tiers, "dump": str(tmp_path / "dump"), "mode": mode, "steps": STEPS, "interval": INTERVAL}
    _run(2, base | {"crash_after": CRASH}, tmp_path / "crashed")
    res = _run(2, base | {"check": reference["record"], "final": str(tmp_path / "final.pt")}, tmp_path / "resumed")
    for r in res:
        # the newest checkpoint committed before the crash: step 4 (sync); async may have lost it
        assert r["resumed_from"] in ((4,) if mode == "disabled" else (2, 4)), r
        assert r["check"] == [], r  # the loaded state is the uninterrupted run's, bit for bit
        for step, loss in r["losses"].items():
            assert loss == reference["losses"][step], (step, loss, reference["losses"][step])
    import torch

    from tierckpt.testing.bitexact import compare

    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert compare(torch.load(reference["final"], weights_only=True), final) == []
    if mode == "disabled":
        # 2 -> 1 rank: a one-rank job loads the same checkpoint bit-exact (no training)
        one = _run(1, base | {"steps": 4, "check": reference["record"]}, tmp_path / "one-rank")
        assert one[0]["resumed_from"] == STEPS and one[0]["check"] == [], one  # latest: the last save

