"""Multi-rank scenarios for simulated nodes that read each other's files (``tierckpt.peers``).

Run by ``run_world(..., script=tests/peer_scenarios.py)`` in every rank after the gloo process
group is up; ``TIERCKPT_NODE`` names the rank's node and ``[local] path`` holds ``{node}``. The
state is a pure function of (rank, step), so any job can rebuild what any rank saved: its own
tensor ``rank<r>``, a ``shared`` tensor that every rank holds (DCP writes it in one rank's file),
and the ``step``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierckpt import TieredReader, TieredWriter  # noqa: E402
from tierckpt.config import config_from_dict  # noqa: E402
from tierckpt.testing import bits, compare, serve  # noqa: E402
from tierckpt.testing.errors import err_text, errors_in  # noqa: E402


def state(rank: int, step: int, world: int) -> dict:
    """What ``rank`` of a ``world``-rank job saved at ``step``."""
    return {
        f"rank{rank}": bits((3, 1000 + 7 * rank), torch.float32, seed=100 * step + rank),
        "shared": bits((64, 33), torch.float32, seed=step),
        "step": step,
    }


def full_state(step: int, world: int) -> dict:
    """Everything a ``world``-rank job saved at ``step`` (what a loader of any size can ask for)."""
    out: dict = {"shared": state(0, step, world)["shared"], "step": step}
    for r in range(world):
        out[f"rank{r}"] = state(r, step, world)[f"rank{r}"]
    return out


def save_steps(args: dict, rank: int, world: int) -> dict:
    cfg = config_from_dict(args["config"])
    w = TieredWriter(cfg)
    for step in args["steps"]:
        dcp.save(state(rank, step, world), checkpoint_id=f"step-{step}", storage_writer=w)
        w.wait()
    w.engine.close()
    return {"saved": args["steps"]}


def load_all(args: dict, rank: int, world: int) -> dict:
    """Load ``args["id"]`` (default ``latest``) with every key the saving job wrote; compare bit for bit."""
    cfg = config_from_dict(args["config"])
    saved_world, step = args["saved_world"], args["expect_step"]
    want = full_state(step, saved_world)
    got = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in want.items()}
    reader = TieredReader(cfg)
    resolved = None
    try:
        if args.get("resolve_first"):  # what a launcher does first; a collective with peers
            resolved = reader.resolve()
        dcp.load(got, checkpoint_id=args.get("id", "latest"), storage_reader=reader)
    except BaseException as e:  # noqa: BLE001 - the test inspects the message
        return {"error": "\n".join(err_text(x, 4000) for x in errors_in(e))}
    bad = compare(want, got)
    if reader.fill is not None:  # the worker leaves with os._exit: wait for the local copy's commit
        reader.fill.wait()
    return {
        "id": reader.resolved_id,
        "resolved": resolved,
        "bad": bad,
        "from_peers": reader.from_peers,
        "served": reader.served,
        "recovered": reader.recovered,
        "filled": reader.fill.committed if reader.fill is not None else [],
    }


def save_partner_dies(args: dict, rank: int, world: int) -> dict:
    """Save ``steps``; the last rank dies (SIGKILL-like ``os._exit``) in the middle of receiving the
    peer copy of the last step from its partner. The others report what ``wait()`` raised, then
    leave without the final barrier (their partner is gone)."""
    import json
    import os

    from tierckpt.chain.engine import Engine, register_engine
    from tierckpt.testing import FaultyTier
    from tierckpt.tiers import make_tiers

    cfg = config_from_dict(args["config"])
    last = args["steps"][-1]
    if rank == world - 1:
        tiers = make_tiers(cfg)
        first = FaultyTier(tiers[0])
        first.arm("write_at", lambda: os._exit(137), match=f"step-{last}/rank-00000")
        register_engine(Engine(cfg, tiers=[first, *tiers[1:]]))
    w = TieredWriter(cfg)
    errors = []
    for step in args["steps"]:
        dcp.save(state(rank, step, world), checkpoint_id=f"step-{step}", storage_writer=w)
        try:
            w.wait()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            errors.append(err_text(e, 2000))
    Path(sys.argv[3]).write_text(json.dumps({"errors": errors}))
    os._exit(0)


SCENARIOS = {"save_steps": save_steps, "load_all": load_all, "save_partner_dies": save_partner_dies}

if __name__ == "__main__":
    serve(SCENARIOS)
