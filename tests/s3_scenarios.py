"""Multi-rank S3 promotion scenarios, run in real processes joined by a gloo process group.

``run_world(world, scenario, args, workdir, node_of=...)`` starts ``python tests/s3_scenarios.py
SCENARIO ARGS_JSON RESULT_PATH`` once per rank (the same launch as ``tests/distrun.py``, with this
file as the worker), waits for all ranks and returns each rank's JSON result. ``node_of(rank)``
sets ``TIERCKPT_NODE`` per rank, so ``[local] path = ".../{node}"`` gives simulated nodes their
own local tier.

The state is rebuilt from seeds, so the test process can rebuild it (``expected_state``) and
compare what it loads itself. Scenarios return JSON-able facts; the assertions live in
``tests/test_s3_promotion.py``.
"""

from __future__ import annotations

import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tierckpt.testing import bits, compare, placeholder  # noqa: E402,F401 - re-exported to the tests
from tierckpt.testing.errors import err_text  # noqa: E402
from tierckpt.testing.launch import serve  # noqa: E402


def _err(e: BaseException) -> str:
    return err_text(e, 3000)


MiB = 1 << 20

# -- deterministic state (shared with the tests) ----------------------------------------------

SHARD_ROWS = 96  # rows of the Shard(0) DTensor per rank
SHARD_COLS = 8192  # float32: 96 x 8192 x 4 B = 3 MiB per rank
OWN_ELEMS = 3 * MiB // 4  # float32: 3 MiB of rank-own data -> each rank file is ~6 MiB (2 parts of 5 MiB)


def own_state(rank: int, seed: int) -> dict:
    s = seed * 1000 + rank * 10
    return {
        "big": bits((OWN_ELEMS + rank,), torch.float32, s),
        "bf16": bits((33, 5 + rank), torch.bfloat16, s + 1),
        "i64": bits((17,), torch.int64, s + 2),
        "meta": {"rank": rank, "seed": seed},
    }


def sharded_full(world: int, seed: int) -> torch.Tensor:
    return bits((SHARD_ROWS * world, SHARD_COLS), torch.float32, seed * 1000 + 999)


def expected_state(world: int, seed: int) -> dict:
    """The whole checkpoint as plain tensors (what a 1-process load must produce)."""
    out: dict[str, Any] = {f"r{r}": own_state(r, seed) for r in range(world)}
    out["w"] = sharded_full(world, seed)
    out["step"] = seed
    return out


# -- scenarios (run inside the worker processes) -------------------------------------------------


def save_promote_lose_node_load(args: dict, rank: int, world: int) -> dict:
    """Save ``args['ids']`` (rank-own keys + a Shard(0) DTensor), wait (committed on S3), then
    node ``args['lost_rank']`` loses its local tier; every rank loads ``latest`` and compares its
    own keys and its shard bit for bit, reporting which tier served each file."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tierckpt import TieredReader, TieredWriter
    from tierckpt.config import config_from_dict

    cfg = config_from_dict(args["config"])
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {"errors": [], "promote_s": [], "local_root": str(cfg.local.resolved_path())}
    w = TieredWriter(cfg)
    for seed, cid in enumerate(args["ids"], start=1):
        sd = {
            f"r{rank}": own_state(rank, seed),
            "w": distribute_tensor(sharded_full(world, seed), mesh, [Shard(0)], src_data_rank=None),
            "step": seed,
        }
        try:
            dcp.save(sd, checkpoint_id=cid, storage_writer=w)
            # Wait before the next save: rank 0 runs S3 retention (which aborts stale multipart
            # uploads) after its commit, and moto reports every upload as initiated in 2010, so a
            # peer's next upload that has no part yet would look stale there (not on real S3).
            w.wait()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out["errors"].append(f"save {cid}: {_err(e)}")
    out["promote_s"] = [h.promote_s for h in w.history]
    dist.barrier()
    if rank == args["lost_rank"]:  # the node is lost: its local tier is gone
        shutil.rmtree(cfg.local.resolved_path(), ignore_errors=True)
    dist.barrier()
    seed = len(args["ids"])
    expected_own = own_state(rank, seed)
    target = {
        f"r{rank}": placeholder(expected_own),
        "w": distribute_tensor(torch.zeros(SHARD_ROWS * world, SHARD_COLS), mesh, [Shard(0)], src_data_rank=None),
        "step": 0,
    }
    reader = TieredReader(cfg)
    try:
        dcp.load(target, checkpoint_id="latest", storage_reader=reader)
    except BaseException as e:  # noqa: BLE001
        out["errors"].append(f"load: {_err(e)}\n{traceback.format_exc()[-2000:]}")
        return out
    shard = distribute_tensor(sharded_full(world, seed), mesh, [Shard(0)], src_data_rank=None).to_local()
    out["mismatches"] = compare(
        {f"r{rank}": expected_own, "w": shard, "step": seed},
        {f"r{rank}": target[f"r{rank}"], "w": target["w"].to_local(), "step": target["step"]},
    )
    out["resolved"] = reader.resolved_id
    out["served"] = dict(reader.served)
    if reader.fill is not None:  # the worker leaves with os._exit: wait for the local copy's commit
        reader.fill.wait()
    out["filled"] = reader.fill.committed if reader.fill is not None else []
    return out


SCENARIOS: dict[str, Callable[[dict, int, int], dict]] = {f.__name__: f for f in [save_promote_lose_node_load]}


# -- launcher (test process) ----------------------------------------------------------------------


def run_world(
    world: int,
    scenario: str,
    args: dict[str, Any],
    workdir: Path,
    *,
    node_of: Callable[[int], str] | None = None,
    timeout: float = 120.0,
) -> list[dict]:
    """Run ``scenario`` of this module on ``world`` ranks (real processes, gloo); return each rank's result."""
    import distrun

    return distrun.run_world(
        world, scenario, args, workdir, node_of=node_of, timeout=timeout, script=Path(__file__).resolve()
    )


# -- worker entry ---------------------------------------------------------------------------------

if __name__ == "__main__":
    serve(SCENARIOS, report_errors=True)
