"""Section ``restore`` (only with ``--only``): node-loss fetch and consolidation."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch.distributed.checkpoint as dcp

from tierckpt import LocalConfig, TierConfig, TieredReader, TieredWriter

from benchlib.common import BENCH, Ctx, GiB, MiB, RssPeak, compare_state, drop_caches, empty_like_state, log, make_state, med, now, rm, row, tensor_bytes, zero_state
from benchlib.s3 import S3_CONC, S3_PART, list_objects, raw_download, s3_tier_cfg, start_s3_server


# ---------------------------------------------------------------------------------------------
# F. restore after node loss: fetch + load; consolidate (fresh processes, peak RSS)
# ---------------------------------------------------------------------------------------------

def consolidate_child(spec: dict) -> dict:
    """One conversion in a fresh process; peak RSS by psutil sampling (5 ms) over the call (ru_maxrss
    is inherited across fork/exec on Linux, so it would report the parent's high-water mark)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from restore.consolidate import consolidate_checkpoint

    gc.collect()
    with RssPeak() as mem:
        t0 = now()
        if spec["mode"] == "dcp_to_torch_save":
            dcp_to_torch_save(spec["src"], spec["out"])
        else:
            cfg = TierConfig(local=LocalConfig(path=spec["src"]))
            consolidate_checkpoint(cfg, spec["cid"], out=spec["out"], progress=False)
        t = now() - t0
    return {"time_s": t, "base_maxrss": mem.base, "peak_maxrss": mem.peak, "out_bytes": os.path.getsize(spec["out"])}


def section_restore(ctx: Ctx) -> dict:
    from restore.fetch import fetch_checkpoint
    from tierckpt.tiers.s3 import make_client

    size = (64 if ctx.quick else 256) * MiB
    reps = 2 if ctx.quick else 3
    sd = make_state(size, seed=6)
    nbytes = tensor_bytes(sd)
    rows: list[dict] = []
    notes: list[str] = []
    ratios: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    tmp = ctx.work / "restore"
    tmp.mkdir()
    server = None
    for kind in ("seaweedfs", "moto"):
        try:
            url, stop, snote = start_s3_server(kind, tmp / kind)
            server = kind
            notes.append(f"server: {snote}")
            break
        except Exception as e:  # noqa: BLE001
            notes.append(f"{kind}: cannot start: {e}"[:300])
    if server is None:
        return {"rows": rows, "notes": notes}
    try:
        local = tmp / "local"
        cfg = s3_tier_cfg(local, url, "restore", 256 * MiB if size <= 256 * MiB else GiB)
        writer = TieredWriter(cfg)
        dcp.save(sd, checkpoint_id="r-0001", storage_writer=writer)
        writer.wait()
        writer.close()
        client = make_client(cfg.s3)
        objs = [o for o in list_objects(client, "restore/") if "/r-0001/" in o[0] and o[1] > MiB]
        dsize = sum(s for _, s in objs)
        bufs = [bytearray(s) for _, s in objs]
        dest = empty_like_state(sd)
        t_fetch, t_load, t_total, t_raw = [], [], [], []
        for r in range(reps):
            rm(local)  # node loss
            drop_caches()
            zero_state(dest)
            t0 = now()
            fetch_checkpoint(cfg, "latest", progress=False)
            t1 = now()
            dcp.load(dest, checkpoint_id="latest", storage_reader=TieredReader(cfg))
            t2 = now()
            t_fetch.append(t1 - t0)
            t_load.append(t2 - t1)
            t_total.append(t2 - t0)
            if r == 0:
                bad = compare_state(dest, sd)
                if bad:
                    raise RuntimeError(f"restore mismatch: {bad[:5]}")
            t_raw.append(raw_download(client, objs, bufs, S3_PART, S3_CONC))
            log(f"restore rep {r}: fetch {t_fetch[-1]:.2f} load {t_load[-1]:.2f} raw {t_raw[-1]:.2f}")
        del bufs
        ratio = med(t_raw) / med(t_total)
        rows += [row(f"{server}: raw boto3 ranged GETs (memory)", t_raw, dsize, note="ceiling"),
                 row(f"{server}: fetch_checkpoint('latest')", t_fetch, dsize, ratio=med(t_raw) / med(t_fetch),
                     note="ratio: raw/fetch; writes+fsyncs the local copy, CRC32C per piece"),
                 row(f"{server}: dcp.load from fetched copy", t_load, dsize, note="TieredReader (local tier)"),
                 row(f"{server}: fetch + load (restore)", t_total, dsize, ratio=ratio, note="ratio: raw/ours (time)")]
        ratios["restore raw/ours"] = ratio
        targets["restore raw/ours"] = (">=", 0.9)
        # consolidate vs dcp_to_torch_save, fresh process each
        fsw = tmp / "fsw"
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(fsw))
        cases = [("consolidate -> .safetensors", "safetensors", str(local), "x.safetensors"),
                 ("consolidate -> .pt", "pt", str(local), "x.pt"),
                 ("dcp_to_torch_save (FileSystemWriter copy)", "dcp_to_torch_save", str(fsw), "y.pt")]
        cres: dict[str, list[dict]] = {c[0]: [] for c in cases}
        for r in range(2 if ctx.quick else reps):
            for name, mode, src, outname in cases:
                out = tmp / outname
                spec = {"mode": mode, "src": src, "cid": "r-0001", "out": str(out)}
                cp = subprocess.run([sys.executable, str(BENCH), "--_consolidate-child", json.dumps(spec)],
                                    capture_output=True, text=True, timeout=600)
                rm(out)
                if cp.returncode != 0:
                    raise RuntimeError(f"consolidate child {mode} failed: {cp.stderr[-3000:]}")
                cres[name].append(json.loads(cp.stdout.strip().splitlines()[-1]))
        ref = med([c["time_s"] for c in cres[cases[2][0]]])
        for name, _, _, _ in cases:
            rs = cres[name]
            peak = max(c["peak_maxrss"] - c["base_maxrss"] for c in rs)
            ts = [c["time_s"] for c in rs]
            rows.append(row(name, ts, nbytes, ratio=ref / med(ts),
                            note=(f"peak RSS - base {peak / MiB:.0f} MiB (= {peak / nbytes:.2f}x state); "
                                  f"abs peak {max(c['peak_maxrss'] for c in rs) / MiB:.0f} MiB; ratio: dcp_to_torch_save/this (time)"),
                            peak_minus_base=peak))
        notes.append(f"state {nbytes / MiB:.0f} MiB, data objects {dsize / MiB:.0f} MiB; node loss = local tier dir "
                     f"removed (+ page cache dropped if permitted: {drop_caches()}); {reps} repeats; [s3] part "
                     f"{S3_PART // MiB} MiB x {S3_CONC}")
        notes.append("consolidate: each run in a fresh child process; RSS sampled every 5 ms (psutil): base after imports, "
                     "peak during the call; ratio: dcp_to_torch_save time / this")
    finally:
        stop()
    rm(tmp)
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes, "server": server}

