"""Section ``rss``: peak RSS of a fresh process during TieredWriter saves."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from benchlib.common import BENCH, Ctx, MiB, RssPeak, init_pg, log, make_state, now, rm, row, tensor_bytes, tiered_cfg
from tierckpt import TieredWriter

# ---------------------------------------------------------------------------------------------
# D. peak RSS during a TieredWriter save (fresh child process per measurement)
# ---------------------------------------------------------------------------------------------


def rss_child(spec: dict) -> dict:
    work = Path(spec["dir"])
    sd = make_state(spec["state"], seed=3)
    nbytes = tensor_bytes(sd)
    init_pg()
    # warm DCP code paths on a tiny state so that imports do not count
    tiny = {"x": torch.zeros(8)}
    dcp.save(tiny, storage_writer=dcp.FileSystemWriter(work / "warm"))
    rm(work / "warm")
    gc.collect()
    mem = RssPeak()
    out: dict[str, Any] = {"state_bytes": nbytes, "base_rss": mem.base, "saves": []}
    try:
        with mem:
            for i in range(2):
                mem.peak = before = mem.rss()
                t0 = now()
                if spec["mode"] == "tiered":
                    cfg = tiered_cfg(work / "tiered", spec["pool"], spec["chunk"], keep=1)
                    w = TieredWriter(cfg)
                    dcp.save(sd, checkpoint_id=f"rss-{i}", storage_writer=w)
                    w.wait()
                else:
                    dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(work / f"async-{i}")).result()
                    rm(work / f"async-{i}")
                t = now() - t0
                time.sleep(0.02)
                gc.collect()
                out["saves"].append({"peak_rss": mem.peak, "rss_before": before, "rss_after": mem.rss(), "time_s": t})
    finally:
        rm(work / "tiered")
    return out


def section_rss(ctx: Ctx) -> dict:
    state = (256 if ctx.quick else 1024) * MiB
    cases = [
        ("tiered pool 1/4", "tiered", state // 4, 32 * MiB),
        ("tiered pool 1x", "tiered", state, 64 * MiB),
        ("async_save (DefaultStager ref.)", "async", 0, 0),
    ]
    rows = []
    raw: dict[str, Any] = {}
    for name, mode, pool, chunk in cases:
        d = ctx.work / f"rss-{mode}-{pool}"
        d.mkdir()
        spec = {"dir": str(d), "state": state, "mode": mode, "pool": pool, "chunk": chunk}
        log(f"rss: {name} (child process)")
        cp = subprocess.run(
            [sys.executable, str(BENCH), "--_rss-child", json.dumps(spec)], capture_output=True, text=True, timeout=600
        )
        rm(d)
        if cp.returncode != 0:
            raise RuntimeError(f"rss child failed: {cp.stderr[-3000:]}")
        res = json.loads(cp.stdout.strip().splitlines()[-1])
        raw[name] = res
        sb = res["state_bytes"]
        for i, s in enumerate(res["saves"]):
            delta = s["peak_rss"] - res["base_rss"]
            label = "first (pool allocated)" if i == 0 else "second (pool reused)"
            if mode != "tiered":
                label = f"save {i + 1}"
            ref = pool if mode == "tiered" else sb
            rows.append(
                row(
                    f"{name}: {label}",
                    [s["time_s"]],
                    sb,
                    ratio=delta / ref,
                    note=(
                        f"peak-base {delta / MiB:.0f} MiB; pool {pool / MiB:.0f} MiB; state {sb / MiB:.0f} MiB; "
                        f"ratio: (peak-base)/{'pool' if mode == 'tiered' else 'state'}"
                    ),
                    peak_minus_base=delta,
                    pool=pool,
                )
            )
    notes = [
        "child process per case; RSS sampled every 5 ms; base = RSS after the state dict was built; "
        "pool and engine persist in the process, so the second save shows the steady state"
    ]
    return {"rows": rows, "notes": notes, "children": raw}
