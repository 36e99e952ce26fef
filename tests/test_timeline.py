"""The phase history of a real 2-rank job (2 simulated nodes, peer copies), the ``timeline`` picture
drawn from it, and ``advise`` checked against Young's and Daly's formulas."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from distrun import run_world

from restore.cli import main
from tierckpt.telemetry.advise import daly, parse_duration, waste, young
from tierckpt.telemetry.history import group_checkpoints, read_history
from tierckpt.telemetry.timeline import TimeMap
from tierckpt.tiers.local import LocalTier

pytest.importorskip("matplotlib")

HERE = Path(__file__).resolve().parent
STEPS = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """A 2-rank job on nodes n0 and n1 ([peer] replicas = 1) that saved STEPS; its config file."""
    base = tmp_path_factory.mktemp("timeline")
    cfg = {
        "host": {"buffer_size": "16MiB", "chunk_size": "1MiB"},
        "local": {"path": f"{base}/{{node}}", "keep": 2, "flush_threads": 2},
        "peer": {"replicas": 1},
    }
    res = run_world(
        2,
        "save_steps",
        {"config": cfg, "steps": STEPS},
        base / "run",
        script=HERE / "peer_scenarios.py",
        node_of=lambda r: f"n{r}",
    )
    assert all(r["saved"] == STEPS for r in res)
    toml = base / "tiers.toml"
    toml.write_text(f'[host]\nbuffer_size = "16MiB"\n[local]\npath = "{base}/{{node}}"\n[peer]\nreplicas = 1\n')
    return toml


def _runs(toml: Path):
    base = toml.parent
    return group_checkpoints(read_history([LocalTier(base / "n0"), LocalTier(base / "n1")]))


def test_every_rank_keeps_its_phases_on_its_node(job):
    runs = _runs(job)
    assert [r.checkpoint_id for r in runs] == [f"step-{s}" for s in STEPS]  # history outlives retention (keep=2)
    for run in runs:
        assert [x.rank for x in run.ranks] == [0, 1] and [x.node for x in run.ranks] == ["n0", "n1"]
        for x in run.ranks:
            names = [p.name for p in x.phases]
            assert {"blocked_in_save", "capture", "flush", "commit", "hop:peer"} <= set(names), names
            by = {p.name: p for p in x.phases}
            assert by["blocked_in_save"].blocked and not by["flush"].blocked
            assert by["flush"].end <= by["commit"].end <= by["hop:peer"].end  # each stage after the one before
            assert x.stats["bytes"] == x.bytes > 0 and x.error is None
    assert all(a.start < b.start for a, b in zip(runs, runs[1:]))


def test_timeline_draws_a_png_of_the_job(job, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERCKPT_NODE", "n0")  # the CLI runs on node n0 and reads n1's directory too
    out = tmp_path / "timeline.png"
    assert main(["--config", str(job), "timeline", "--last", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step-2" in text and "step-4" in text and "step-1" not in text.split("wrote")[0]
    assert "peer=" in text and f"wrote {out}: 3 checkpoint(s)" in text
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert main(["--config", str(job), "timeline", "--ranks", "1", "--out", str(tmp_path / "r1.png")]) == 0
    assert "(ranks [1] of 2)" in capsys.readouterr().out
    assert main(["--config", str(job), "timeline", "--ranks", "5", "--out", str(tmp_path / "r5.png")]) == 2
    assert main(["--config", str(job), "timeline", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["id"] for d in doc] == [f"step-{s}" for s in STEPS[-5:]] and len(doc[0]["ranks"]) == 2


def test_timeline_without_history_says_so(tmp_path, capsys):
    toml = tmp_path / "t.toml"
    toml.write_text(f'[local]\npath = "{tmp_path / "empty"}"\n')
    assert main(["--config", str(toml), "timeline", "--out", str(tmp_path / "x.png")]) == 1
    assert "no checkpoint history" in capsys.readouterr().err


def test_advise_follows_young_and_daly(job, monkeypatch, capsys):
    monkeypatch.setenv("TIERCKPT_NODE", "n0")
    assert main(["--config", str(job), "advise", "--mtbf", "8h", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    runs = _runs(job)
    blocked = statistics.median(
        max(x.seconds("blocked_in_save") + x.seconds("prestep_wait") for x in r.ranks) for r in runs
    )
    cpu = statistics.median(max(x.stats["cpu_s"] for x in r.ranks) for r in runs)
    delta, m = blocked + cpu, 8 * 3600.0
    assert got["mtbf_s"] == m and got["inputs"]["blocked_s"] == pytest.approx(blocked)
    assert got["inputs"]["background_cpu_s"] == pytest.approx(cpu) and got["delta_s"] == pytest.approx(delta)
    assert got["young_s"] == pytest.approx(math.sqrt(2 * delta * m))
    r = delta / (2 * m)
    assert got["daly_s"] == pytest.approx(math.sqrt(2 * delta * m) * (1 + math.sqrt(r) / 3 + r / 9) - delta)
    assert got["steps"] == max(1, round(got["daly_s"] / got["inputs"]["s_per_step"]))
    assert main(["--config", str(job), "advise", "--mtbf", "8h", "--cpu-weight", "0"]) == 0
    text = capsys.readouterr().out
    assert "Young  τ = sqrt(2·δ·M)" in text and "Daly" in text and "28800 s" in text
    assert "if background CPU costs training nothing" not in text  # w = 0 already
    with pytest.raises(SystemExit) as e:
        main(["--config", str(job), "advise", "--mtbf", "soon"])
    assert e.value.code == 2 and "not a duration" in capsys.readouterr().err


def test_the_formulas():
    # Young: sqrt(2 δ M); Daly's higher-order form; Daly's interval is M once δ >= 2M
    assert young(60, 86400) == pytest.approx(math.sqrt(2 * 60 * 86400))
    assert daly(60, 86400) == pytest.approx(
        3219.938 * (1 + math.sqrt(60 / 172800) / 3 + 60 / 172800 / 9) - 60, rel=1e-5
    )
    assert daly(100, 40) == 40
    # Daly's interval (nearly) minimises his complete model of the time lost
    for delta, mtbf, restart in ((60, 86400, 0), (5, 3600, 120), (0.5, 28800, 0)):
        tau = daly(delta, mtbf)
        best = min((waste(tau * f / 1000, delta, mtbf, restart), f) for f in range(500, 2000))
        assert waste(tau, delta, mtbf, restart) <= best[0] * 1.001
        assert waste(tau, delta, mtbf, restart) < waste(0.5 * tau, delta, mtbf, restart)
        assert waste(tau, delta, mtbf, restart) < waste(2 * tau, delta, mtbf, restart)
    assert [parse_duration(x) for x in ("8h", "90m", "2d", "45s", "1h30m", "3600", "1.5h")] == [
        28800,
        5400,
        172800,
        45,
        5400,
        3600,
        5400,
    ]
    for bad in ("", "soon", "-5", "8x", "0"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_long_idle_gaps_are_shortened_and_short_ones_kept():
    m = TimeMap.build([(0, 10), (12, 20), (1800, 1830)])
    assert m.gaps == [(20, 1800)]
    assert m.x(5) == 5 and m.x(15) == 15 and m.real(15) == 15
    assert m.x(1800) == pytest.approx(20 + 0.6 * 30) and m.real(m.x(1815)) == pytest.approx(1815)
    assert m.real(m.x(900)) is None  # inside the shortened gap
    assert TimeMap.build([(0, 1), (2, 3), (4, 5)]).gaps == []
