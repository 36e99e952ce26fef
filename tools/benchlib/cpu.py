"""Section ``cpu``: CPU seconds per checkpointed GiB in steady state, per thread."""

from __future__ import annotations

import dataclasses
import gc
import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from benchlib.common import Ctx, GiB, MiB, cpu_seconds, log, make_state, med, now, rm, row, tensor_bytes, tiered_cfg
from tierckpt import JobConfig, TieredWriter

VERIFIED = "tierckpt verify_capture=all nonfinite=warn"
SAMPLED = "tierckpt verify_capture=sample nonfinite=warn"

# ---------------------------------------------------------------------------------------------
# C2. CPU seconds per checkpointed GiB, steady state (consecutive checkpoints with retention)
# ---------------------------------------------------------------------------------------------


def thread_cpu() -> dict[int, float]:
    """CPU seconds (user+system) of every live thread of this process, by native thread id
    (``/proc/self/task/*/stat``; clock-tick resolution)."""
    tck = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        fields = s[s.rindex(")") + 2 :].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tck
    return out


_THREAD_GROUPS = (
    ("tierckpt-capture", "tierckpt capture"),
    ("tierckpt-flush", "tierckpt flush"),
    ("tierckpt-commit", "tierckpt commit"),
    ("tierckpt-janitor", "tierckpt janitor"),
    ("MainThread", "main thread"),
    ("AsyncCheckpointExecutor", "DCP async executor"),
)


def thread_groups(before: dict[int, float], after: dict[int, float], total: float) -> dict[str, float]:
    """CPU seconds per thread group between two :func:`thread_cpu` snapshots; threads that are
    not Python threads (torch intra-op, gloo) and threads that exited in between make up the rest
    of ``total`` (process CPU from getrusage, which counts exited threads too)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid, c in after.items():
        d = c - before.get(tid, 0.0)
        if d <= 0:
            continue
        name = names.get(tid, "")
        group = next(
            (g for p, g in _THREAD_GROUPS if name.startswith(p)), "other live threads" if name else "native threads"
        )
        out[group] = out.get(group, 0.0) + d
    out["exited threads / rounding"] = max(0.0, total - sum(out.values()))
    return out


def section_cpu(ctx: Ctx) -> dict:
    """CPU seconds per checkpointed GiB: TieredWriter vs DCP sync ``FileSystemWriter`` vs ``dcp.async_save``.

    Steady state: each mode saves one checkpoint after another (each waited for before the next),
    keeping the newest 2 (TieredWriter: ``keep=2`` retention; DCP: the oldest directory removed
    after each save), after warm-up saves that reach that state. Blocks of saves are interleaved
    (A B C A B C). CPU = this process's user+system seconds over the block (getrusage: every
    thread, exited ones too) per GiB of tensor bytes; per-thread figures from /proc/self/task.
    """
    size = int((0.25 if ctx.quick else ctx.args.cpu_gib) * GiB)
    nblock = 3 if ctx.quick else 5
    reps = 1 if ctx.quick else 2
    root = ctx.work / "cpu"
    root.mkdir()
    sd = make_state(size, seed=7)
    nbytes = tensor_bytes(sd)
    log(f"cpu: {nbytes / GiB:.3f} GiB state, {reps} x {nblock} saves per mode")
    cfg = tiered_cfg(root / "tiered", 1 * GiB, 64 * MiB, keep=2)
    writer = TieredWriter(cfg)
    # the same with the capture checks on (issue 35): source digest (every item / a rotating
    # eighth) + NaN/Inf scan
    writers = {"tierckpt": writer}
    for mode, verify in ((VERIFIED, "all"), (SAMPLED, "sample")):
        cfg_v = dataclasses.replace(
            tiered_cfg(root / verify, 1 * GiB, 64 * MiB, keep=2),
            job=JobConfig(verify_capture=verify, nonfinite="warn"),
        )
        writers[mode] = TieredWriter(cfg_v)
    dirs: dict[str, list[Path]] = {}
    count = {"n": 0}

    def save_once(mode: str) -> float:
        count["n"] += 1
        n = count["n"]
        t0 = now()
        if mode.startswith("tierckpt"):
            w = writers[mode]
            dcp.save(sd, checkpoint_id=f"cpu-{n:04d}", storage_writer=w)
            w.wait()
        else:
            d = root / f"{mode.split()[1]}-{n:04d}"
            if mode == "DCP sync FileSystemWriter":
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(d))
            else:
                resp = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(d))
                if hasattr(resp, "staging_completion"):
                    resp.staging_completion.result()
                    resp = resp.upload_completion
                resp.result()
            lst = dirs.setdefault(mode, [])
            lst.append(d)
            while len(lst) > 2:  # the same retention as keep=2
                rm(lst.pop(0))
        return now() - t0

    modes = ("tierckpt", VERIFIED, SAMPLED, "DCP sync FileSystemWriter", "DCP async_save")
    for m in modes:  # warm-up: pool touched, code paths loaded, retention in steady state
        for _ in range(3):
            save_once(m)
    res: dict[str, dict[str, Any]] = {m: {"cpu_per_gib": [], "wall_s": [], "threads": {}, "lib": {}} for m in modes}
    for r in range(reps):
        for m in modes:
            log(f"cpu: rep {r + 1}/{reps}: {m}")
            gc.collect()
            wm = writers.get(m, writer)
            hist0 = len(wm.history)
            th0 = thread_cpu()
            c0 = cpu_seconds()
            walls = [save_once(m) for _ in range(nblock)]
            cpu = cpu_seconds() - c0
            th = thread_groups(th0, thread_cpu(), cpu)
            e = res[m]
            e["cpu_per_gib"].append(cpu / (nbytes * nblock / GiB))
            e["wall_s"] += walls
            for g, v in th.items():
                e["threads"].setdefault(g, []).append(v / (nbytes * nblock / GiB))
            if m.startswith("tierckpt"):
                for h in wm.history[hist0:]:
                    for k in ("capture_cpu_s", "crc_cpu_s", "write_cpu_s", "verify_cpu_s"):
                        v = getattr(h, k, None)
                        if v is not None:
                            e["lib"].setdefault(k, []).append(v / (h.bytes / GiB))
    rows = []
    ref = med(res["tierckpt"]["cpu_per_gib"])
    for m in modes:
        e = res[m]
        cpg = med(e["cpu_per_gib"])
        parts = ", ".join(
            f"{g} {med(v):.3f}" for g, v in sorted(e["threads"].items(), key=lambda kv: -med(kv[1])) if med(v) >= 0.005
        )
        note = f"CPU-s/GiB by thread: {parts}"
        if e["lib"]:
            note += "; writer.stats per GiB: " + ", ".join(f"{k} {med(v):.3f}" for k, v in e["lib"].items())
        rows.append(
            row(
                f"{m}: save until durable+committed",
                e["wall_s"],
                nbytes,
                ratio=cpg / ref if ref else None,
                note=note,
                cpu_s_per_gib=cpg,
                cpu_s_per_gib_all=e["cpu_per_gib"],
                threads={g: med(v) for g, v in e["threads"].items()},
                lib={k: med(v) for k, v in e["lib"].items()},
            )
        )

    def check_cpu(m: str) -> float:
        """The checks' own CPU per GiB: ``writer.stats.verify_cpu_s`` (their code, timed per thread)
        plus what torch's native intra-op threads used beyond the same figure with the checks off.
        Steadier than the difference of two whole-process figures on a shared box."""
        lib = res[m]["lib"].get("verify_cpu_s") or [0.0]
        native = res[m]["threads"].get("native threads") or [0.0]
        native_off = res["tierckpt"]["threads"].get("native threads") or [0.0]
        return med(lib) + max(0.0, med(native) - med(native_off))

    ratios = {
        "tierckpt CPU-s/GiB": ref,
        "verify_capture=all+nonfinite: (off + checks' own CPU) / off (per GiB)": (ref + check_cpu(VERIFIED)) / ref,
        "verify_capture=sample+nonfinite: (off + checks' own CPU) / off (per GiB)": (ref + check_cpu(SAMPLED)) / ref,
        "verify_capture=all+nonfinite / off (CPU per GiB)": med(res[VERIFIED]["cpu_per_gib"]) / ref,
        "verify_capture=sample+nonfinite / off (CPU per GiB)": med(res[SAMPLED]["cpu_per_gib"]) / ref,
        "tierckpt/DCP sync (CPU per GiB)": ref / med(res["DCP sync FileSystemWriter"]["cpu_per_gib"]),
        "tierckpt/async_save (CPU per GiB)": ref / med(res["DCP async_save"]["cpu_per_gib"]),
    }
    targets = {
        "tierckpt CPU-s/GiB": ("<=", 0.3),
        "verify_capture=all+nonfinite: (off + checks' own CPU) / off (per GiB)": ("<=", 1.1),
        "verify_capture=sample+nonfinite: (off + checks' own CPU) / off (per GiB)": ("<=", 1.1),
        "verify_capture=all+nonfinite / off (CPU per GiB)": ("<=", 1.1),
        "verify_capture=sample+nonfinite / off (CPU per GiB)": ("<=", 1.1),
        "tierckpt/DCP sync (CPU per GiB)": ("<", 1.0),
        "tierckpt/async_save (CPU per GiB)": ("<", 1.0),
    }
    notes = [
        f"state {nbytes / GiB:.3f} GiB ({len([v for v in sd.values() if isinstance(v, torch.Tensor)])} tensors); "
        f"{reps} interleaved blocks of {nblock} consecutive saves per mode after 3 warm-up saves; each save waited for "
        "(tierckpt: writer.wait(), DCP: the save / its future) before the next; newest 2 kept (tierckpt keep=2, "
        "pool 1GiB/64MiB, 4 flush threads; DCP: rmtree of the oldest directory, inside the block)",
        "cpu/GiB = this process's user+system CPU over the block / GiB saved; ratio column: vs tierckpt. "
        "Not counted: kernel writeback threads (buffered writes the kernel flushes in the background, "
        "before fsync, are charged to kworkers: DCP's figures are a lower bound)",
    ]
    for w in writers.values():
        w.wait()
    for lst in dirs.values():
        for d in lst:
            rm(d)
    rm(root)
    del sd
    gc.collect()
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes, "modes": res, "state_bytes": nbytes}
