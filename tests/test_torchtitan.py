"""torchtitan's CheckpointManager path with the shipped integration, on 2 gloo ranks (real
processes, tests/titan_scenarios.py): crash and resume bit-exact with equal losses, in sync and
async modes, and a 2 -> 1 rank load. Skipped only where torchtitan is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'tierckpt[torchtitan]')")

from tierckpt.testing.launch import run_world  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "titan_scenarios.py"
STEPS, CRASH, INTERVAL = 6, 5, 2


def _tiers(root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    toml = root / "tiers.toml"
    toml.write_text(
        f'[host]\nbuffer_size = "64MiB"\nchunk_size = "8MiB"\n'
        f'[local]\npath = "{root / "tiers"}"\nkeep = 0\nfsync = false\n'
    )
    return str(toml)


def _run(world: int, args: dict, wd: Path) -> list[dict]:
    # under pytest-timeout's 300 s: a hung launch reports its ranks' logs
    res = run_world(world, "train", args, wd, script=SCRIPT, timeout=200)
    for r in res:
        assert "errors" not in r, r
    return res


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run, no checkpointing: losses and the full state at every interval step."""
    root = tmp_path_factory.mktemp("titan-ref")
    res = _run(
        2,
        {
            "tiers": "",
            "dump": str(root / "dump"),
            "mode": "disabled",
            "steps": STEPS,
            "interval": INTERVAL,
            "record": str(root / "record.pt"),
            "final": str(root / "final.pt"),
        },
        root / "w",
    )
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


def test_s3_only_initial_load_and_keep_latest_k(tmp_path, reference, moto_endpoint, s3cfg):
    """No checkpoint directory anywhere: an S3-only configuration. The first job starts from a plain
    DCP checkpoint written by torchtitan's own manager (initial_load_path, read by DCP's reader);
    a fresh job resumes from S3; keep_latest_k = 2 is tierckpt's
    retention on S3 (what tierckpt.list_checkpoints reports), no directory is deleted."""
    from tierckpt.catalog.checkpoints import list_checkpoints

    plain = tmp_path / "plain"
    _run(
        2,
        {
            "tiers": "",
            "manager": "torchtitan",
            "dump": str(plain),
            "mode": "disabled",
            "steps": 2,
            "interval": 2,
            "no_last": True,
            "record": str(tmp_path / "plain.pt"),
        },
        tmp_path / "p",
    )
    s3 = s3cfg(moto_endpoint)
    toml = tmp_path / "tiers.toml"
    toml.write_text(
        f'[host]\nbuffer_size = "64MiB"\nchunk_size = "8MiB"\n[s3]\nbucket = "{s3.bucket}"\n'
        f'prefix = "{s3.prefix}"\nendpoint_url = "{s3.endpoint_url}"\npart_size = "5MiB"\n'
    )
    base = {
        "tiers": str(toml),
        "dump": str(tmp_path / "dump"),
        "mode": "async",
        "steps": STEPS,
        "interval": INTERVAL,
        "keep": 2,
    }
    first = _run(
        2,
        base
        | {
            "initial_load_path": str(plain / "checkpoint" / "step-2"),
            "check": str(tmp_path / "plain.pt"),
            "check_step": 2,
        },
        tmp_path / "first",
    )
    for r in first:
        assert r["resumed_from"] == 0 and r["check"] == [], r  # model only, from the plain DCP checkpoint
    # a fresh job (close() waited for the commits): resumes from S3, two steps more
    res = _run(2, base | {"steps": STEPS + 2}, tmp_path / "second")
    assert all(r["resumed_from"] == STEPS for r in res), res
    assert not (tmp_path / "dump" / "checkpoint").exists()
    kept = list_checkpoints(str(toml))
    assert [c.id for c in kept] == [f"step-{STEPS}", f"step-{STEPS + 2}"], kept
    assert all(c.tiers == ("s3",) for c in kept), kept


def test_resume_skips_a_newest_checkpoint_bad_on_every_tier(tmp_path, reference):
    """step-4 (the newest) has a flipped byte on the only tier: the manager logs it and resumes
    from step-2, bit-exact; step 4 is saved again as step-04 and training ends as the
    uninterrupted run does."""
    from tierckpt.catalog.checkpoints import latest, list_checkpoints

    tiers = _tiers(tmp_path)
    base = {"tiers": tiers, "dump": str(tmp_path / "dump"), "mode": "disabled", "steps": STEPS, "interval": INTERVAL}
    _run(2, base | {"crash_after": CRASH, "commit_before_crash": True}, tmp_path / "crashed")
    assert latest(tiers) == "step-4"
    (f,) = sorted((tmp_path / "tiers").rglob("step-4/rank-00000-*.data"))
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))
    res = _run(2, base | {"check": reference["record"], "final": str(tmp_path / "final.pt")}, tmp_path / "resumed")
    for r in res:
        assert r["resumed_from"] == 2 and r["check"] == [], r
        assert any(
            "RESUME: checkpoint step-4 cannot be loaded" in ln
            and "ChecksumMismatch" in ln
            and "resuming from the next older committed checkpoint, step-2" in ln
            for ln in r["log"]
        ), r["log"]
        for step, loss in r["losses"].items():
            assert loss == reference["losses"][step], (step, loss, reference["losses"][step])
    import torch

    from tierckpt.testing.bitexact import compare

    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert compare(torch.load(reference["final"], weights_only=True), final) == []
    ids = [c.id for c in list_checkpoints(tiers)]
    assert ids[-2:] == ["step-04", f"step-{STEPS}"] and "step-4" in ids, ids
    assert latest(tiers) == f"step-{STEPS}"


def test_resume_skips_a_newest_checkpoint_marked_bad(tmp_path, reference):
    """Issue 35: step-4 (the newest) is marked bad by a person (every tier): the manager resumes
    healthy by default, from step-2, bit-exact, and saves step 4 again as step-04."""
    from tierckpt.catalog.checkpoints import latest, list_checkpoints, mark_bad

    tiers = _tiers(tmp_path)
    base = {"tiers": tiers, "dump": str(tmp_path / "dump"), "mode": "disabled", "steps": STEPS, "interval": INTERVAL}
    _run(2, base | {"crash_after": CRASH, "commit_before_crash": True}, tmp_path / "crashed")
    assert mark_bad(tiers, "step-4", "loss spike") == ["local"]
    res = _run(2, base | {"check": reference["record"]}, tmp_path / "resumed")
    for r in res:
        assert r["resumed_from"] == 2 and r["check"] == [], r
        for step, loss in r["losses"].items():
            assert loss == reference["losses"][step], (step, loss, reference["losses"][step])
    ids = [c.id for c in list_checkpoints(tiers)]
    assert "step-04" in ids and "step-4" in ids, ids
    assert latest(tiers, healthy=True) == f"step-{STEPS}"
