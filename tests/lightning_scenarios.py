"""Worker side of tests/test_lightning.py (and tools/bench_integrations.py): Lightning 2.6 on real
gloo ranks, CPU.

A tiny regression model (two linear layers, AdamW, a per-step StepLR), a fixed random data set
that Lightning shards with its ``DistributedSampler`` (shuffled per epoch), ``ModelCheckpoint``
every ``interval`` steps with ``save_top_k=2`` on ``step`` and ``save_last="link"``, and the
shipped plugin (``strategy="ddp"``: :class:`TierckptCheckpointIO`; ``"fsdp2"``:
:class:`TierckptModelParallelStrategy`). The process group is made by the launcher; Lightning
finds it.

Scenario ``fit`` (see its docstring) records losses, the state at each checkpoint step, the state
after loading, the final state, and can stop the job dead after a step (``os._exit``: nothing
waited for, no teardown).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import archive_tier  # noqa: E402,F401 - registers [archive], a second directory tier
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tierckpt.testing.launch import serve  # noqa: E402

SAMPLES, BATCH, WIDTH = 16, 4, 64  # two batches per rank and epoch (2 ranks): checkpoints every 2 steps end epochs


def _full(x):  # noqa: ANN001, ANN202
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return x.full_tensor()
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _full(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):  # as a dict, so that tierckpt.testing.compare walks it
        return {f"[{i}]": _full(v) for i, v in enumerate(x)}
    return x


COMPARED = ("state_dict", "optimizer_states", "lr_schedulers", "loops", "global_step", "epoch")
"""The keys of Lightning's checkpoint dict compared after loading (callbacks' states differ: the
reference run has no ModelCheckpoint)."""


def _resumed_view(loops: dict) -> dict:
    """The fit loop's state but the epoch counters ``ready``/``started``: after a resume from a
    checkpoint saved at an epoch's last batch, Lightning 2.6 counts that epoch as started once
    less than an uninterrupted run does (its own ``TorchCheckpointIO`` gives the same)."""
    out = json.loads(json.dumps(loops))
    for part in ("total", "current"):
        for k in ("ready", "started"):
            out.get("epoch_progress", {}).get(part, {}).pop(k, None)
    return out


def _stall_commits() -> None:
    """From now on no checkpoint commits in this process: the first tier's metadata write (the
    commit) blocks forever, as on a stalled disk. A kill after the next save then lands between
    its ``dcp.save`` returning and its commit."""
    import threading

    from tierckpt.tiers.local import LocalTier

    put = LocalTier.put

    def stalled(self, key: str, data: bytes, *, if_absent: bool = False) -> None:  # noqa: ANN001
        if if_absent and key.endswith("metadata.json"):
            threading.Event().wait()
        put(self, key, data, if_absent=if_absent)

    LocalTier.put = stalled  # type: ignore[method-assign]


def _hold_commits():  # noqa: ANN202
    """From now on the first checkpoint to commit in this process waits until the returned
    event is set (its metadata write, the commit, blocks until then); every later one stalls for
    good. The job's first save then commits only after its second save returned, and the second
    never commits."""
    import threading

    from tierckpt.tiers.local import LocalTier

    release = threading.Event()
    first = threading.Lock()
    put = LocalTier.put

    def held(self, key: str, data: bytes, *, if_absent: bool = False) -> None:  # noqa: ANN001
        if if_absent and key.endswith("metadata.json"):
            if not first.acquire(blocking=False):
                threading.Event().wait()
            release.wait()
        put(self, key, data, if_absent=if_absent)

    LocalTier.put = held  # type: ignore[method-assign]
    return release


def _await_pointer(dirpath: str, step: int, timeout: float = 120.0) -> None:
    """Wait until the pointer file of the checkpoint of ``step`` is in ``dirpath`` (a file, not
    ``ModelCheckpoint``'s ``last.ckpt`` link): that checkpoint committed (the first save of a
    process is pointed to once it commits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.isdir(dirpath) and any(
            e.name.endswith(f"step={step}.ckpt") and e.is_file(follow_symlinks=False) for e in os.scandir(dirpath)
        ):
            return
        time.sleep(0.02)
    raise TimeoutError(f"no pointer of step {step} in {dirpath} after {timeout} s")


def fit(args: dict, rank: int, world: int) -> dict:
    """``args``: strategy ("ddp" | "fsdp2"), io ("tierckpt" | "default": Lightning's own path),
    tiers (TOML), dirpath, steps, interval, crash_after (a step: stop dead after its save; without
    stall_at / hold_first_commit, once the first save (step ``interval``) committed: its pointer is
    there), stall_at (a step: the earlier saves are waited for, then from this step's save on
    commits stall; with crash_after: killed before the commit), hold_first_commit (with
    crash_after: the first save commits only at the kill, the second never; the kill comes once
    the first one's pointer is written),
    ckpt_path (e.g. "last"), reference_first (first run the uninterrupted job from scratch in
    this process, Lightning's own path, no checkpoints: the state after loading, the losses, the
    loop state and the final state are compared with it), width (model width), save_every_step
    (benchmark: ``trainer.save_checkpoint`` after each step, timed, instead of ``ModelCheckpoint``),
    final_model (path: rank 0 writes the final full model state), validate (only
    ``trainer.validate(ckpt_path=...)``; expect: a model state the loaded one must equal),
    save_last (``ModelCheckpoint``'s, default "link"), run (``TierckptCheckpointIO``'s run key),
    then_resume (benchmark, with save_every_step: then a new trainer in this process resumes
    from the last save; load_s: the seconds its strategy's ``load_checkpoint`` took).
    Returns losses, resumed_from (the global step loaded), and with reference_first: loaded (keys
    of the checkpoint dict Lightning loaded that differ from the one it dumped at that step in the
    reference run), check (keys of the live state after loading that differ from the reference's),
    final (keys of the final state that differ), loops (keys of the final loop state that differ,
    see :func:`_resumed_view`), reference_losses."""
    ref: dict = {}
    if args.get("reference_first"):
        ref = _fit(
            args | {"io": "default", "reference": True, "ckpt_path": None, "dirpath": args["dirpath"] + "-reference"},
            rank,
            world,
            {},
        )
    return _fit(args, rank, world, ref)


def _fit(args: dict, rank: int, world: int, ref: dict) -> dict:
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from tierckpt.testing.bitexact import compare

    width = args.get("width", WIDTH)
    fsdp = args.get("strategy", "ddp") == "fsdp2"

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, width),
                torch.nn.Tanh(),
                torch.nn.Linear(width, width),
                torch.nn.Tanh(),
                torch.nn.Linear(width, 1),
            )
            self.losses: dict[str, float] = {}

        def configure_model(self) -> None:
            if fsdp:
                from torch.distributed.fsdp import fully_shard

                for layer in self.net:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=self.device_mesh["data_parallel"])
                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, idx):  # noqa: ANN001, ANN201
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.losses[str(self.global_step + 1)] = float(loss.detach())
            return loss

        def validation_step(self, batch, idx):  # noqa: ANN001, ANN201
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # noqa: ANN201
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def state(trainer) -> dict:  # noqa: ANN001
        model = trainer.lightning_module
        if not trainer.optimizers:  # validating
            return {"model": _full(model.state_dict())}
        opt = trainer.optimizers[0]
        if fsdp:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            osd = get_optimizer_state_dict(model, opt)
        else:
            osd = opt.state_dict()
        return {
            "model": _full(model.state_dict()),
            "optim": _full(osd),
            "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": trainer.global_step,
        }

    out: dict = {"losses": {}, "blocked": [], "resumed_from": 0}
    hold = _hold_commits() if args.get("hold_first_commit") and not args.get("reference") else None
    records: dict = {}
    reference = bool(args.get("reference"))

    class Probe(Callback):
        def on_validation_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            if args.get("expect"):  # trainer.validate(ckpt_path=...): the model loaded is the one expected
                out["check"] = compare(torch.load(args["expect"], weights_only=True), state(trainer)["model"])

        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            out["resumed_from"] = trainer.global_step
            if ref and trainer.global_step:
                out["check"] = compare(ref["records"][trainer.global_step]["state"], state(trainer))

        def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # noqa: ANN001
            if ref:  # what Lightning loaded is what it dumped at that step, bit for bit
                dump = ref["records"][checkpoint["global_step"]]["dump"]
                out["loaded"] = compare(
                    {k: v for k, v in dump.items() if k in checkpoint},
                    _full({k: checkpoint[k] for k in COMPARED if k in checkpoint}),
                )
                out["loaded_keys"] = sorted(k for k in COMPARED if k in checkpoint)

        def on_train_batch_start(self, trainer, pl_module, batch, idx) -> None:  # noqa: ANN001
            if not reference and args.get("crash_after") and trainer.global_step == args["crash_after"]:
                out["losses"] = pl_module.losses
                if hold is not None:
                    hold.set()
                if not args.get("stall_at"):  # commits are asynchronous: on a loaded host the kill could
                    # otherwise come before any, and the restart would rightly start from scratch
                    _await_pointer(args["dirpath"], args["interval"])
                dist.barrier()
                Path(sys.argv[3]).write_text(json.dumps(out))
                os._exit(0)  # killed: no teardown, nothing waited for

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx) -> None:  # noqa: ANN001
            if args.get("stall_at") == trainer.global_step and not reference:  # before ModelCheckpoint saves
                paths = getattr(trainer.strategy.checkpoint_io, "_paths", None)
                if paths is not None:  # the earlier saves commit first: a deterministic outcome
                    paths.writer.wait()
                _stall_commits()
            if reference and trainer.global_step % args["interval"] == 0:
                dump = trainer._checkpoint_connector.dump_checkpoint()
                records[trainer.global_step] = {
                    "state": state(trainer),
                    "dump": _full({k: dump[k] for k in COMPARED if k in dump}),
                }
            if args.get("save_every_step"):
                t0 = time.perf_counter()
                trainer.save_checkpoint(os.path.join(args["dirpath"], f"bench-{trainer.global_step}.ckpt"))
                out["blocked"].append(time.perf_counter() - t0)

    torch.manual_seed(1234)
    x = torch.randn(SAMPLES, 16)
    y = x[:, :1] * 0.5 - x[:, 1:2] ** 2 + 0.1 * torch.randn(SAMPLES, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)

    plugins = []
    if fsdp:
        from lightning.pytorch.strategies import ModelParallelStrategy

        from tierckpt.integrations.lightning import TierckptModelParallelStrategy

        shape = {"data_parallel_size": world, "tensor_parallel_size": 1}
        strategy = (
            ModelParallelStrategy(**shape)
            if args.get("io") == "default"
            else TierckptModelParallelStrategy(args["tiers"], **shape)
        )
    else:
        from tierckpt.integrations.lightning import TierckptCheckpointIO

        strategy = "ddp" if world > 1 else "auto"
        if args.get("io") != "default":
            plugins.append(TierckptCheckpointIO(args["tiers"], **({"run": args["run"]} if args.get("run") else {})))
    callbacks = [Probe()]
    if not args.get("save_every_step") and not reference:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args["dirpath"],
                every_n_train_steps=args["interval"],
                save_top_k=2,
                monitor="step",
                mode="max",
                save_last=args.get("save_last", "link"),
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        plugins=plugins,
        max_steps=args["steps"],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1 if args.get("validate") else 0,
        deterministic=True,
        enable_checkpointing=not (args.get("save_every_step") or reference),
        default_root_dir=args["dirpath"],
    )
    model = Net()
    if args.get("time_load"):  # the benchmark: seconds in the strategy's load_checkpoint (every restore goes there)
        load = trainer.strategy.load_checkpoint

        def timed_load(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            got = load(*a, **k)
            out["load_s"] = time.perf_counter() - t0
            return got

        trainer.strategy.load_checkpoint = timed_load  # type: ignore[method-assign]
    if args.get("validate"):  # load only (e.g. on fewer ranks than saved it)
        trainer.validate(model, loader, ckpt_path=args.get("ckpt_path"))
        return out
    t0 = time.perf_counter()
    trainer.fit(model, loader, ckpt_path=args.get("ckpt_path"))
    out["fit_s"] = time.perf_counter() - t0
    out["losses"] = model.losses
    out["global_step"] = trainer.global_step
    loops = json.loads(json.dumps(trainer.fit_loop.state_dict(), default=str))
    final = state(trainer)
    if reference:
        return {"records": records, "final": final, "losses": model.losses, "loops": loops, "load_s": out.get("load_s")}
    if args.get("save_every_step") and args.get("then_resume"):  # the benchmark: a new trainer loads the last save
        last = os.path.join(args["dirpath"], f"bench-{trainer.global_step}.ckpt")
        again = _fit(
            args
            | {"save_every_step": False, "then_resume": False, "time_load": True, "ckpt_path": last, "reference": True},
            rank,
            world,
            {},
        )
        out["load_s"] = again["load_s"]
    if args.get("final_model") and rank == 0:
        torch.save(final["model"], args["final_model"])
    if ref:
        out["final"] = compare(ref["final"], final)
        out["loops"] = compare(_resumed_view(ref["loops"]), _resumed_view(loops))
        out["reference_losses"] = ref["losses"]
    return out


def fits(args: dict, rank: int, world: int) -> dict:
    """``args["runs"]``: arguments of :func:`fit` (no ``crash_after``, no ``reference_first``), one
    run after the other in this process (one Lightning import for several runs). Returns
    ``{"runs": [each run's result]}``; a run that raises ends the sequence, its error in ``error``."""
    out: list[dict] = []
    for a in args["runs"]:
        try:
            out.append(_fit(a, rank, world, {}))
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.append({"error": f"{type(e).__name__}: {e}"})
            break
    return {"runs": out}


if __name__ == "__main__":
    if os.environ.get("TIERCKPT_TEST_DUMP_AFTER"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["TIERCKPT_TEST_DUMP_AFTER"]), exit=True)
    serve({"fit": fit, "fits": fits}, report_errors=True)
