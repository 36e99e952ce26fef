"""Worker side of tests/test_accelerate.py (and tools/bench_integrations.py): Accelerate 1.15 with
FSDP2 on real gloo ranks, CPU.

Accelerate turns FSDP on only for accelerator devices (``AcceleratorState`` keeps ``MULTI_CPU``
on a CPU run and drops the plugin); here the state is switched to its FSDP path after
``Accelerator()``, so that ``prepare`` shards the model with ``fully_shard`` on a CPU mesh and
``save_state``/``load_state`` take their FSDP branches, as on GPUs.

A small MLP with input noise from NumPy's and Python's RNGs (the RNG state matters), AdamW, StepLR, a shuffled stateful data loader
(``use_stateful_dataloader=True``: its position is saved), a step counter registered with
``register_for_checkpointing``, and ``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=2)``; ``save_state()`` every ``interval`` steps. ``io="default"`` keeps Accelerate's
own ``save_state`` (DCP's ``FileSystemWriter``, two saves), for comparisons.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tierckpt.testing.launch import serve  # noqa: E402

SAMPLES, BATCH, WIDTH = 64, 4, 64  # eight batches per process and epoch


class Counter:
    """The training step, saved through ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def _full(x):  # noqa: ANN001, ANN202
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return x.full_tensor()
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _full(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return {f"[{i}]": _full(v) for i, v in enumerate(x)}
    return x


def train(args: dict, rank: int, world: int) -> dict:
    """``args``: io ("tierckpt" | "default"), tiers, dump (project dir), steps, interval,
    crash_after (stop dead after that step), resume (``load_state()`` first), reference_first
    (first the uninterrupted run in this process: the state after loading, the losses and the
    final state are compared with it), width, save_every_step (benchmark: time every save),
    then_resume (benchmark: then a new Accelerator in this process loads the last save, timed).
    Returns losses, resumed_from, ids (checkpoint id of each save and how many tierckpt saves it
    made), check/final (keys that differ from the reference), blocked, load_s."""
    ref = _train(args | {"reference": True, "resume": False}, rank, world, {}) if args.get("reference_first") else {}
    return _train(args, rank, world, ref)


def _train(args: dict, rank: int, world: int, ref: dict) -> dict:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import (
        DataLoaderConfiguration,
        DistributedType,
        FullyShardedDataParallelPlugin,
        ProjectConfiguration,
    )

    from tierckpt.testing.bitexact import compare

    width = args.get("width", WIDTH)
    reference = bool(args.get("reference"))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    acc = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=args["dump"], automatic_checkpoint_naming=True, total_limit=2),
    )
    # see the module docstring; PartialState's copy too (AcceleratorState re-reads it when re-made)
    acc.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 1),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES * world, 16, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] ** 2
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    random.seed(7 + rank)
    np.random.seed(7 + rank)
    torch.manual_seed(7 + rank)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    ckpt = None
    if args.get("io", "tierckpt") == "tierckpt" and not reference:
        from tierckpt.integrations.accelerate import enable

        ckpt = enable(acc, args["tiers"])

    def state() -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return {
            "model": _full(get_model_state_dict(model)),
            "optim": _full(get_optimizer_state_dict(model, opt)),
            "sched": sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "py_rng": str(random.getstate()),
            "np_rng": str(np.random.get_state()),
            "step": counter.step,
        }

    out: dict = {"losses": {}, "ids": [], "blocked": [], "resumed_from": 0}
    if args.get("resume"):
        t0 = time.perf_counter()
        acc.load_state(args.get("load_dir"))
        out["load_s"] = time.perf_counter() - t0
        out["resumed_from"] = counter.step
        if ref:
            out["check"] = compare(ref["records"][counter.step], state())
    records = {}
    it = iter(loader)
    for step in range(counter.step + 1, args["steps"] + 1):
        try:
            xb, yb = next(it)
        except StopIteration:
            it = iter(loader)
            xb, yb = next(it)
        # noise from NumPy and Python's RNGs, different per process: their states must travel. (Torch's
        # global RNG travels too, but a resumed job draws from it once more than an uninterrupted one:
        # making a data loader iterator does, for its seed; so it is compared right after loading only.)
        noise = torch.from_numpy(np.random.standard_normal(tuple(xb.shape))).float() * random.uniform(0.05, 0.15)
        loss = F.mse_loss(model(xb + noise), yb)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        out["losses"][str(step)] = float(loss.detach())
        out.setdefault("data", {})[str(step)] = float(xb.double().sum())
        counter.step = step
        if step % args["interval"] == 0 or args.get("save_every_step"):
            if reference:
                records[step] = state()
            elif ckpt is not None or args.get("io") == "default":
                n0 = len(ckpt.writer.history) if ckpt is not None else 0
                t0 = time.perf_counter()
                where = acc.save_state()
                out["blocked"].append(time.perf_counter() - t0)
                saves = len(ckpt.writer.history) - n0 if ckpt is not None else 0
                out["ids"].append([os.path.basename(where), saves])
        if step == args.get("crash_after") and not reference:
            dist.barrier()
            Path(sys.argv[3]).write_text(json.dumps(out))
            os._exit(0)  # killed: nothing waited for
    if args.get("save_every_step") and args.get("then_resume"):  # the benchmark: a new Accelerator loads the last save
        if ckpt is not None:
            ckpt.close()
        again = _train(args | {"save_every_step": False, "then_resume": False, "resume": True}, rank, world, {})
        out["load_s"] = again["load_s"]
        return out
    final = state()
    if reference:
        return {"records": records, "final": final, "losses": out["losses"], "data": out.get("data")}
    if ref:
        out["final"] = compare({k: v for k, v in ref["final"].items() if k != "torch_rng"}, final)
        out["reference_losses"] = {k: v for k, v in ref.get("losses", {}).items()}
        out["reference_data"] = ref["data"]
    if ckpt is not None:
        ckpt.close()
    return out


if __name__ == "__main__":
    serve({"train": train}, report_errors=True)
