"""The training job of ``tests/test_ops_day.py``: each rank saves ``args["steps"]`` through
``TieredWriter`` (state of :func:`peer_scenarios.state`; each save waits for its peer copy when
``[peer]`` is configured, never for S3), then, with ``args["kill"]``, waits until
its node's ``_history/`` holds the last checkpoint's record and SIGKILLs itself (a crash: no
drain, no close); without, it waits for the same record and exits without waiting for the copies
to S3 (down: they stay a backlog on the local tier, as when a job ends during an outage).

Run by ``run_world(..., script=tests/ops_day_job.py)`` with ``GROUP_RANK`` set per rank, as
torchrun sets it, and ``[local] path = ".../{node}"``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_scenarios import state  # noqa: E402

from tierckpt import TieredWriter  # noqa: E402
from tierckpt.config import config_from_dict  # noqa: E402
from tierckpt.testing import serve  # noqa: E402


def save_steps(args: dict, rank: int, world: int) -> dict:
    """Save ``args["steps"]``; once the last one is in this rank's history, SIGKILL this process
    (``args["kill"]``) or return."""
    cfg = config_from_dict(args["config"])
    w = TieredWriter(cfg)
    last = ""
    for step in args["steps"]:
        last = f"step-{step}"
        dcp.save(state(rank, step, world), checkpoint_id=last, storage_writer=w)
        if args["config"].get("peer"):
            w.wait(tiers="peer")  # S3 is down: never wait for it
        else:
            w.wait_captured()
    history = Path(args["config"]["local"]["path"].replace("{node}", os.environ["GROUP_RANK"]))
    record = history / "_history" / f"g{rank:05d}.json"
    deadline = time.monotonic() + 60  # a bound on a hung job, not a timing assertion
    while time.monotonic() < deadline and not (record.exists() and f'"{last}"' in record.read_text()):
        time.sleep(0.05)
    if args.get("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"saved": args["steps"]}  # serve() ends the process with os._exit(0)


if __name__ == "__main__":
    serve({"save_steps": save_steps})
