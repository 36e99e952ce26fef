"""Multi-rank scenarios for tests/test_lazy_capture.py, run in real processes joined by gloo.

``run_lazy_world(world, scenario, args, workdir)`` starts ``python tests/lazy_scenarios.py
SCENARIO ARGS_JSON RESULT_PATH`` once per rank (the same protocol as tests/dist_worker.py, but
this module is its own worker so that it needs no registration), waits for all ranks and returns
each rank's JSON result.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


from tierckpt import TieredReader, TieredWriter  # noqa: E402
from tierckpt.config import config_from_dict  # noqa: E402
from tierckpt.format.layout import metadata_key  # noqa: E402

# -- scenarios (run on every rank after the gloo process group is up) ------------------------


def lazy_training_loop(args: dict, rank: int, world: int) -> dict:
    """DDP training with ``writer.attach(opt)`` and a lazy save every step.

    Replicated DDP parameters and Adam state (deduplicated by DCP: one rank writes each) plus a
    per-rank multi-chunk buffer that is mutated in place right after every optimizer step.
    Every checkpoint is then loaded back and compared, bit for bit, with the copies taken at
    the time of its save.
    """
    cfg = config_from_dict(args["config"])
    steps = int(args.get("steps", 3))
    torch.manual_seed(1234)  # same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 32))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    writer = TieredWriter(cfg)
    writer.attach(opt)
    g = torch.Generator().manual_seed(100 + rank)
    local_buf = torch.randn(3 * 256 * 1024 + 17, generator=g)  # ~3 MiB: spans several chunks

    def loss_step() -> None:
        x = torch.randn(16, 64, generator=g)
        ddp(x).pow(2).mean().backward()

    loss_step()
    opt.step()  # materialize Adam's state before the first save
    opt.zero_grad()

    def state() -> dict:
        ost = {}
        for i, p in enumerate(model.parameters()):
            s = opt.state[p]
            ost[f"{i}.exp_avg"] = s["exp_avg"]
            ost[f"{i}.exp_avg_sq"] = s["exp_avg_sq"]
            ost[f"{i}.step"] = s["step"]
        return {"model": ddp.state_dict(), "adam": ost, f"rank{rank}": {"buf": local_buf}}

    ids, expected = [], []
    for step in range(steps):
        loss_step()
        sd = state()
        cid = f"step-{step}"
        dcp.save(sd, checkpoint_id=cid, storage_writer=writer)
        expected.append(_clone(sd))
        ids.append(cid)
        opt.step()  # the pre-step hook waits for the capture of the save above
        opt.zero_grad()
        local_buf.add_(1.0)  # safe: the hook already waited for the capture
    writer.wait()

    same = {}
    for cid, exp in zip(ids, expected):
        out = _zeros(exp)
        dcp.load(out, checkpoint_id=cid, storage_reader=TieredReader(cfg))
        same[cid] = _equal(exp, out)
    return {
        "ids": ids,
        "same": same,
        "history": len(writer.history),
        "committed": [(Path(writer.engine.first_tier.root) / metadata_key(c)).is_file() for c in ids],
    }


def _clone(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: _clone(v) for k, v in sd.items()}
    return sd.detach().clone() if isinstance(sd, torch.Tensor) else sd


def _zeros(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: _zeros(v) for k, v in sd.items()}
    return torch.zeros_like(sd) if isinstance(sd, torch.Tensor) else sd


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
        )
    return a == b


SCENARIOS = {f.__name__: f for f in [lazy_training_loop]}


# -- launcher (test side) ------------------------------------------------------------------------


def run_lazy_world(
    world: int, scenario: str, args: dict[str, Any], workdir: Path, *, timeout: float = 120.0
) -> list[dict]:
    """Run ``scenario`` of this module on ``world`` ranks; return their results (raise on any failure)."""
    from distrun import run_world

    return run_world(world, scenario, args, workdir, timeout=timeout, script=Path(__file__).resolve())


if __name__ == "__main__":
    from tierckpt.testing.launch import serve

    serve(SCENARIOS)
