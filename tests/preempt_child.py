"""A job for ``tests/test_preemption.py``: saves step-000001 (waited for), then step-000002, stops
step-000002 at a chosen point and waits there for the test's signal.

    python tests/preempt_child.py CONFIG.json POINT GO_FILE [--handler exit7] [--sigint]
    python tests/preempt_child.py CONFIG.json first GO_FILE
    python tests/preempt_child.py CONFIG.json storm GO_FILE (--handler | --handler-after) stop [--drain]
        [--stop-after N] [--locked jobs|engines|tickets] [--hold-locks]

``CONFIG.json``: the tier configuration as a dict (``config_from_dict``). ``POINT``: where step-000002
stops until ``GO_FILE`` exists: ``capture`` (the capture thread, opening the data file: nothing
copied yet), ``flush`` (the file written, before its fsync and rename: captured, not durable) or
``promote`` (the copy to S3: committed locally). Prints ``PAUSED <POINT>`` once there. Meanwhile
the main thread waits in ``writer.wait_captured()`` (``capture``: the pre-step wait) or trains
(small matmuls) until the signal ends the process. ``--handler exit7``: the job installs its own
SIGTERM handler first (it prints ``JOB HANDLER`` and exits with status 7). Logs go to stderr.

``first``: step-000001 only, not waited for (the first commit of the engine, e.g. with an S3 tier
that never answers); prints ``SAVED`` once ``dcp.save`` returned, then trains until the signal.

``storm``: the job's own "stop after this step" handler, installed before the writer (``--handler
stop``: tierckpt chains to it) or after it (``--handler-after stop``: it replaces tierckpt's); with
``--drain`` it calls ``tierckpt.drain()`` first, as docs/operations.md says; then it counts the
signal. Prints ``READY`` once both handlers are in place, then saves step-000001, 000002, ... with
``wait_captured()`` after each, until the handler counted ``--stop-after`` signals (default 1);
then ``writer.wait()``, prints ``DRAINED <committed> <timed_out>`` (the first ``drain()``'s
report, with ``--drain``) and ``DONE <last id> <signals>``, and returns 0 (SIGTERM ignored from
then on) while the signals may still come. ``--locked NAME``: after step-000001 the job signals
its own main thread while that holds one of tierckpt's locks (``jobs``: ``Engine._jobs_lock``,
``engines``: the engine registry's, ``tickets``: ``AsyncTickets._lock``). ``--hold-locks``: after
every save the job holds one of them for 20 ms (the storm's signals land there too).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tierckpt import TieredWriter  # noqa: E402
from tierckpt.chain.engine import Engine, register_engine  # noqa: E402
from tierckpt.config import config_from_dict  # noqa: E402
from tierckpt.tiers import make_tiers  # noqa: E402

CID = "step-000002"


def state(i: int, n: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(n, generator=g), "step": i}


def pause_here(point: str, go: Path) -> None:
    print(f"PAUSED {point}", flush=True)
    while not go.exists():
        time.sleep(0.01)


class _Sink:
    def __init__(self, real, point: str, go: Path) -> None:
        self._real, self._point, self._go = real, point, go

    def close(self) -> None:
        pause_here(self._point, self._go)
        self._real.close()

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def wrap(tier, point: str, go: Path):
    """Make ``tier`` stop step-000002 at ``point``."""
    real_open, real_copy = tier.open_sink, tier.copy_from

    def open_sink(key: str, size: int):
        if CID in key and point == "capture":
            pause_here(point, go)
        sink = real_open(key, size)
        return _Sink(sink, point, go) if CID in key and point == "flush" else sink

    def copy_from(src, key: str) -> int:
        if CID in key and point == "promote":
            pause_here(point, go)
        return real_copy(src, key)

    tier.open_sink, tier.copy_from = open_sink, copy_from
    return tier


def lock_of(writer, name: str):
    """One of the locks tierckpt's code takes on the main thread while saving."""
    from tierckpt.chain import engine as engine_mod
    from tierckpt.chain import registry

    eng = engine_mod.live_engines()[0]
    return {"jobs": eng._jobs_lock, "engines": registry._engines_lock, "tickets": writer._tickets._lock}[name]


def signal_under_lock(writer, name: str) -> None:
    """SIGTERM to the main thread while it holds one of tierckpt's locks: the handler runs inside
    the ``with`` (the signal interrupts the sleep at the latest), as a signal may at any time."""
    import signal

    with lock_of(writer, name):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        time.sleep(0.2)


def storm(cfg, n: int) -> int:
    """The ``storm`` job (see the module docstring)."""
    import signal

    import tierckpt

    after = "--handler-after" in sys.argv
    use_drain = "--drain" in sys.argv
    stop_after = int(sys.argv[sys.argv.index("--stop-after") + 1]) if "--stop-after" in sys.argv else 1
    signals = [0]

    reports = []

    def job_handler(signum, frame):  # "stop after this step": no I/O, no lock
        if use_drain:
            reports.append(tierckpt.drain())
        signals[0] += 1

    if not after:
        signal.signal(signal.SIGTERM, job_handler)
    writer = TieredWriter(cfg)
    if after:
        signal.signal(signal.SIGTERM, job_handler)
    print("READY", flush=True)
    i, cid = 0, ""
    while signals[0] < stop_after:
        i += 1
        cid = f"step-{i:06d}"
        dcp.save(state(i, n), checkpoint_id=cid, storage_writer=writer, no_dist=True)
        writer.wait_captured()
        if i == 1 and "--locked" in sys.argv:
            signal_under_lock(writer, sys.argv[sys.argv.index("--locked") + 1])
        if "--hold-locks" in sys.argv:  # a signal of the storm lands while a tierckpt lock is held
            with lock_of(writer, ("jobs", "engines", "tickets")[i % 3]):
                time.sleep(0.02)
    writer.wait()
    if reports:
        print(f"DRAINED {len(reports[0].committed)} {reports[0].timed_out}", flush=True)
    print(f"DONE {cid} {signals[0]}", flush=True)
    # Python restores the default disposition while it shuts down: a signal then would end the
    # process by SIGTERM after all. A job that wants its exit status ignores the signal from here.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0


def main() -> int:
    cfg_path, point, go = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    if "--handler" in sys.argv and point != "storm":
        import signal

        def job_handler(signum, frame):
            print("JOB HANDLER", flush=True)
            os._exit(7)

        signal.signal(signal.SIGTERM, job_handler)
    cfg = config_from_dict(json.loads(Path(cfg_path).read_text()))
    n = int(os.environ.get("PREEMPT_FLOATS", str(1 << 20)))
    if point == "storm":
        return storm(cfg, n)
    if point == "first":
        writer = TieredWriter(cfg)
        dcp.save(state(1, n), checkpoint_id="step-000001", storage_writer=writer, no_dist=True)
        print("SAVED", flush=True)
        x = torch.randn(64, 64)
        while True:  # training, until the signal ends the process
            x = torch.tanh(x @ x.T / 64)
            time.sleep(0.01)
    tiers = make_tiers(cfg)
    register_engine(
        Engine(cfg, tiers=[tiers[0]] + [wrap(t, point, go) if point == "promote" else t for t in tiers[1:]])
    )
    writer = TieredWriter(cfg)
    dcp.save(state(1, n), checkpoint_id="step-000001", storage_writer=writer, no_dist=True)
    writer.wait()
    if point in ("capture", "flush"):
        wrap(writer.engine.first_tier, point, go)
    dcp.save(state(2, n), checkpoint_id=CID, storage_writer=writer, no_dist=True)
    print("SAVED", flush=True)
    try:
        if point == "capture":
            writer.wait_captured()  # the pre-step wait: the signal lands here
        x = torch.randn(64, 64)
        while True:  # training
            x = torch.tanh(x @ x.T / 64)
            time.sleep(0.01)
    except KeyboardInterrupt:
        print("KEYBOARD INTERRUPT", flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
