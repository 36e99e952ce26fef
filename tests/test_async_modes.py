"""Every DCP async mode, path-style ids, the public catalog API and an exit-safe lifecycle.

Multi-rank cases are real gloo processes (tests/async_scenarios.py); states are tiny.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt import TieredReader, TieredWriter
from tierckpt.catalog.checkpoints import checkpoint_id_of, latest, list_checkpoints
from tierckpt.config import config_from_dict
from tierckpt.testing.bitexact import compare
from tierckpt.testing.launch import run_world
from tierckpt.testing.state import clone_state, placeholder

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "async_scenarios.py"


def _cfg_dict(root: Path) -> dict:
    return {
        "host": {"buffer_size": "4MiB", "chunk_size": "1MiB"},
        "local": {"path": str(root / "ckpt"), "keep": 0, "fsync": False},
    }


@pytest.mark.parametrize(
    "mode,stager,saves",
    [
        ("thread", False, 3),
        ("thread", True, 3),
        ("process", False, 10),  # the case: 10 repetitions, each loaded right after its future
        ("process", True, 3),
    ],
)
def test_async_modes_two_ranks_bit_exact(tmp_path, mode, stager, saves):
    res = run_world(
        2,
        "modes",
        {"config": _cfg_dict(tmp_path), "mode": mode, "stager": stager, "saves": saves, "prefix": "s"},
        tmp_path / "w",
        script=SCRIPT,
        timeout=240,
    )
    for r in res:
        assert r["errors"] == [], r
        assert len(r["shapes"]) == saves
        # A stager that stages asynchronously (DCP's DefaultStager here) gets DCP's AsyncSaveResponse.
        assert set(r["shapes"]) == ({"AsyncSaveResponse"} if stager else {"Future"})


def test_writer_pickles_as_its_configuration(tmp_path):
    cfg = config_from_dict(_cfg_dict(tmp_path))
    w = TieredWriter(cfg)
    copy = pickle.loads(pickle.dumps(w))
    assert isinstance(copy, TieredWriter) and copy.detached and not w.detached
    assert copy.cfg == cfg


def test_detached_writer_returns_committed_no_dist(tmp_path):
    """A detached writer (as in DCP's checkpoint process): dcp.save returns once committed."""
    cfg = config_from_dict(_cfg_dict(tmp_path))
    w = pickle.loads(pickle.dumps(TieredWriter(cfg)))
    sd = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    dcp.save(sd, checkpoint_id="d-1", storage_writer=w, no_dist=True)
    assert latest(cfg) == "d-1"  # committed when dcp.save returned, without wait()
    got = placeholder(sd)
    dcp.load(got, checkpoint_id="d-1", storage_reader=TieredReader(cfg), no_dist=True)
    assert compare(sd, got) == []


def test_path_style_ids_and_catalog(tmp_path):
    cfg = config_from_dict(_cfg_dict(tmp_path))
    assert checkpoint_id_of("/dump/checkpoint/step-10") == "step-10"
    assert checkpoint_id_of(Path("/dump/checkpoint/step-10/")) == "step-10"
    assert checkpoint_id_of("step-10") == "step-10"
    assert not TieredWriter.validate_checkpoint_id("/dump/checkpoint/..")
    assert not TieredWriter.validate_checkpoint_id("../step-5") and not TieredReader.validate_checkpoint_id("a/../b")
    assert not TieredWriter.validate_checkpoint_id("/dump/checkpoint/bad id")
    assert TieredReader.validate_checkpoint_id("/dump/checkpoint/step-10")
    assert latest(cfg) is None and list_checkpoints(cfg) == []
    w = TieredWriter(cfg)
    states = {}
    for step in (2, 4):
        sd = {"x": torch.full((64,), float(step)), "step": step}
        states[step] = clone_state(sd)
        dcp.save(sd, checkpoint_id=tmp_path / "dump" / "checkpoint" / f"step-{step}", storage_writer=w, no_dist=True)
    w.wait()
    assert latest(cfg) == "step-4"
    assert latest(cfg.source or cfg) == "step-4"
    cps = list_checkpoints(cfg)
    assert [(c.id, c.step, c.tiers, c.peer_copies) for c in cps] == [
        ("step-2", 2, ("local",), False),
        ("step-4", 4, ("local",), False),
    ]
    assert all(isinstance(c.committed, float) for c in cps) and cps[0].committed <= cps[1].committed
    # the same answers as tierckpt-restore list / latest
    from restore.catalog import find_latest, list_all, open_tiers

    tiers = open_tiers(cfg)
    assert [l.checkpoint_id for l in list_all(tiers) if l.committed_anywhere] == [c.id for c in cps]
    assert find_latest(tiers).checkpoint_id == latest(cfg)
    got = placeholder(states[2])
    dcp.load(got, checkpoint_id=str(tmp_path / "elsewhere" / "step-2"), storage_reader=TieredReader(cfg), no_dist=True)
    assert compare(states[2], got) == []
    with pytest.raises(BaseException, match="invalid checkpoint id"):
        dcp.save({"x": torch.zeros(1)}, checkpoint_id="/dump/bad id", storage_writer=w, no_dist=True)


def test_catalog_reads_a_toml_path_and_the_environment(tmp_path, monkeypatch):
    toml = tmp_path / "tiers.toml"
    toml.write_text(f'[local]\npath = "{tmp_path / "ckpt"}"\nfsync = false\n')
    w = TieredWriter(str(toml))
    dcp.save({"x": torch.ones(8)}, checkpoint_id="step-7", storage_writer=w, no_dist=True)
    w.close()
    w.close()  # idempotent
    assert latest(toml) == "step-7"
    monkeypatch.setenv("TIERCKPT_CONFIG", str(toml))
    assert latest() == "step-7" and [c.id for c in list_checkpoints()] == ["step-7"]


def test_close_from_del_and_at_exit_never_raises(tmp_path):
    """close() twice, from __del__ (kept alive until interpreter shutdown) and wait() at exit:
    the process exits 0 with nothing on stderr but the log, and the checkpoint is committed."""
    toml = tmp_path / "tiers.toml"
    toml.write_text(f'[local]\npath = "{tmp_path / "ckpt"}"\nfsync = false\n')
    code = textwrap.dedent(f"""
        import atexit, sys
        sys.path.insert(0, {str(HERE.parent)!r})
        import torch, torch.distributed.checkpoint as dcp
        from tierckpt import TieredWriter

        class Manager:
            def __init__(self):
                self.w = TieredWriter({str(toml)!r})
            def close(self):
                self.w.close_quietly()
            def __del__(self):
                self.close()

        m = Manager()
        dcp.save({{"x": torch.ones(4096)}}, checkpoint_id="step-1", storage_writer=m.w, no_dist=True)
        m.close()
        m.close()
        dcp.save({{"x": torch.zeros(4096)}}, checkpoint_id="step-2", storage_writer=m.w, no_dist=True)
        atexit.register(m.w.wait)   # wait() during interpreter exit
        sys.modules["__main__"].keep = m  # __del__ runs during interpreter shutdown
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr[-3000:]
    assert latest(toml) == "step-2"
