"""Ranks of the scale harness (:mod:`tierckpt.testing.scale`): run as
``python tierckpt/testing/scale_worker.py SCENARIO ARGS_JSON RESULT_PATH`` by
:func:`tierckpt.testing.launch.run_world`, one process per rank, joined by gloo.

Every scenario installs the counters (:mod:`tierckpt.testing.counting`) before it creates any
tierckpt object, runs its work in counted phases and returns ``{"counts": <phase -> counts>, ...}``
with facts that show the run was the one intended (which checkpoint was loaded, which tier served
each file, bit-exact comparison). The state: each rank's own ``own_bytes`` of random bits
(key ``r<rank>``), one tensor that every rank holds alike (``shared``, written once by DCP's
de-duplication) and the step.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: import this tree's tierckpt, not the script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from collections.abc import Callable  # noqa: E402
from typing import Any

SHARED_ELEMS = 4096  # float32: 16 KiB held alike by every rank


def state(rank: int, step: int, own_bytes: int) -> dict:
    """What ``rank`` saves at ``step``: ``own_bytes`` of its own, a replicated tensor, the step."""
    import torch

    from tierckpt.testing import bits

    return {
        f"r{rank}": bits((own_bytes // 4,), torch.float32, 1000 * step + rank),
        "shared": bits((SHARED_ELEMS,), torch.float32, step),
        "step": step,
    }


def _load_target(rank: int, step: int, own_bytes: int) -> tuple[dict, dict]:
    from tierckpt.testing import placeholder

    want = state(rank, step, own_bytes)
    got = placeholder(want)
    got["step"] = -1
    return want, got


def save(args: dict, rank: int, world: int) -> dict:
    """``args['steps']`` saves with TieredWriter, each waited for until committed on every tier, each
    counted in its own phase (``args['phases'][i]``); then the writer's close (phase ``close``)."""
    import torch.distributed.checkpoint as dcp

    from tierckpt import TieredWriter
    from tierckpt.config import config_from_dict
    from tierckpt.testing.counting import install

    c = install()
    cfg = config_from_dict(args["config"])
    w = TieredWriter(cfg)
    for step, phase in zip(args["steps"], args["phases"]):
        with c.phase(phase):
            dcp.save(state(rank, step, args["own_bytes"]), checkpoint_id=f"step-{step}", storage_writer=w)
            with c.phase("wait"):
                w.wait()
    with c.phase("close"):
        w.close()
    return {"counts": c.dump()}


def load(args: dict, rank: int, world: int) -> dict:
    """``dcp.load`` of ``latest`` with TieredReader (phase ``args['phase']``; the wait for its fill of
    the local tier in the sub-phase ``drain``), compared bit for bit with ``args['step']``'s state."""
    import torch.distributed.checkpoint as dcp

    from tierckpt import TieredReader
    from tierckpt.config import config_from_dict
    from tierckpt.testing import compare
    from tierckpt.testing.counting import install

    c = install()
    cfg = config_from_dict(args["config"])
    want, got = _load_target(rank, args["step"], args["own_bytes"])
    with c.phase(args["phase"]):
        reader = TieredReader(cfg)
        dcp.load(got, checkpoint_id="latest", storage_reader=reader)
        with c.phase("drain"):
            if reader.fill is not None:  # the worker leaves with os._exit: wait for the local copy
                reader.fill.wait()
    return {
        "counts": c.dump(),
        "resolved": reader.resolved_id,
        "served": dict(reader.served),
        "from_peers": sum(reader.from_peers.values()),
        "mismatches": compare(want, got),
    }


def dcp_save(args: dict, rank: int, world: int) -> dict:
    """The same save with DCP's own ``FileSystemWriter`` into one shared directory (the baseline)."""
    import torch.distributed.checkpoint as dcp

    from tierckpt.testing.counting import install

    c = install()
    with c.phase(args["phase"]):
        dcp.save(
            state(rank, args["step"], args["own_bytes"]),
            storage_writer=dcp.FileSystemWriter(args["path"], sync_files=False),
        )
    return {"counts": c.dump()}


def dcp_load(args: dict, rank: int, world: int) -> dict:
    """The same load with DCP's own ``FileSystemReader`` from the shared directory (the baseline)."""
    import torch.distributed.checkpoint as dcp

    from tierckpt.testing import compare
    from tierckpt.testing.counting import install

    c = install()
    want, got = _load_target(rank, args["step"], args["own_bytes"])
    with c.phase(args["phase"]):
        dcp.load(got, storage_reader=dcp.FileSystemReader(args["path"]))
    return {"counts": c.dump(), "mismatches": compare(want, got)}


SCENARIOS: dict[str, Callable[[dict, int, int], dict[str, Any]]] = {
    f.__name__: f for f in (save, load, dcp_save, dcp_load)
}


if __name__ == "__main__":
    from tierckpt.testing.launch import serve

    serve(SCENARIOS, report_errors=True)
