"""SIGTERM never costs the local copy and never hangs the process (issue 32, items 5 and 6).

Real processes (``tests/preempt_child.py``), real signals:

* **hung S3** (item 5): ``[local]`` + ``[s3]`` at a loopback port that accepts connections and
  never answers; the job saves step-000001 and is sent SIGTERM right after ``dcp.save`` returned.
  The first commit must not wait on S3 (its commit number comes from the first tier), so the drain
  commits it on the local tier and the process ends by the signal; a restarted job finds it.
* **signal storm** (item 6): a job whose own "stop after this step" handler is installed before
  the writer (tierckpt chains to it) or after it (it replaces tierckpt's), calling
  ``tierckpt.drain()`` or not, saves every step with ``wait_captured()``; SIGTERM comes every
  30 ms until the process is gone. The handler interrupts the main thread anywhere, maybe while
  it holds one of tierckpt's locks: the job must still see its signals, finish its loop and its
  ``wait()``, and exit 0.

The order of events is forced by the job's output, never by timing; the storm's 30 ms is the load,
not an assertion. ``WAIT`` is only the safety net that turns a hang into a failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tierckpt
from tierckpt.config import config_from_dict

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHILD = HERE / "preempt_child.py"
WAIT = 60.0  # a hang turns into a failure after this; never reached when it works


class Child:
    """``preempt_child.py`` in a process of its own; its output lines as they come."""

    def __init__(self, tmp_path: Path, cfgd: dict, mode: str, *extra: str, floats: int = 1 << 16) -> None:
        (tmp_path / "cfg.json").write_text(json.dumps(cfgd))
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            PREEMPT_FLOATS=str(floats),
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(tmp_path / "cfg.json"), mode, str(tmp_path / "go"), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(ROOT),
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._cv = threading.Condition()
        self._pumps = [
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True)
            for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for t in self._pumps:
            t.start()

    def _pump(self, stream, sink: list[str]) -> None:
        for line in stream:
            with self._cv:
                sink.append(line.rstrip("\n"))
                self._cv.notify_all()

    def wait_line(self, text: str) -> None:
        with self._cv:
            ok = self._cv.wait_for(lambda: any(text in ln for ln in self.out) or self.proc.poll() is not None, WAIT)
        assert ok and any(text in ln for ln in self.out), f"no line {text!r}; stderr: {self.log[-3000:]}"

    def finish(self) -> int | None:
        """The exit status, or None when the process is still there after ``WAIT`` s (hung)."""
        try:
            rc = self.proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            return None
        for t in self._pumps:
            t.join(WAIT)
        return rc

    @property
    def log(self) -> str:
        return "\n".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(WAIT)


def local_cfg(tmp_path: Path, **job) -> dict:
    return {
        "job": {"commit_timeout": 60, **job},
        "host": {"buffer_size": "4MiB", "chunk_size": "1MiB"},
        "local": {"path": str(tmp_path / "local"), "keep": 3, "fsync": False},
    }


@pytest.fixture
def silent_s3() -> Iterator[str]:
    """An S3 endpoint on loopback that accepts every connection and never answers a byte."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            held.append(conn)  # kept open, never read from, never written to

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()


def test_hung_s3_does_not_hold_back_the_first_local_commit(tmp_path, silent_s3):
    """Item 5: the drain commits step-000001 on the local tier although S3 never answers."""
    cfgd = local_cfg(tmp_path, drain_timeout=8)
    cfgd["s3"] = {"bucket": "never", "prefix": "ckpt", "endpoint_url": silent_s3}  # default timeouts
    job = Child(tmp_path, cfgd, "first")
    try:
        job.wait_line("SAVED")
        job.proc.send_signal(signal.SIGTERM)
        rc = job.finish()
    finally:
        job.kill()
    assert rc == -signal.SIGTERM, job.log[-3000:]
    assert "SIGTERM: step-000001 committed on local (rank 0); not on s3 yet: the next job promotes it" in job.log
    assert "1 committed, 0 not committed" in job.log
    local_only = {k: v for k, v in cfgd.items() if k != "s3"}
    assert tierckpt.latest(config_from_dict(local_only)) == "step-000001"


@pytest.mark.parametrize(
    "order,use_drain",
    [("before", False), ("before", True), ("after", True)],
    ids=["chained", "chained-drain", "after-drain"],  # ("after", False), a control: chaos sigstorm
)
def test_sigterm_storm_never_hangs(tmp_path, order, use_drain):
    """Item 6: SIGTERM every 30 ms, the job's own handler before or after the writer's, with or
    without ``tierckpt.drain()`` in it, and after every save the job holding one of tierckpt's
    locks for 20 ms (where the main thread may be when a signal comes): the job counts its
    signals, finishes and exits 0."""
    cfgd = local_cfg(tmp_path, drain_timeout=8)
    extra = ["--handler" if order == "before" else "--handler-after", "stop", "--stop-after", "15", "--hold-locks"]
    if use_drain:
        extra.append("--drain")
    job = Child(tmp_path, cfgd, "storm", *extra)
    sent = 0
    try:
        job.wait_line("READY")
        deadline = time.monotonic() + WAIT
        while job.proc.poll() is None and time.monotonic() < deadline:
            job.proc.send_signal(signal.SIGTERM)
            sent += 1
            time.sleep(0.03)
        rc = job.finish()
    finally:
        job.kill()
    assert rc == 0, f"exit status {rc} after {sent} signals (None: hung); out: {job.out}; stderr: {job.log[-3000:]}"
    done = [ln for ln in job.out if ln.startswith("DONE ")]
    assert done, job.log[-3000:]
    _, last, counted = done[0].split()
    assert int(counted) >= 15
    assert tierckpt.latest(config_from_dict(cfgd)) == last


@pytest.mark.parametrize("lock", ["jobs", "engines", "tickets"])
@pytest.mark.parametrize("order", ["chained", "after-drain"])
def test_sigterm_while_the_main_thread_holds_a_lock(tmp_path, lock, order):
    """Item 6, made certain: the signal reaches the main thread while it holds one of tierckpt's
    locks. The drain needs none of them: it finishes (not given up), the job's handler runs, the
    job goes on and exits 0."""
    cfgd = local_cfg(tmp_path, drain_timeout=8)
    extra = ["--handler", "stop"] if order == "chained" else ["--handler-after", "stop", "--drain"]
    job = Child(tmp_path, cfgd, "storm", *extra, "--locked", lock)
    try:
        rc = job.finish()
    finally:
        job.kill()
    assert rc == 0, f"exit status {rc} (None: hung); out: {job.out}; stderr: {job.log[-3000:]}"
    assert any(ln.startswith("DONE step-000001 1") for ln in job.out), job.out
    if order == "chained":
        done = [ln for ln in job.err if "SIGTERM: drain done in" in ln]
        assert done and "0 not committed" in done[0] and "timeout" not in done[0], job.log[-3000:]
        assert "handing over to the handler installed before tierckpt's" in job.log
    else:
        assert "DRAINED 1 False" in job.out, job.out  # step-000001 committed, the drain not cut short
    assert tierckpt.latest(config_from_dict(cfgd)) == "step-000001"
