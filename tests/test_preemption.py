"""Preemption (issue 22, item 1): SIGTERM drains what is in flight, then the default action runs.

Each test runs a real job (``tests/preempt_child.py``) that saves step-000001, then step-000002,
and stops step-000002 at one point (capture, flush, promotion to S3); the test sends the signal
there, waits until the job's log says the drain started, lets the save go on, and checks how the
process ended, what its log says, and what a restarted job finds (``latest``, a bit-exact load).
The order of events is forced by the job's output and a file, never by timing.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierckpt
from tierckpt import TieredReader, TieredWriter
from tierckpt.catalog.listing import list_checkpoints
from tierckpt.chain.engine import close_all
from tierckpt.config import ConfigError, config_from_dict
from tierckpt.save import preempt
from tierckpt.tiers import make_tiers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHILD = HERE / "preempt_child.py"
FLOATS = 1 << 18  # 1 MiB of state per save
WAIT = 120  # safety net for a broken job, never reached when it works


def config(tmp_path: Path, s3: dict | None = None, **job) -> dict:
    d = {
        "job": {"commit_timeout": 60, **job},
        "host": {"buffer_size": "8MiB", "chunk_size": "1MiB"},
        "local": {"path": str(tmp_path / "local"), "keep": 0, "fsync": False},
    }
    if s3 is not None:
        d["s3"] = s3
    return d


class Job:
    """The child process, its output lines (stdout and stderr apart) as they come."""

    def __init__(self, tmp_path: Path, cfgd: dict, point: str, *extra: str) -> None:
        self.go = tmp_path / "go"
        (tmp_path / "cfg.json").write_text(json.dumps(cfgd))
        env = dict(os.environ, PYTHONPATH=str(ROOT), PREEMPT_FLOATS=str(FLOATS))
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(tmp_path / "cfg.json"), point, str(self.go), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(ROOT),
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._cv = threading.Condition()
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()

    def _pump(self, stream, sink: list[str]) -> None:
        for line in stream:
            with self._cv:
                sink.append(line.rstrip("\n"))
                self._cv.notify_all()

    def wait_line(self, sink: list[str], text: str) -> None:
        with self._cv:
            ok = self._cv.wait_for(lambda: any(text in ln for ln in sink) or self.proc.poll() is not None, WAIT)
        assert ok and any(text in ln for ln in sink), f"no line with {text!r}; stderr: {self.log[-3000:]}"

    def finish(self) -> int:
        rc = self.proc.wait(WAIT)
        time.sleep(0.1)  # the pumps drain the pipes (the process is gone; this only orders output)
        return rc

    @property
    def log(self) -> str:
        return "\n".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(WAIT)


@pytest.fixture(autouse=True)
def _fresh():
    close_all()
    yield
    close_all()


def load_step(cfgd: dict, cid: str = "latest") -> dict:
    out = {"w": torch.zeros(FLOATS), "step": -1}
    dcp.load(out, checkpoint_id=cid, storage_reader=TieredReader(config_from_dict(cfgd)), no_dist=True)
    return out


def expected(i: int) -> torch.Tensor:
    return torch.randn(FLOATS, generator=torch.Generator().manual_seed(i))


def preempt_at(tmp_path: Path, cfgd: dict, point: str, *extra: str, sig: int = signal.SIGTERM) -> tuple[int, Job]:
    job = Job(tmp_path, cfgd, point, *extra)
    try:
        job.wait_line(job.out, f"PAUSED {point}")
        job.proc.send_signal(sig)
        job.wait_line(job.err, "draining")
        if point != "promote":  # a promotion stays stopped: the process must end without it
            job.go.touch()
        return job.finish(), job
    finally:
        job.kill()


@pytest.mark.parametrize("point", ["capture", "flush"])
def test_sigterm_commits_the_checkpoint_in_flight(tmp_path, point):
    cfgd = config(tmp_path)
    rc, job = preempt_at(tmp_path, cfgd, point)
    assert rc == -signal.SIGTERM, job.log[-3000:]  # the default action, after the drain
    log = job.log
    assert "SIGTERM: draining 1 checkpoint(s) in flight" in log
    assert "SIGTERM: step-000002 committed on local (rank 0)" in log
    assert "1 committed, 0 not committed" in log
    assert "SIGTERM: handing over to the default action" in log
    assert tierckpt.latest(config_from_dict(cfgd)) == "step-000002"
    got = load_step(cfgd)
    assert got["step"] == 2 and torch.equal(got["w"], expected(2))


def test_sigterm_during_promotion_keeps_the_local_commit_and_the_next_job_promotes(tmp_path, moto_endpoint, s3cfg):
    import dataclasses

    s3 = dataclasses.asdict(s3cfg(moto_endpoint))
    s3["part_size"] = "5MiB"
    cfgd = config(tmp_path, s3)
    rc, job = preempt_at(tmp_path, cfgd, "promote")
    assert rc == -signal.SIGTERM, job.log[-3000:]
    assert "SIGTERM: step-000002 committed on local (rank 0); not on s3 yet: the next job promotes it" in job.log
    cfg = config_from_dict(cfgd)
    tiers = make_tiers(cfg)
    try:
        on_s3 = {c.checkpoint_id for c in list_checkpoints(tiers[1]) if c.committed}
    finally:
        for t in tiers:
            t.close()
    assert on_s3 == {"step-000001"}  # nothing half-written visible on S3
    assert tierckpt.latest(cfg) == "step-000002"
    got = load_step(cfgd)
    assert got["step"] == 2 and torch.equal(got["w"], expected(2))
    TieredWriter(cfg).wait()  # the next job: its start-up pass promotes the backlog
    close_all()
    s3only = dict(cfgd)
    s3only.pop("local")
    got = load_step(s3only, "step-000002")
    assert got["step"] == 2 and torch.equal(got["w"], expected(2))


def test_sigkill_is_unchanged_nothing_half_written_is_visible(tmp_path):
    cfgd = config(tmp_path)
    job = Job(tmp_path, cfgd, "flush")
    try:
        job.wait_line(job.out, "PAUSED flush")
        job.proc.send_signal(signal.SIGKILL)
        assert job.finish() == -signal.SIGKILL
    finally:
        job.kill()
    cfg = config_from_dict(cfgd)
    assert tierckpt.latest(cfg) == "step-000001"
    tiers = make_tiers(cfg)
    try:
        assert [c.checkpoint_id for c in list_checkpoints(tiers[0]) if c.committed] == ["step-000001"]
    finally:
        for t in tiers:
            t.close()
    with pytest.raises(BaseException, match="step-000002"):  # refused: not committed (DCP wraps the error)
        load_step(cfgd, "step-000002")
    assert load_step(cfgd)["step"] == 1


def test_a_second_sigterm_cuts_the_drain_short(tmp_path):
    """The flush stays stopped; the drain waits; a second SIGTERM hands over at once: the process
    ends without step-000002 (uncommitted, invisible), step-000001 stays latest."""
    cfgd = config(tmp_path)
    job = Job(tmp_path, cfgd, "flush")
    try:
        job.wait_line(job.out, "PAUSED flush")
        job.proc.send_signal(signal.SIGTERM)
        job.wait_line(job.err, "draining")
        job.proc.send_signal(signal.SIGTERM)
        assert job.finish() == -signal.SIGTERM
    finally:
        job.kill()
    assert "SIGTERM again while draining: handing over now" in job.log
    assert tierckpt.latest(config_from_dict(cfgd)) == "step-000001"


def test_the_jobs_own_handler_runs_after_the_drain(tmp_path):
    cfgd = config(tmp_path)
    rc, job = preempt_at(tmp_path, cfgd, "flush", "--handler", "exit7")
    assert rc == 7 and "JOB HANDLER" in job.out, job.log[-3000:]
    assert "SIGTERM: step-000002 committed on local (rank 0)" in job.log
    assert "handing over to the handler installed before tierckpt's (main.<locals>.job_handler)" in job.log
    assert tierckpt.latest(config_from_dict(cfgd)) == "step-000002"


def test_sigint_drains_then_raises_keyboard_interrupt(tmp_path):
    cfgd = config(tmp_path)
    rc, job = preempt_at(tmp_path, cfgd, "flush", sig=signal.SIGINT)
    assert rc == 130 and "KEYBOARD INTERRUPT" in job.out, job.log[-3000:]
    assert "SIGINT: step-000002 committed on local (rank 0)" in job.log
    assert tierckpt.latest(config_from_dict(cfgd)) == "step-000002"


def test_on_sigterm_ignore_leaves_the_signal_alone(tmp_path):
    """The behaviour before: the process ends at once and step-000002 is lost."""
    cfgd = config(tmp_path, on_sigterm="ignore")
    job = Job(tmp_path, cfgd, "flush")
    try:
        job.wait_line(job.out, "PAUSED flush")
        job.proc.send_signal(signal.SIGTERM)
        assert job.finish() == -signal.SIGTERM
    finally:
        job.kill()
    assert "draining" not in job.log
    assert tierckpt.latest(config_from_dict(cfgd)) == "step-000001"


def test_config_keys_are_validated():
    with pytest.raises(ConfigError, match=r"\[job\] on_sigterm"):
        config_from_dict({"job": {"on_sigterm": "save"}, "local": {"path": "/tmp/x"}})
    with pytest.raises(ConfigError, match=r"\[job\] drain_timeout"):
        config_from_dict({"job": {"drain_timeout": 0}, "local": {"path": "/tmp/x"}})
    cfg = config_from_dict({"local": {"path": "/tmp/x"}})
    assert cfg.job.on_sigterm == "drain" and cfg.job.drain_timeout == 20.0


def test_off_the_main_thread_nothing_is_installed_and_the_contract_is_logged(tmp_path, caplog, monkeypatch):
    cfg = config_from_dict(config(tmp_path))
    monkeypatch.setattr(preempt, "_said_off_main", False)
    monkeypatch.setattr(preempt, "installed", lambda: [])  # as in a process where no writer installed it yet
    before = signal.getsignal(signal.SIGTERM)
    got: list[bool] = []
    with caplog.at_level(logging.INFO, logger="tierckpt.preempt"):
        t = threading.Thread(target=lambda: got.append(preempt.install(cfg)))
        t.start()
        t.join()
    assert got == [False]
    assert signal.getsignal(signal.SIGTERM) is before
    assert "off the main thread" in caplog.text and "tierckpt.drain()" in caplog.text


def test_drain_from_any_thread_reports_what_it_committed(tmp_path):
    cfg = config_from_dict(config(tmp_path))
    w = TieredWriter(cfg)
    dcp.save({"w": expected(3), "step": 3}, checkpoint_id="step-000003", storage_writer=w, no_dist=True)
    box: list = []
    t = threading.Thread(target=lambda: box.append(tierckpt.drain(30)))
    t.start()
    t.join(WAIT)
    rep = box[0]
    assert rep.committed == ["step-000003"] and rep.lost == [] and not rep.timed_out
    assert rep.checkpoints[0].line() == "step-000003 committed on local (rank 0)"
    assert tierckpt.latest(cfg) == "step-000003"


def test_drain_waits_for_the_peer_hop_and_names_later_tiers(tmp_path):
    """With [peer] replicas the drain also waits for the peer hop (in one process it has no
    partner: done at once); a later tier it does not wait for is named."""
    from archive_tier import ArchiveTier

    from tierckpt.chain.engine import Engine, register_engine
    from tierckpt.tiers.local import LocalTier

    d = config(tmp_path)
    d["local"]["path"] = str(tmp_path / "local" / "{node}")
    d["peer"] = {"replicas": 1}
    cfg = config_from_dict(d)
    go = threading.Event()

    class Slow(ArchiveTier):  # the archive hop waits: the drain must not
        def copy_from(self, src, key):
            go.wait(WAIT)
            return super().copy_from(src, key)

    local = LocalTier(cfg.local.resolved_path(), fsync=False, node_local=True)
    register_engine(Engine(cfg, tiers=[local, Slow(tmp_path / "archive", fsync=False)]))
    w = TieredWriter(cfg)
    try:
        dcp.save({"w": expected(4), "step": 4}, checkpoint_id="step-000004", storage_writer=w, no_dist=True)
        rep = tierckpt.drain(30)
    finally:
        go.set()
    assert rep.committed == ["step-000004"]
    c = rep.checkpoints[0]
    assert c.peer == "done" and c.later == ["archive"]
    assert c.line() == (
        "step-000004 committed on local (rank 0); peer copies: done; not on archive yet: the next job promotes it"
    )
    w.wait()
