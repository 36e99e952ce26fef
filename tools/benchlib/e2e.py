"""Section ``e2e``: wall time of a small GPT trained with a checkpoint every iteration."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from benchlib.common import Ctx, GiB, MiB, cpu_seconds, log, med, now, rm, row, size_label, tensor_bytes, tiered_cfg
from benchlib.lazy import train_state
from benchlib.timeline import write_timeline
from tierckpt import TieredWriter

# ---------------------------------------------------------------------------------------------
# C. end to end: a small GPT trained with a checkpoint every iteration
# ---------------------------------------------------------------------------------------------


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ff: int, ctx_len: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx_len, d))
        self.blocks = nn.ModuleList(
            [
                nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
                for _ in range(layers)
            ]
        )
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        h = self.emb(x) + self.pos[:T]
        mask = nn.Transformer.generate_square_subsequent_mask(T)
        for b in self.blocks:
            h = b(h, src_mask=mask, is_causal=True)
        return self.head(self.ln(h))


def section_e2e(ctx: Ctx) -> dict:
    root = ctx.work / "e2e"
    root.mkdir()
    torch.manual_seed(0)
    if ctx.quick:
        vocab, d, layers, heads, ff, T, B, iters = 4096, 384, 4, 6, 1536, 128, 4, 3
    else:
        vocab, d, layers, heads, ff, T, B, iters = 8192, 768, 8, 12, 3072, 128, 16, 6
    iters = getattr(ctx.args, "e2e_iters", None) or iters
    everies = [int(e) for e in str(getattr(ctx.args, "e2e_every", "1") or "1").split(",") if e.strip()] or [1]
    if min(everies) < 1 or max(everies) > iters:
        raise ValueError(
            f"--e2e-every: each interval must be between 1 and the {iters} iterations of a block, got {everies}"
        )
    model = TinyGPT(vocab, d, layers, heads, ff, T)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    nparams = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (B, T), generator=g)
    y = torch.randint(0, vocab, (B, T), generator=g)

    def fb() -> float:
        t0 = now()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        return now() - t0

    fb()
    opt.step()
    opt.zero_grad(set_to_none=False)
    state_bytes = tensor_bytes(train_state(model, opt))
    log(f"e2e: GPT {nparams / 1e6:.1f}M params, state+Adam {state_bytes / MiB:.0f} MiB, batch {B}x{T}, {iters} iters")
    pool = 1 * GiB if state_bytes <= 1 * GiB else 2 * GiB
    cfg = tiered_cfg(root / "tiered", pool, 64 * MiB, keep=2)

    block_no = [0]  # checkpoint ids are never reused: each block has its own

    def run_mode(mode: str, every: int = 1) -> dict:
        log(f"e2e: mode {mode}, a checkpoint every {every} iteration(s)")
        block_no[0] += 1
        blk = block_no[0]
        mdir = root / mode.replace(" ", "_")
        mdir.mkdir(exist_ok=True)
        writer = TieredWriter(cfg) if mode == "tiered" else None
        handle = writer.attach(opt) if writer else None
        pending: Any = None
        dirs: list[Path] = []
        fbs: list[float] = []
        steps_s: list[float] = []  # opt.step (+ the pre-step hook's wait) + zero_grad
        ckpt_s: list[float] = []  # the checkpoint call (+ the wait for the previous async_save)
        rm_s = [0.0]

        def it(i: int) -> None:
            nonlocal pending
            fbs.append(fb())
            t0 = now()
            opt.step()
            opt.zero_grad(set_to_none=False)
            steps_s.append(now() - t0)
            if mode == "none" or i % every:
                return
            sd = train_state(model, opt)
            t0 = now()
            if mode == "tiered":
                dcp.save(sd, checkpoint_id=f"e2e-b{blk:02d}-{i:04d}", storage_writer=writer)
                ckpt_s.append(now() - t0)
                return
            d = mdir / f"step-{i}"
            if mode == "sync FileSystemWriter":
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(d))
            else:
                if pending is not None:
                    pending.result()
                resp = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(d))
                if hasattr(resp, "staging_completion"):
                    resp.staging_completion.result()
                    resp = resp.upload_completion
                pending = resp
            ckpt_s.append(now() - t0)
            dirs.append(d)
            t0 = now()
            while len(dirs) > 2 + (1 if pending is not None else 0):
                rm(dirs.pop(0))
            rm_s[0] += now() - t0

        it(0)  # untimed warm-up iteration (touches the pool, DCP code paths)
        if writer:
            writer.wait()
        if pending is not None:
            pending.result()
            pending = None
        fbs.clear()
        steps_s.clear()
        ckpt_s.clear()
        rm_s[0] = 0.0
        c0 = cpu_seconds()
        t0 = now()
        for i in range(1, iters + 1):
            it(i)
        t_loop = now()
        if writer:
            writer.wait()
        if pending is not None:
            pending.result()
        total = now() - t0
        out = {
            "total_s": total,
            "fb_s": fbs,
            "opt_step_s": steps_s,
            "ckpt_call_s": ckpt_s,
            "rm_s": rm_s[0],
            "drain_s": now() - t_loop,
            "cpu_s": cpu_seconds() - c0,
        }
        if writer:
            hist = writer.history[-(iters // every) :]
            out["lib_capture_s"] = [h.capture_s for h in hist]
            out["lib_durable_s"] = [h.flush_s for h in hist]
            out["lib_prestep_wait_s"] = [h.prestep_wait_s for h in hist]
            out["lib_save_blocked_s"] = [h.save_blocked_s for h in hist]
            out["lib_cpu_s"] = [getattr(h, "cpu_s", 0.0) for h in hist]
            handle.remove()
        for d in dirs:
            rm(d)
        return out

    # Interleaved rounds (none, tiered, async, sync, none, tiered, ...), so that a change in what
    # else runs on the machine hits every mode alike; the none blocks of different rounds give the
    # drift. With one round (--quick) a last none block is the drift check.
    rounds = getattr(ctx.args, "e2e_rounds", None) or (1 if ctx.quick else 2)
    order = ("none", "tiered", "async_save", "sync FileSystemWriter")
    every = everies[0]
    blocks: dict[str, list[dict]] = {m: [] for m in order}
    more: dict[int, dict[str, list[dict]]] = {e: {m: [] for m in order[1:]} for e in everies[1:]}
    if len(everies) > 1:
        run_mode("none")  # discarded: a first block ran 3-6x slower than later ones (warm-up, or the load at start)
    for r in range(rounds):
        for m in order:
            log(f"e2e: round {r + 1}/{rounds}")
            blocks[m].append(run_mode(m, every if m != "none" else 1))
        for e in everies[1:]:  # further intervals, interleaved in the same rounds, each group after a none block
            blocks["none"].append(run_mode("none"))
            for m in order[1:]:
                more[e][m].append(run_mode(m, e))
    if rounds == 1:
        blocks["none"].append(run_mode("none"))
    iters_ck = iters // every  # checkpoints per block
    modes: dict[str, dict] = {}
    for m, bl in blocks.items():
        agg: dict[str, Any] = {
            "blocks": bl,
            "total_s": sum(b["total_s"] for b in bl) / (len(bl) if m == "none" else 1),
            "cpu_s": sum(b["cpu_s"] for b in bl) / (len(bl) if m == "none" else 1),
            "rm_s": sum(b["rm_s"] for b in bl),
            "drain_s": sum(b["drain_s"] for b in bl),
        }
        for k in (
            "fb_s",
            "opt_step_s",
            "ckpt_call_s",
            "lib_capture_s",
            "lib_durable_s",
            "lib_prestep_wait_s",
            "lib_cpu_s",
        ):
            if k in bl[0]:
                agg[k] = [x for b in bl for x in b[k]]
        modes[m] = agg
    # none: per-block mean scaled to the other modes' number of blocks
    scale = rounds
    tn = modes["none"]["total_s"] * scale
    cn = modes["none"]["cpu_s"] * scale
    tt = modes["tiered"]["total_s"]
    ckpt_gib = state_bytes * iters_ck * rounds / GiB
    rows = []
    for m, r in modes.items():
        total = r["total_s"] * (scale if m == "none" else 1)
        cpu = r["cpu_s"] * (scale if m == "none" else 1)
        note = (
            f"blocks {', '.join(format(b['total_s'], '.1f') for b in r['blocks'])} s; sum fwd+bwd {sum(r['fb_s']):.1f} s "
            f"(median {med(r['fb_s']):.2f}), opt.step {sum(r['opt_step_s']):.1f} s, "
            f"ckpt calls {sum(r['ckpt_call_s']):.1f} s; CPU {cpu - cn:+.1f} s vs none"
        )
        if m == "tiered":
            note += (
                f"; capture {med(r['lib_capture_s']):.2f} s, durable {med(r['lib_durable_s']):.2f} s, "
                f"pre-step wait {med(r['lib_prestep_wait_s']) * 1e3:.0f} ms, "
                f"writer.stats cpu_s {med(r['lib_cpu_s']):.3f} s/ckpt"
            )
        if m != "none":
            note += f"; final drains {r['drain_s']:.2f} s incl."
        if r["rm_s"]:
            note += f"; rm of old dirs {r['rm_s']:.2f} s incl."
        rows.append(
            row(
                f"total {rounds}x{iters} iters: {m}" + (" (mean of blocks x rounds)" if m == "none" else ""),
                [total],
                state_bytes * iters_ck * rounds if m != "none" else None,
                ratio=total / tn,
                note="ratio: vs none; " + note,
                cpu_s_per_gib=None if m == "none" else (cpu - cn) / ckpt_gib,
            )
        )
    nb = [b["total_s"] for b in modes["none"]["blocks"]]
    ratios = {
        "tiered/none": tt / tn,
        "async/none": modes["async_save"]["total_s"] / tn,
        "sync/none": modes["sync FileSystemWriter"]["total_s"] / tn,
        "async/tiered": modes["async_save"]["total_s"] / tt,
        "sync/tiered": modes["sync FileSystemWriter"]["total_s"] / tt,
        "(info) none drift: last/first none block": nb[-1] / nb[0],
    }
    targets = {"tiered/none": ("<=", 1.05), "async/tiered": (">", 1.0), "sync/tiered": (">=", 2.2)}
    notes = [
        f"GPT {nparams / 1e6:.1f}M params ({layers} x TransformerEncoderLayer d={d}, vocab {vocab}), batch {B}x{T}; "
        f"state+Adam {state_bytes / MiB:.0f} MiB; {rounds} interleaved round(s) of blocks (order: "
        f"{', '.join(order)}{', none' if rounds == 1 else ''}), each block {iters} timed iterations after 1 "
        f"untimed, a checkpoint every {every} iteration(s); tiered pool {size_label(pool)}/64MiB keep=2; GiB/s column: "
        "checkpoint bytes per wall second",
        "CPU-s/GiB column: process CPU seconds (all threads) over the timed iterations minus the no-checkpoint "
        "blocks' (scaled to the same iteration count), per checkpointed GiB: what checkpointing costs on these cores",
    ]
    series = [
        {
            "every": every,
            "checkpoints_per_block": iters_ck,
            "ratio_vs_none": {m: modes[m]["total_s"] / tn for m in order[1:]},
        }
    ]
    for e, bl in more.items():
        series.append(
            {
                "every": e,
                "checkpoints_per_block": iters // e,
                "ratio_vs_none": {m: sum(b["total_s"] for b in bl[m]) / tn for m in order[1:]},
                "total_s": {m: [b["total_s"] for b in bl[m]] for m in order[1:]},
            }
        )
        rows.append(
            row(
                f"a checkpoint every {e} iterations: tiered / async_save / sync, time vs none",
                note=", ".join(f"{m} {series[-1]['ratio_vs_none'][m]:.3f}" for m in order[1:]),
            )
        )
    if len(everies) > 1:
        notes.append(
            "series (checkpoint interval -> time vs no checkpoint): "
            + "; ".join(
                f"every {s_['every']}: " + ", ".join(f"{m} {v:.3f}" for m, v in s_["ratio_vs_none"].items())
                for s_ in series
            )
        )
    notes.append(
        write_timeline(
            ctx,
            "e2e",
            [root / "tiered"],
            last=iters // everies[-1],
            what=f"the last tiered block, a save every {everies[-1]} iteration(s)",
        )
    )
    rm(root)
    del model, opt
    gc.collect()
    server = getattr(ctx.args, "e2e_s3", "off")
    if server != "off":
        from benchlib.e2e_s3 import e2e_s3_rows

        try:
            s3rows, s3notes = e2e_s3_rows(ctx, server)
            rows += s3rows
            notes += s3notes
        except (OSError, RuntimeError, FileNotFoundError) as e:  # no server binary here: the rest still stands
            notes.append(f"e2e with S3 hop skipped: {type(e).__name__}: {e}")
    return {
        "rows": rows,
        "ratios": ratios,
        "targets": targets,
        "notes": notes,
        "modes": modes,
        "params": nparams,
        "state_bytes": state_bytes,
        "iters": iters,
        "series": series,
    }
