"""Worker side of tests/test_torchtitan.py: torchtitan's checkpoint path on real gloo ranks.

torchtitan's llama3 ``debugmodel`` (its attention's inner kernel swapped for standard causal
attention: FlexAttention needs block masks and a compiler, not what is tested here), FSDP2 on a
CPU mesh of every rank, torchtitan's ``OptimizersContainer`` (AdamW), ``LRSchedulersContainer``
and ``ModelWrapper``, and the shipped :class:`TierckptCheckpointManager`, driven the way
torchtitan's trainer drives its checkpointer (``load`` first; per step ``maybe_wait_for_staging``
before the optimizer step, ``save(step)`` after it; ``close`` at the end).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from tierckpt.testing.launch import serve  # noqa: E402

VOCAB = 2048


class _Attention(torch.nn.Module):
    """Standard causal attention with the inner-attention call signature of torchtitan."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **_kw):  # noqa: ANN001
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def _model(world: int) -> torch.nn.Module:
    from torchtitan.models.llama3 import model_registry

    mc = model_registry("debugmodel").model
    torch.manual_seed(0)
    with torch.device("meta"):
        model = mc.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    for mod in model.modules():
        if hasattr(mod, "inner_attention"):
            mod.inner_attention = _Attention()
    mesh = init_device_mesh("cpu", (world,))
    for layer in list(model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(x):  # noqa: ANN001, ANN202
    if isinstance(x, DTensor):
        return x.full_tensor()
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _full(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_full(v) for v in x]
    return x


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process (``name/tid``), from /proc (Linux)."""
    import threading

    out: dict[str, float] = {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[f"{names.get(int(task.name), name)}/{task.name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def train(args: dict, rank: int, world: int) -> dict:
    """``args``: tiers (TOML path), dump, mode, steps, crash_after (step or 0), interval, keep,
    record (path: write the full model+optimizer state after each checkpoint step, rank 0),
    check (path of such a record: compare the loaded state with it, before training; with
    check_step, only the model, with that step's), manager ("torchtitan": torchtitan's own),
    initial_load_path, no_last (no last-step save), final (path: the full state at the end)."""
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from tierckpt.integrations.torchtitan import TierckptCheckpointManager
    from tierckpt.testing.bitexact import compare

    model = _model(world)
    opts = default_adamw(lr=8e-4).build(model_parts=[model])
    scheds = LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    ).build(optimizers=opts, training_steps=args["steps"])
    ts = TrainState()
    if args.get("manager") == "torchtitan":  # torchtitan's own manager (DCP's FileSystemWriter), for comparison
        from torchtitan.components.checkpointer.dcp import CheckpointManager

        cls = CheckpointManager
        conf = CheckpointManager.Config(
            enable=True,
            interval=args["interval"],
            folder="checkpoint",
            async_mode=args["mode"],
            keep_latest_k=0,
            last_save_model_only=False,
        )
    else:
        cls = TierckptCheckpointManager
        conf = TierckptCheckpointManager.Config(
            enable=bool(args["tiers"]),
            interval=args["interval"],
            folder="checkpoint",
            async_mode=args["mode"],
            keep_latest_k=args.get("keep", 0),
            last_save_model_only=False,
            tierckpt_config=args["tiers"] or "",
            initial_load_path=args.get("initial_load_path"),
        )
    ckpt = cls(
        conf,
        dataloader=None,
        model_parts=[model],
        optimizers=opts,
        lr_schedulers=scheds,
        states={"train_state": ts},
        sd_adapter=None,
        base_folder=args["dump"],
    )
    out: dict = {"losses": {}, "blocked": [], "staging_wait": [], "log": []}

    class _Keep(logging.Handler):  # tierckpt's warnings and errors, for the test to read
        def emit(self, record: logging.LogRecord) -> None:
            out["log"].append(f"{record.levelname} {record.getMessage()}")

    keep = _Keep(logging.WARNING)
    logging.getLogger("tierckpt").addHandler(keep)
    prof_to = os.environ.get("TIERCKPT_PROFILE_LOAD")  # a directory: cProfile of each rank's load
    prof = None
    if prof_to:
        import cProfile

        # TIERCKPT_PROFILE_CLOCK=thread: the main thread's CPU time (wall time otherwise)
        prof = (
            cProfile.Profile(time.thread_time)
            if os.environ.get("TIERCKPT_PROFILE_CLOCK") == "thread"
            else cProfile.Profile()
        )
        prof.enable()
    import threading

    out["threads_at_load"] = sorted(t.name for t in threading.enumerate())
    gc_s = [0.0, 0.0, 0.0]  # seconds in the garbage collector during the load, per generation
    gc_t: list[float] = []

    def _gc_cb(phase: str, info: dict) -> None:
        if phase == "start":
            gc_t.append(time.thread_time())
        elif gc_t:
            gc_s[info["generation"]] += time.thread_time() - gc_t.pop()

    import gc

    gc.callbacks.append(_gc_cb)
    threads0 = _thread_cpu()
    gc0 = [g["collections"] for g in gc.get_stats()]
    t_load, c_load = time.perf_counter(), time.process_time()
    ckpt.load(step=args.get("load_step", -1))
    out["load_s"] = time.perf_counter() - t_load
    out["load_cpu_s"] = time.process_time() - c_load
    gc.callbacks.remove(_gc_cb)
    out["load_gc_s"] = gc_s
    out["load_gc_collections"] = [g["collections"] - c for g, c in zip(gc.get_stats(), gc0)]
    threads1 = _thread_cpu()
    out["load_cpu_threads"] = {
        k: round(v - threads0.get(k, 0.0), 3) for k, v in threads1.items() if v - threads0.get(k, 0.0) > 0.005
    }
    out["gc_objects"] = len(gc.get_objects())
    if prof is not None:
        prof.disable()
        prof.dump_stats(str(Path(prof_to) / f"load-{args.get('manager') or 'tierckpt'}-{rank}.prof"))
    out["resumed_from"] = ts.step
    if args.get("check"):
        rec = torch.load(args["check"], weights_only=True)
        if args.get("check_step"):  # a model-only initial load: the model of that step
            out["check"] = compare(rec[str(args["check_step"])]["model"], _full(model.state_dict()))
        else:
            now = {"model": _full(model.state_dict()), "optim": _full(opts.state_dict())}
            out["check"] = compare(rec[str(ts.step)], now)
    records = {}
    for step in range(ts.step + 1, args["steps"] + 1):
        ts.step = step
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, VOCAB, (world * 2, 17), generator=g)[rank * 2 : (rank + 1) * 2]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        t0 = time.perf_counter()
        ckpt.maybe_wait_for_staging()
        out["staging_wait"].append(time.perf_counter() - t0)
        opts.step()
        scheds.step()
        opts.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        out["losses"][str(step)] = float(avg) / world
        t0 = time.perf_counter()
        saved = ckpt.save(step, last_step=step == args["steps"] and not args.get("no_last"))
        if saved:
            out["blocked"].append(time.perf_counter() - t0)
        if args.get("record") and step % args["interval"] == 0:
            records[str(step)] = {"model": _full(model.state_dict()), "optim": _full(opts.state_dict())}
        if step == args.get("crash_after"):
            if args.get("commit_before_crash"):  # the test needs this save committed: wait, then die
                import tierckpt

                report = tierckpt.drain(120)
                assert not report.timed_out, report
            if args.get("record") and rank == 0:
                torch.save(records, args["record"])
            dist.barrier()
            import json

            Path(sys.argv[3]).write_text(json.dumps(out))  # what serve() would write, then killed
            os._exit(0)  # killed: no close(), nothing waited for
    if args.get("record") and rank == 0:
        torch.save(records, args["record"])
    out["final"] = None
    if args.get("final") and rank == 0:
        torch.save({"model": _full(model.state_dict()), "optim": _full(opts.state_dict())}, args["final"])
    elif args.get("final"):
        _full(model.state_dict()), _full(opts.state_dict())  # the collectives of full_tensor()
    ckpt.close()
    ckpt.close()
    return out


if __name__ == "__main__":
    if os.environ.get("TIERCKPT_TEST_DUMP_AFTER"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["TIERCKPT_TEST_DUMP_AFTER"]), exit=True)
    serve({"train": train}, report_errors=True)
