"""Issue 35, resume side: bad marks, ``latest(healthy=True)``, retention, and the rolling-back resume.

Real parts: a local tier and an S3 tier (moto's server over HTTP), checkpoints written by the real
writer and replicated to S3, damaged the way the field damages them (a byte flipped in the file on
disk and in the S3 object, a byte flipped in the read buffer before delivery, NaN saved by a
diverged model), and the real ``tierckpt-restore`` entry point for the marks.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3servers import s3_client

import tierckpt
from restore.cli import main as restore_main
from tierckpt import TieredReader, TieredWriter
from tierckpt.catalog.listing import list_checkpoints as list_tier
from tierckpt.chain.engine import close_all
from tierckpt.chain.retention import plan_retention
from tierckpt.config import config_from_dict
from tierckpt.errors import CheckpointMarkedBad, ChecksumMismatch, find_error
from tierckpt.format.layout import data_key
from tierckpt.tiers import make_tiers
from tierckpt.tiers.local import LocalTier

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "assuming no_dist" in one process

REJECT_STEP = 2  # what reject_step_2 (the on_resume_check below) refuses


def reject_step_2(state: dict) -> None:
    """An ``on_resume_check``: the loaded state of step 2 is 'wrong' (say, a loss probe failed)."""
    if int(state["step"]) == REJECT_STEP:
        raise ValueError("loss probe on the loaded model: 7.9 (expected < 3)")


@pytest.fixture(autouse=True)
def _fresh():
    close_all()
    yield
    close_all()


def make(tmp_path: Path, s3: Any = None, *, keep: int = 0, **job: Any) -> tuple[Any, Path]:
    """A config built as a TOML file would be, and that TOML file (for the CLI)."""
    d: dict[str, dict[str, Any]] = {
        "job": {"commit_timeout": 30, **job},
        "host": {"buffer_size": "8MiB", "chunk_size": "1MiB"},
        "local": {"path": str(tmp_path / "local"), "keep": keep, "fsync": False},
    }
    if s3 is not None:
        d["s3"] = {k: v for k, v in dataclasses.asdict(s3).items() if isinstance(v, (str, int, float)) and v != ""}
        d["s3"]["part_size"] = "5MiB"
    path = tmp_path / "tiers.toml"
    path.write_text(
        "".join(
            f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in body.items()) for name, body in d.items()
        )
    )
    return config_from_dict(d, str(path)), path


def state(i: int) -> dict:
    return {"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(i)), "step": i}


def save_all(cfg: Any, steps: list[int], nan_at: int | None = None) -> None:
    w = TieredWriter(cfg)
    for i in steps:
        sd = state(i)
        if i == nan_at:
            sd["w"][7, 7] = float("nan")
        dcp.save(sd, checkpoint_id=f"step-{i}", storage_writer=w)
        w.wait_captured()
    w.wait()
    close_all()


def cli(toml: Path, *args: str, capsys=None) -> str:
    assert restore_main(["--config", str(toml), *args]) == 0
    return capsys.readouterr().out if capsys is not None else ""


def flip_everywhere(tmp_path: Path, s3: Any, cid: str) -> None:
    """One byte of ``cid``'s tensor flipped in its file on disk and in its object on S3."""
    (f,) = list((tmp_path / "local").rglob(f"{cid}/*.data"))
    b = bytearray(f.read_bytes())
    b[1000] ^= 0x20
    f.write_bytes(bytes(b))
    client = s3_client(s3.endpoint_url)
    key = f"{s3.prefix}/{data_key(cid, f.name)}"
    raw = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    raw[1000] ^= 0x20
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(raw))


# -- marks, latest, list, retention --------------------------------------------------------------


def test_mark_bad_is_on_every_tier_and_honoured_by_latest_list_and_retention(
    tmp_path, moto_endpoint, s3cfg, capsys
) -> None:
    s3 = s3cfg(moto_endpoint)
    cfg, toml = make(tmp_path, s3)
    save_all(cfg, [1, 2, 3])
    out = cli(toml, "mark", "step-3", "bad", "--reason", "loss spike at 2990", capsys=capsys)
    assert "marked bad on local, s3" in out
    assert json.loads((tmp_path / "local" / "step-3" / "bad.json").read_bytes())["reason"] == "loss spike at 2990"
    body = s3_client(moto_endpoint).get_object(Bucket=s3.bucket, Key=f"{s3.prefix}/step-3/bad.json")["Body"].read()
    assert json.loads(body)["reason"] == "loss spike at 2990"

    assert tierckpt.latest(cfg) == "step-3"  # what TieredReader's "latest" still names
    assert tierckpt.latest(cfg, healthy=True) == "step-2"
    assert [(c.id, c.bad) for c in tierckpt.list_checkpoints(cfg)] == [
        ("step-1", False),
        ("step-2", False),
        ("step-3", True),
    ]
    listed = json.loads(cli(toml, "list", "--json", capsys=capsys))
    assert {e["checkpoint_id"]: [t["bad"] for t in e["tiers"].values()] for e in listed} == {
        "step-1": [False, False],
        "step-2": [False, False],
        "step-3": [True, True],
    }
    assert "committed, bad" in cli(toml, "list", capsys=capsys)

    # retention: keep = 2 would keep step-2 and step-3; step-3 is bad, so the two newest
    # healthy ones stay (and step-3, newer than them) and nothing is deleted yet
    (local,) = [t for t in make_tiers(cfg) if t.name == "local"]
    plan = plan_retention(list_tier(local), keep=2)
    assert plan.delete == []
    plan = plan_retention(list_tier(local), keep=1)
    assert [d for d, _ in plan.delete] == ["step-1"]  # step-2 is the newest healthy: kept, not step-3 alone
    # a real save with keep = 2 on the first tier: step-4 commits, step-2 stays beside it
    cfg2, _ = make(tmp_path, s3, keep=2)
    save_all(cfg2, [4])
    left = sorted(p.parent.name for p in (tmp_path / "local").glob("*/metadata.json"))
    assert left == ["step-2", "step-3", "step-4"]
    save_all(cfg2, [5])  # now step-3 is older than the healthy ones kept: it goes too
    left = sorted(p.parent.name for p in (tmp_path / "local").glob("*/metadata.json"))
    assert left == ["step-4", "step-5"]

    cli(toml, "mark", "step-5", "bad", capsys=capsys)
    assert tierckpt.latest(cfg, healthy=True) == "step-4"
    cli(toml, "mark", "step-5", "good", capsys=capsys)
    assert tierckpt.latest(cfg, healthy=True) == "step-5"
    assert not (tmp_path / "local" / "step-5" / "bad.json").exists()


def test_a_checkpoint_saved_with_nan_is_skipped(tmp_path) -> None:
    cfg, _ = make(tmp_path, nonfinite="warn")
    save_all(cfg, [1, 2], nan_at=2)
    assert tierckpt.latest(cfg) == "step-2"
    assert tierckpt.latest(cfg, healthy=True) == "step-1"
    (c,) = [c for c in tierckpt.list_checkpoints(cfg) if c.id == "step-2"]
    assert not c.bad  # recorded in its metadata, not marked


# -- the resume loop ------------------------------------------------------------------------------


def test_resume_rolls_back_past_bad_newest_checkpoints_bounded(tmp_path, moto_endpoint, s3cfg) -> None:
    s3 = s3cfg(moto_endpoint)
    cfg, toml = make(
        tmp_path, s3, nonfinite="warn", on_resume_check="test_healthy_resume:reject_step_2", max_rollbacks=1
    )
    save_all(cfg, [1, 2, 3, 4, 5], nan_at=5)  # step-5: the model diverged (NaN recorded)
    flip_everywhere(tmp_path, s3, "step-4")  # step-4: damaged on disk and on S3
    assert restore_main(["--config", str(toml), "mark", "step-3", "bad", "--reason", "bad data shard"]) == 0
    # step-2: the resume check rejects it on rank 0

    out = {"w": torch.zeros(256, 256), "step": -1}
    with pytest.raises(CheckpointMarkedBad) as e:
        tierckpt.resume(out, cfg)  # max_rollbacks = 1: step-4 (checksums), step-2 (check): gives up
    assert "step-4: cannot be loaded from any tier (ChecksumMismatch" in str(e.value)
    assert "step-2: the resume check rejected it (ValueError: loss probe" in str(e.value)
    # both are marked now, with why, on every tier holding them
    marks = {c.id: c.bad for c in tierckpt.list_checkpoints(cfg)}
    assert marks == {"step-1": False, "step-2": True, "step-3": True, "step-4": True, "step-5": False}
    assert "resume: the resume check" in (tmp_path / "local" / "step-2" / "bad.json").read_text()

    # the next start: nothing left to roll past
    out = {"w": torch.zeros(256, 256), "step": -1}
    assert tierckpt.resume(out, cfg) == "step-1"
    assert out["step"] == 1 and torch.equal(out["w"], state(1)["w"])
    # a fresh start when nothing healthy is left
    assert restore_main(["--config", str(toml), "mark", "step-1", "bad"]) == 0
    assert tierckpt.resume(out, cfg) is None


def test_read_buffer_flipped_before_delivery_is_never_delivered(tmp_path, moto_endpoint, s3cfg, monkeypatch) -> None:
    s3 = s3cfg(moto_endpoint)
    cfg, _ = make(tmp_path, s3)
    save_all(cfg, [1])
    real = LocalTier.read_ranges
    flips: list[int] = []

    def read_ranges(self, key, start, bufs):  # the local tier's bytes, then a flip in the buffer
        real(self, key, start, bufs)
        if key.endswith(".data") and bufs and len(bufs[0]) > 100:
            bufs[0][100] ^= 0x01
            flips.append(start)

    monkeypatch.setattr(LocalTier, "read_ranges", read_ranges)
    out = {"w": torch.zeros(256, 256), "step": -1}
    dcp.load(out, checkpoint_id="step-1", storage_reader=TieredReader(cfg))
    assert flips and torch.equal(out["w"], state(1)["w"])  # caught, and served from S3 instead
    # without a second tier the load fails; nothing flipped is delivered
    cfg_local, _ = make(tmp_path)
    out = {"w": torch.zeros(256, 256), "step": -1}
    with pytest.raises(BaseException) as e:  # DCP's CheckpointException is a BaseException
        dcp.load(out, checkpoint_id="step-1", storage_reader=TieredReader(cfg_local))
    assert find_error(e.value, ChecksumMismatch) is not None


def test_lightning_resumes_healthy_by_default(tmp_path) -> None:
    """``ckpt_path="last"`` naming a checkpoint marked bad loads the run's newest healthy one (an
    unhealthy checkpoint resolves as an uncommitted one would); a path with nothing healthy to
    resolve to raises; ``healthy = False`` loads what the path names."""
    pytest.importorskip("lightning")
    from tierckpt.integrations.lightning import TierckptCheckpointIO

    cfg, _ = make(tmp_path)
    ck = tmp_path / "ckpt"
    ck.mkdir()
    io = TierckptCheckpointIO(cfg)
    for step, name in ((2, "epoch=0-step=2.ckpt"), (4, "epoch=0-step=4.ckpt"), (5, "last.ckpt")):
        io.save_checkpoint({"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step}, str(ck / name))
    io.teardown()
    ids = {c.id.rpartition("@")[2]: c.id for c in tierckpt.list_checkpoints(cfg)}
    for name in ("epoch=0-step=4.ckpt", "last.ckpt"):
        tierckpt.mark_bad(cfg, ids[name], "diverged")
    io = TierckptCheckpointIO(cfg)
    assert io.load_checkpoint(str(ck / "last.ckpt"))["global_step"] == 2
    tierckpt.mark_bad(cfg, ids["epoch=0-step=2.ckpt"], "bad data")
    with pytest.raises(CheckpointMarkedBad, match="no healthy checkpoint to load"):
        io.load_checkpoint(str(ck / "epoch=0-step=4.ckpt"))
    with pytest.raises(CheckpointMarkedBad):
        io.load_checkpoint(str(ck / "last.ckpt"))
    io.paths.healthy = False
    assert io.load_checkpoint(str(ck / "epoch=0-step=4.ckpt"))["global_step"] == 4
    io.teardown()


def test_accelerate_load_state_picks_the_newest_healthy_checkpoint(tmp_path) -> None:
    """``load_state()`` with automatic naming resolves through ``TierckptState.latest()``: the
    run's newest ``checkpoint_<n>`` that is healthy (``healthy = False``: the newest)."""
    pytest.importorskip("accelerate")
    from types import SimpleNamespace

    from tierckpt.integrations.accelerate import TierckptState

    cfg, _ = make(tmp_path, nonfinite="warn")
    w = TieredWriter(cfg)
    for n in range(3):
        sd = state(n)
        if n == 2:
            sd["w"][0, 0] = float("inf")  # the newest diverged
        dcp.save(sd, checkpoint_id=f"run1@checkpoint_{n}", storage_writer=w)
    w.wait()
    tierckpt.mark_bad(cfg, "run1@checkpoint_1", "bad batch")
    st = TierckptState(accelerator=SimpleNamespace(project_dir=str(tmp_path)), writer=w, run="run1")
    assert st.latest() == "run1@checkpoint_0"
    st.healthy = False
    assert st.latest() == "run1@checkpoint_2"
