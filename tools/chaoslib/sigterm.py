"""Cases ``hungs3term`` and ``sigstorm``: SIGTERM never costs the local copy, never hangs the job.

``hungs3term``: ``[local]`` + ``[s3]`` at a loopback port that accepts connections and never
answers (default S3 timeouts), ``drain_timeout = 8``; a job saves step-000001 and gets SIGTERM
0-0.5 s after ``dcp.save`` returned. It must end by the signal within the drain timeout, with
step-000001 committed on the local tier (``latest`` there, bit-exact), whatever S3 does.

``sigstorm``: a job with its own "stop after this step" handler, installed before the writer
(tierckpt chains to it) or after it (replacing tierckpt's), calling ``tierckpt.drain()`` or not,
saves every step with ``wait_captured()`` (after 30% of them it holds one of tierckpt's own locks
for 20 ms, as tierckpt does for moments, so that signals land there too) until its handler
counted 1-30 signals, then ``wait()``;
SIGTERM comes every 30 ms from the first save until the process is gone. It must exit 0 with its
last checkpoint ``latest`` and bit-exact. A job still there 60 s into the storm is *hung*.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chaoslib.core import CaseResult, load_state, make_state, short
from chaoslib.env import Child, Env, tail
from tierckpt import latest
from tierckpt.config import config_from_dict
from tierckpt.testing import compare

DRAIN_TIMEOUT = 8.0
HUNG_AFTER = 60.0  # s: a storm trial still running then is hung
ORDERS = ("chained", "chained-drain", "after-drain", "after")


@contextlib.contextmanager
def silent_endpoint() -> Iterator[str]:
    """An S3 endpoint on loopback that accepts every connection and never answers a byte."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(128)
    srv.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(srv.accept()[0])  # kept open, never read, never answered

    t = threading.Thread(target=accept, name="chaos-silent-s3", daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()


def _wait_for(out: Path, text: str, p: Child, timeout: float) -> bool:
    """Whether ``text`` appeared in the child's output before it ended or ``timeout`` passed."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError):
            if text in out.read_text(errors="replace"):
                return True
        if not p.is_alive():
            return False
        time.sleep(0.01)
    return False


def _first_child(payload: dict) -> int:
    """Zygote child: save step-000001 (not waited for), say SAVED, train until the signal."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tierckpt import TieredWriter

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # signed requests reach the silent server
        os.environ.setdefault(k, "chaos")
    writer = TieredWriter(config_from_dict(payload["cfg"]))
    dcp.save(
        make_state(payload["seed"], payload["big"]), checkpoint_id="step-000001", storage_writer=writer, no_dist=True
    )
    print("SAVED", flush=True)
    x = torch.randn(64, 64)
    while True:  # training, until the signal ends the process
        x = torch.tanh(x @ x.T / 64)
        time.sleep(0.01)


def locks(writer: Any) -> list[Any]:
    """Locks of tierckpt's that the main thread takes while saving (a signal may land inside)."""
    from tierckpt.chain import engine as engine_mod
    from tierckpt.chain import registry

    eng = engine_mod.live_engines()[0]
    return [eng._jobs_lock, registry._engines_lock, writer._tickets._lock]


def _storm_child(payload: dict) -> int:
    """Zygote child: the storm job (see the module docstring)."""
    import torch.distributed.checkpoint as dcp

    import tierckpt
    from tierckpt import TieredWriter

    order, stop_after = payload["order"], payload["stop_after"]
    rng = random.Random(payload["seed"])
    signals = [0]

    def job_handler(signum, frame):  # "stop after this step"
        if order.endswith("drain"):
            tierckpt.drain()
        signals[0] += 1

    if order.startswith("chained"):
        signal.signal(signal.SIGTERM, job_handler)
    writer = TieredWriter(config_from_dict(payload["cfg"]))
    if order.startswith("after"):
        signal.signal(signal.SIGTERM, job_handler)
    print("READY", flush=True)
    i = 0
    while signals[0] < stop_after:
        i += 1
        dcp.save(
            make_state(payload["seed"] + i, payload["big"]),
            checkpoint_id=f"step-{i:06d}",
            storage_writer=writer,
            no_dist=True,
        )
        writer.wait_captured()
        if rng.random() < payload["lock_share"]:  # where a signal must be safe too: inside tierckpt, a lock held
            with rng.choice(locks(writer)):
                time.sleep(0.02)
    writer.wait()
    print(f"DONE step-{i:06d} {signals[0]}", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Python restores SIG_DFL while it shuts down
    return 0


def _check_local(res: CaseResult, trial: str, cfgd: dict, cid: str, seed: int, big: int) -> None:
    """``cid`` is ``latest`` on the local tier and loads bit-exact (else lost)."""
    cfg = config_from_dict({k: v for k, v in cfgd.items() if k != "s3"})
    try:
        newest = latest(cfg)
    except BaseException as e:  # noqa: BLE001
        res.lose(trial, f"{cid}: no latest on the local tier: {short(e)}")
        return
    if newest != cid:
        res.lose(trial, f"latest on the local tier is {newest}, expected {cid}")
        return
    expected = make_state(seed, big)
    try:
        got, _reader = load_state(cfg, expected, cid)
    except BaseException as e:  # noqa: BLE001
        res.lose(trial, f"{cid} does not load from the local tier: {short(e)}")
        return
    if diffs := compare(expected, got):
        res.lose(trial, f"{cid} loaded other bytes: {diffs[:3]}")


def _end(p: Child, timeout: float) -> int | None:
    """The exit status, or None (and the child killed) when it is still there after ``timeout``."""
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(10)
        return None
    return p.exitcode


def case_hungs3term(env: Env, trials: int, seed: int) -> CaseResult:
    """Item 5 of issue 32: SIGTERM right after the first save while S3 never answers."""
    res = CaseResult("hungs3term")
    t0 = time.perf_counter()
    rng = random.Random(f"{seed}-hungs3term")
    with silent_endpoint() as url:
        for k in range(trials):
            trial = f"#{k}"
            d = env.fresh("hungs3term")
            cfgd = {
                "job": {"commit_timeout": 30.0, "drain_timeout": DRAIN_TIMEOUT},
                "host": {"buffer_size": "4MiB", "chunk_size": "256KiB"},
                "local": {"path": str(d / "local"), "keep": 2, "fsync": rng.random() < 0.5},
                "s3": {"bucket": "never-answers", "prefix": f"chaos/{d.name}", "endpoint_url": url},
            }
            big = rng.choice([64 << 10, 1 << 20, 3 << 20])
            s, out = seed * 1000 + k, d / "child.out"
            p = env.spawn("sigterm-first", {"cfg": cfgd, "seed": s, "big": big}, out)
            res.trials += 1
            if not _wait_for(out, "SAVED", p, 120):
                res.fail(trial, f"the job did not save: {tail(out)}")
                p.kill()
                continue
            time.sleep(rng.uniform(0.0, 0.5))
            t_sig = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
            rc = _end(p, DRAIN_TIMEOUT + 5.0)
            dt = time.monotonic() - t_sig
            if rc is None:
                res.fail(trial, f"hung: still there {DRAIN_TIMEOUT + 5:.0f} s after SIGTERM: {tail(out)}")
            elif rc != -signal.SIGTERM:
                res.fail(trial, f"exit status {rc}, expected -15 (the default action after the drain): {tail(out)}")
            else:
                res.note(f"ended {int(dt)}-{int(dt) + 1} s after SIGTERM")
            _check_local(res, trial, cfgd, "step-000001", s, big)
            env.cleanup(d)
    res.seconds = time.perf_counter() - t0
    return res


def case_sigstorm(env: Env, trials: int, seed: int) -> CaseResult:
    """Item 6 of issue 32: SIGTERM every 30 ms at a job with its own handler, in every order."""
    res = CaseResult("sigstorm")
    t0 = time.perf_counter()
    rng = random.Random(f"{seed}-sigstorm")
    for k in range(trials):
        order = ORDERS[k % len(ORDERS)]
        trial = f"#{k} {order}"
        d = env.fresh("sigstorm")
        cfgd = {
            "job": {"commit_timeout": 30.0, "drain_timeout": DRAIN_TIMEOUT},
            "host": {"buffer_size": "4MiB", "chunk_size": "256KiB"},
            "local": {"path": str(d / "local"), "keep": 3, "fsync": rng.random() < 0.5},
        }
        big = rng.choice([16 << 10, 256 << 10, 1 << 20])
        stop_after = rng.randint(1, 30)
        s, out = seed * 1000 + k, d / "child.out"
        p = env.spawn(
            "sigterm-storm",
            {"cfg": cfgd, "seed": s, "big": big, "order": order, "stop_after": stop_after, "lock_share": 0.3},
            out,
        )
        res.trials += 1
        if not _wait_for(out, "READY", p, 120):
            res.fail(trial, f"the job did not start: {tail(out)}")
            p.kill()
            continue
        sent, end = 0, time.monotonic() + HUNG_AFTER
        while p.is_alive() and time.monotonic() < end:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
                sent += 1
            time.sleep(0.03)
        rc = _end(p, 1.0)
        res.note(order)
        if rc is None:
            res.fail(trial, f"hung: still there after {sent} signals ({HUNG_AFTER:.0f} s): {tail(out)}")
            continue
        done = [ln.split() for ln in out.read_text(errors="replace").splitlines() if ln.startswith("DONE ")]
        if rc != 0 or not done:
            res.fail(trial, f"exit status {rc} after {sent} signals, expected 0 after DONE: {tail(out)}")
            continue
        _, last, counted = done[0]
        if int(counted) < stop_after:
            res.fail(trial, f"the job's handler counted {counted} signals, it stops after {stop_after}")
        i = int(last.split("-")[1])
        _check_local(res, trial, cfgd, last, s + i, big)
        env.cleanup(d)
    res.seconds = time.perf_counter() - t0
    return res


CHILDREN = {"sigterm-first": _first_child, "sigterm-storm": _storm_child}
