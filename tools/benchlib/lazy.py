"""Section ``lazy``: time the training thread is blocked per checkpoint (MLP + Adam)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from benchlib.common import Ctx, GiB, MiB, cpu_seconds, log, med, now, rm, row, size_label, tensor_bytes, tiered_cfg
from tierckpt import TieredWriter

# ---------------------------------------------------------------------------------------------
# B. lazy: blocked time per checkpoint in a training loop
# ---------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, layers: int) -> None:
        super().__init__()
        mods: list[nn.Module] = [nn.Linear(d_in, hidden), nn.GELU()]
        for _ in range(layers):
            mods += [nn.Linear(hidden, hidden), nn.GELU()]
        mods += [nn.Linear(hidden, d_in)]
        self.net = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def train_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


class StepHookTimer:
    """Times the writer's optimizer pre-step hook from outside: hooks run in registration order."""

    def __init__(self, opt: torch.optim.Optimizer, writer: TieredWriter) -> None:
        self.t_a = 0.0
        self.waits: list[float] = []
        self.h1 = opt.register_step_pre_hook(self._a)
        self.h2 = writer.attach(opt)
        self.h3 = opt.register_step_pre_hook(self._b)

    def _a(self, *_: Any) -> None:
        self.t_a = now()

    def _b(self, *_: Any) -> None:
        self.waits.append(now() - self.t_a)

    def remove(self) -> None:
        for h in (self.h1, self.h2, self.h3):
            h.remove()


class NullWriter(dcp.StorageWriter):
    """A StorageWriter that stores nothing: ``dcp.save`` with it is DCP's own planning floor."""

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        return plans

    def write_data(self, plan: Any, planner: Any) -> Any:
        from torch.distributed.checkpoint.storage import WriteResult

        for it in plan.items:  # every writer must resolve its items (BYTE_IO items are pickled here)
            planner.resolve_data(it)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([WriteResult(index=it.index, size_in_bytes=0, storage_data=None) for it in plan.items])
        return fut

    def finish(self, metadata: Any, results: Any) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def _fb(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    t0 = now()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return now() - t0


def section_lazy(ctx: Ctx) -> dict:
    """One run of :func:`_lazy_one` per state size of ``--lazy-mib`` (default 320 MiB, 64 with
    ``--quick``). With one size the result is that run's; with several, the first size's keys plus
    ``series``: per size, the state bytes and the median blocked time per checkpoint of each mode
    (what ``tools/plot_bench.py`` draws as stall against state size), and the rows of every size."""
    sizes = [int(float(m) * MiB) for m in str(getattr(ctx.args, "lazy_mib", "") or "").split(",") if m.strip()]
    if not sizes:
        sizes = [(64 if ctx.quick else 320) * MiB]
    runs = [_lazy_one(ctx, target) for target in sizes]
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    out["rows"] = [
        dict(r, name=f"[{run['state_bytes'] / MiB:.0f} MiB] {r['name']}") for run in runs for r in run["rows"]
    ]
    out["series"] = [
        {
            "state_bytes": run["state_bytes"],
            "batch": run["batch"],
            "null_writer_s": med(run["null_writer_s"]),
            "blocked_s": {
                m: med(run["modes"][m]["blocked_s"]) for m in ("sync FileSystemWriter", "async_save", "tiered")
            },
            "blocked_all_s": {
                m: run["modes"][m]["blocked_s"] for m in ("sync FileSystemWriter", "async_save", "tiered")
            },
        }
        for run in runs
    ]
    out["notes"] = [n for run in runs for n in run["notes"]]
    return out


def _lazy_one(ctx: Ctx, state_target: int) -> dict:
    root = ctx.work / f"lazy-{state_target // MiB}"
    root.mkdir()
    torch.manual_seed(0)
    hidden, d_in = 2048, 1024
    layers = max(1, round((state_target / 12 - 2 * d_in * hidden) / (hidden * hidden)))
    model = MLP(d_in, hidden, layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    nparams = sum(p.numel() for p in model.parameters())
    steps = 3 if ctx.quick else 6

    batch = 64

    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, d_in), torch.randn(b, d_in)

    # warm up: Adam state exists after the first step
    x, y = data(batch)
    for _ in range(2):
        _fb(model, x, y)
        opt.step()
        opt.zero_grad(set_to_none=False)
    state_bytes = tensor_bytes(train_state(model, opt))
    log(f"lazy: MLP {nparams / 1e6:.1f}M params, {layers} hidden layers, state {state_bytes / MiB:.0f} MiB")

    # calibrate: TieredWriter capture and durable time for this state; fwd+bwd >= both
    pool = 1 * GiB if state_bytes <= 1 * GiB else 2 * GiB
    cfg = tiered_cfg(root / "tiered", pool, 64 * MiB, keep=2)
    cal = []
    for i in range(2):
        w = TieredWriter(cfg)
        dcp.save(train_state(model, opt), checkpoint_id=f"cal-{i}", storage_writer=w)
        w.wait()
        cal.append(w.stats)
    capture_s, durable_s = cal[-1].capture_s, cal[-1].flush_s
    need = 1.15 * max(capture_s, durable_s)
    fb_t = med([_fb(model, x, y) for _ in range(2)])
    opt.zero_grad(set_to_none=False)
    while fb_t < need and batch < 65536:
        batch = int(batch * min(8.0, max(1.25, need / fb_t * 1.05)))
        x, y = data(batch)
        fb_t = med([_fb(model, x, y) for _ in range(2)])
        opt.zero_grad(set_to_none=False)
    log(f"lazy: capture {capture_s:.3f} s, durable {durable_s:.3f} s -> batch {batch}, fwd+bwd {fb_t:.3f} s")

    null_t = []
    for i in range(5):
        t0 = now()
        dcp.save(train_state(model, opt), checkpoint_id=f"null-{i}", storage_writer=NullWriter())
        null_t.append(now() - t0)
    modes: dict[str, dict] = {}

    def run_mode(mode: str) -> dict:
        log(f"lazy: mode {mode}")
        mdir = root / mode.replace(" ", "_")
        mdir.mkdir(exist_ok=True)
        rec: dict[str, list[float]] = {
            "fb": [],
            "opt_step": [],
            "save_call": [],
            "pre_save_wait": [],
            "staging_wait": [],
        }
        writer = None
        hook = None
        pending: Any = None
        if mode == "tiered":
            writer = TieredWriter(cfg)
            hook = StepHookTimer(opt, writer)
        hist0 = len(writer.history) if writer else 0
        dirs: list[Path] = []

        def checkpoint(i: int, timed: bool) -> None:
            nonlocal pending
            sd = train_state(model, opt)
            if mode == "sync FileSystemWriter":
                d = mdir / f"step-{i}"
                t0 = now()
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(d))
                t = now() - t0
                dirs.append(d)
                if timed:
                    rec["save_call"].append(t)
            elif mode == "async_save":
                tw = now()
                if pending is not None:
                    pending.result()
                wait = now() - tw
                d = mdir / f"step-{i}"
                t0 = now()
                resp = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(d))
                t = now() - t0
                sw = 0.0
                if hasattr(resp, "staging_completion"):  # AsyncSaveResponse (non-blocking stager)
                    ts = now()
                    resp.staging_completion.result()
                    sw = now() - ts
                    resp = resp.upload_completion
                pending = resp
                dirs.append(d)
                if timed:
                    rec["save_call"].append(t)
                    rec["pre_save_wait"].append(wait)
                    rec["staging_wait"].append(sw)
            elif mode == "tiered":
                t0 = now()
                dcp.save(sd, checkpoint_id=f"lazy-{i:04d}", storage_writer=writer)
                t = now() - t0
                if timed:
                    rec["save_call"].append(t)
            while len(dirs) > 2:  # keep the newest two DCP checkpoints (like keep=2)
                rm(dirs.pop(0))

        def step(i: int, timed: bool) -> None:
            fbt = _fb(model, x, y)
            t0 = now()
            opt.step()
            st = now() - t0
            opt.zero_grad(set_to_none=False)
            if timed:
                rec["fb"].append(fbt)
                rec["opt_step"].append(st)
            if mode != "none":
                checkpoint(i, timed)

        # one untimed warm-up iteration, then drain
        step(0, False)
        if writer is not None:
            writer.wait()
            hook.waits.clear()
            hist0 = len(writer.history)
        if pending is not None:
            pending.result()
            pending = None
        c0 = cpu_seconds()
        for i in range(1, steps + 1):
            step(i, True)
        drain_t0 = now()
        last_capture_wait = 0.0
        if writer is not None:
            last_capture_wait = writer.wait_captured()
            writer.wait()
        if pending is not None:
            pending.result()
        drain = now() - drain_t0
        out: dict[str, Any] = {
            "steps": steps,
            "fb_s": rec["fb"],
            "opt_step_s": rec["opt_step"],
            "save_call_s": rec["save_call"],
            "drain_s": drain,
            "cpu_s": cpu_seconds() - c0,
        }
        if mode == "sync FileSystemWriter":
            out["blocked_s"] = list(rec["save_call"])
        elif mode == "async_save":
            # checkpoint i blocks: the async_save call (+ staging wait) and, before checkpoint i+1,
            # the wait for its future; the last one's wait is the drain
            waits = rec["pre_save_wait"][1:] + [drain]
            out["blocked_s"] = [c + s + w for c, s, w in zip(rec["save_call"], rec["staging_wait"], waits)]
            out["pre_save_wait_s"] = rec["pre_save_wait"]
            out["staging_wait_s"] = rec["staging_wait"]
        elif mode == "tiered":
            hw = hook.waits[1:] + [last_capture_wait]  # hook at step i+1 waits for capture i
            out["blocked_s"] = [c + w for c, w in zip(rec["save_call"], hw)]
            out["hook_wait_s"] = hook.waits
            hist = writer.history[hist0:]
            out["lib_save_blocked_s"] = [h.save_blocked_s for h in hist]
            out["lib_prestep_wait_s"] = [h.prestep_wait_s for h in hist]
            out["lib_capture_s"] = [h.capture_s for h in hist]
            out["lib_durable_s"] = [h.flush_s for h in hist]
            hook.remove()
        for d in dirs:
            rm(d)
        return out

    for mode in ("none", "sync FileSystemWriter", "async_save", "tiered"):
        modes[mode] = run_mode(mode)

    rows = []
    fb_none = med(modes["none"]["fb_s"])
    rows.append(row("fwd+bwd (no checkpoint)", modes["none"]["fb_s"], note=f"batch {batch}"))
    rows.append(
        row(
            "TieredWriter capture (calibration)",
            [capture_s],
            state_bytes,
            note=f"durable after {durable_s:.3f} s; pool {size_label(pool)}/64MiB",
        )
    )
    for mode in ("sync FileSystemWriter", "async_save", "tiered"):
        m = modes[mode]
        rows.append(
            row(
                f"fwd+bwd during {mode}",
                m["fb_s"],
                ratio=med(m["fb_s"]) / fb_none,
                note=f"ratio: vs no checkpoint; opt.step {med(m['opt_step_s']) * 1e3:.0f} ms (none: "
                f"{med(modes['none']['opt_step_s']) * 1e3:.0f} ms); checkpoint CPU "
                f"{(m['cpu_s'] - modes['none']['cpu_s']) / steps:.2f} s/step",
            )
        )
    rows.append(
        row(
            "dcp.save floor (no-op StorageWriter)",
            null_t,
            note="DCP's own planning/collectives for this state, nothing stored",
        )
    )
    b_sync = med(modes["sync FileSystemWriter"]["blocked_s"])
    b_async = med(modes["async_save"]["blocked_s"])
    b_tier = med(modes["tiered"]["blocked_s"])
    for mode in ("sync FileSystemWriter", "async_save", "tiered"):
        m = modes[mode]
        note = ""
        if mode == "async_save":
            note = (
                f"call {med(m['save_call_s']) * 1e3:.1f} ms + staging wait {med(m['staging_wait_s']) * 1e3:.1f} ms"
                f" + wait prev future {med(m['pre_save_wait_s'][1:] or [0.0]) * 1e3:.1f} ms"
            )
        if mode == "tiered":
            note = (
                f"dcp.save {med(m['save_call_s']) * 1e3:.1f} ms + pre-step hook {med(m['hook_wait_s']) * 1e3:.1f} ms; "
                f"lib: save_blocked {med(m['lib_save_blocked_s']) * 1e3:.1f} ms, prestep_wait "
                f"{med(m['lib_prestep_wait_s']) * 1e3:.1f} ms"
            )
        rows.append(
            row(
                f"blocked/ckpt: {mode}",
                m["blocked_s"],
                ratio=med(m["blocked_s"]) / b_sync,
                note=("ratio: vs sync; " + note).strip("; "),
            )
        )
    ratios = {"tiered_blocked/sync_blocked": b_tier / b_sync, "tiered_blocked/async_blocked": b_tier / b_async}
    targets = {"tiered_blocked/sync_blocked": ("<=", 1 / 48), "tiered_blocked/async_blocked": ("<=", 0.1)}
    notes = [
        f"MLP {nparams / 1e6:.1f}M params + Adam: {state_bytes / MiB:.0f} MiB state; {steps} timed steps per mode "
        f"after 1 untimed; checkpoint after every optimizer step; batch {batch} so that fwd+bwd "
        f"({fb_t:.2f} s) >= 1.15 x max(capture {capture_s:.2f} s, durable {durable_s:.2f} s)"
    ]
    rm(root)
    del model, opt
    gc.collect()
    return {
        "rows": rows,
        "ratios": ratios,
        "targets": targets,
        "notes": notes,
        "modes": modes,
        "null_writer_s": null_t,
        "state_bytes": state_bytes,
        "params": nparams,
        "batch": batch,
        "calibration": {"capture_s": capture_s, "durable_s": durable_s, "fb_s": fb_t},
    }
