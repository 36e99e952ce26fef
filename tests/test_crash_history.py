"""The history survives a SIGKILL and tells a restart from training (issue 33, item 9).

A real job saves three checkpoints and is SIGKILLed while it trains on; a new process saves three
more. The first job's records are on disk although it never closed (written at commit time),
``advise`` counts no training across the restart, and ``timeline`` marks it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from restore.cli import main
from tierckpt.telemetry.history import group_checkpoints, read_history
from tierckpt.tiers.local import LocalTier

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _child(root: Path, first: int, n: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        [sys.executable, str(HERE / "history_child.py"), str(root), str(first), str(n), *extra],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


def _ids(root: Path) -> list[str]:
    return [r.checkpoint_id for r in group_checkpoints(read_history([LocalTier(root)]))]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("crash") / "ckpt"
    p = _child(root, 1, 3, "hang")
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "SAVED"
        deadline = time.monotonic() + 60  # a bound on a hung job, not a timing assertion
        while _ids(root) != ["step-1", "step-2", "step-3"] and time.monotonic() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        assert _ids(root) == ["step-1", "step-2", "step-3"]  # written while the job ran, without close()
        p2 = _child(root, 4, 3)
        assert p2.wait(120) == 0
    finally:
        if p.poll() is None:
            p.kill()
    toml = root.parent / "tiers.toml"
    toml.write_text(f'[local]\npath = "{root}"\n')
    return toml


def test_a_killed_job_keeps_the_history_of_its_committed_checkpoints(crashed):
    root = crashed.parent / "ckpt"
    runs = group_checkpoints(read_history([LocalTier(root)]))
    assert [r.checkpoint_id for r in runs] == [f"step-{i}" for i in range(1, 7)]
    assert [r.restarted_after(a) for a, r in zip(runs, runs[1:])] == [False, False, True, False, False]


def test_advise_counts_no_training_across_the_restart(crashed, capsys):
    root = crashed.parent / "ckpt"
    runs = group_checkpoints(read_history([LocalTier(root)]))
    across = runs[3].start - runs[2].start  # the kill and the restart (the new process's import)
    assert main(["advise", "--config", str(crashed), "--mtbf", "2d", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["inputs"]
    assert got["restarts"] == 1
    within = [b.start - a.start for a, b in zip(runs, runs[1:]) if not b.restarted_after(a)]
    assert got["s_per_step"] == pytest.approx(sum(within) / len(within))
    assert got["s_per_step"] < across and got["interval_s"] <= max(within)
    assert main(["advise", "--config", str(crashed), "--mtbf", "2d"]) == 0
    assert "1 restart(s) of the job" in capsys.readouterr().out


def test_timeline_marks_the_restart(crashed, tmp_path):
    pytest.importorskip("matplotlib")
    from tierckpt.telemetry.timeline import draw

    runs = group_checkpoints(read_history([LocalTier(crashed.parent / "ckpt")]))
    got = draw(runs, tmp_path / "t.png")
    assert got["restarts"] == 1 and (tmp_path / "t.png").stat().st_size > 0


def test_timeline_cli_says_where_the_job_restarted(crashed, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["timeline", "--config", str(crashed), "--last", "0", "--out", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("step-")]
    assert [("restarted" in ln) for ln in rows] == [False, False, False, True, False, False], out
    assert "1 restart(s) of the job" in out
    assert main(["timeline", "--config", str(crashed), "--last", "0", "--json"]) == 0
    assert [r["restarted"] for r in json.loads(capsys.readouterr().out)] == [False, False, False, True, False, False]


def _synthetic(n: int, restart_at: int, every: float) -> list:
    from tierckpt.telemetry.history import CheckpointRun, RankRecord
    from tierckpt.telemetry.phases import Phase

    runs, t = [], 1.7e9
    for i in range(n):
        if i == restart_at:
            t += 31.0  # killed, then a new process
        phases = [
            Phase("blocked_in_save", t, t + 0.01, True),
            Phase("capture", t + 0.01, t + 0.05, False),
            Phase("flush", t + 0.02, t + 0.08, False),
            Phase("commit", t + 0.08, t + 0.09, False),
        ]
        proc = "1@1" if i < restart_at else "2@2"
        rec = RankRecord(f"step-{i:06d}", f"t{i}", i, 0, 1, 0, "n0", 1, None, {}, phases, process=proc)
        runs.append(CheckpointRun(rec.checkpoint_id, rec.token, i, [rec]))
        t += every
    return runs


@pytest.mark.parametrize("n", [12, 50])
def test_timeline_axis_is_readable_after_a_restart(n, tmp_path):
    pytest.importorskip("matplotlib")
    from tierckpt.telemetry.timeline import draw

    got = draw(_synthetic(n, n // 2, 0.13), tmp_path / "t.png")
    assert got["restarts"] == 1 and len(got["gaps"]) == 1
    assert len(got["xticks"]) >= 5 and len(set(got["xticks"])) == len(got["xticks"]), got["xticks"]  # no "33s 33s"
    assert got["labelled"] <= 46  # names thinned so they do not overlap (one per 1/45 of the axis at most)
