"""Section ``restore`` (only with ``--only``): node-loss fetch + load against a raw parallel download
(SeaweedFS and moto, side by side, wall time and CPU seconds per GiB), the CLI's start, and
consolidation."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from benchlib.common import (
    BENCH,
    Ctx,
    GiB,
    MiB,
    RssPeak,
    compare_state,
    cpu_seconds,
    drop_caches,
    empty_like_state,
    log,
    make_state,
    med,
    now,
    rm,
    row,
    tensor_bytes,
    zero_state,
)
from benchlib.s3clients import S3_CONC, S3_PART, list_objects, raw_download, s3_tier_cfg, start_s3_server
from tierckpt import LocalConfig, TierConfig, TieredReader, TieredWriter

REPO = Path(__file__).resolve().parent.parent.parent


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


def _cli_start(cfg_path: Path, reps: int) -> tuple[list[float], list[float]]:
    """Wall seconds of ``python -m restore latest`` and of ``python -c pass`` in fresh processes, interleaved."""
    env = dict(os.environ, TIERCKPT_CONFIG=str(cfg_path), PYTHONPATH=str(REPO))
    t_cli, t_py = [], []
    for _ in range(reps):
        t0 = now()
        cp = subprocess.run(
            [sys.executable, "-m", "restore", "latest"], env=env, capture_output=True, text=True, timeout=120, cwd=REPO
        )
        t_cli.append(now() - t0)
        if cp.returncode != 0:
            raise RuntimeError(f"tierckpt-restore latest failed: {cp.stderr[-2000:]}")
        t0 = now()
        subprocess.run([sys.executable, "-c", "pass"], env=env, timeout=60)
        t_py.append(now() - t0)
    return t_cli, t_py


def _fetch_vs_raw(
    ctx: Ctx,
    server: str,
    url: str,
    tmp: Path,
    sd: dict,
    reps: int,
    rows: list[dict],
    ratios: dict[str, Any],
    targets: dict[str, Any],
) -> Path:
    """One server: save, then ``reps`` interleaved rounds of (raw parallel download, node loss +
    fetch_checkpoint + dcp.load); rows with wall time and this process's CPU seconds per GiB."""
    from restore.fetch import fetch_checkpoint
    from tierckpt.tiers.s3 import make_client

    local = tmp / f"local-{server}"
    cfg = s3_tier_cfg(local, url, f"restore-{server}", 256 * MiB)
    writer = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id="r-0001", storage_writer=writer)
    writer.wait()
    writer.close()
    client = make_client(cfg.s3)
    objs = [o for o in list_objects(client, f"restore-{server}/") if "/r-0001/" in o[0] and o[1] > MiB]
    dsize = sum(s for _, s in objs)
    bufs = [bytearray(s) for _, s in objs]
    dest = empty_like_state(sd)
    t_fetch, t_load, t_total, t_raw, t_fill, t_filled, t_disk = [], [], [], [], [], [], []
    c_fetch, c_load, c_total, c_raw, c_fill = [], [], [], [], []
    for r in range(reps):
        drop_caches()  # both ways start from a cold server (its volume files out of the page cache)
        c0 = cpu_seconds()
        t_raw.append(raw_download(client, objs, bufs, S3_PART, S3_CONC))
        c_raw.append(cpu_seconds() - c0)
        rm(local)  # node loss
        drop_caches()
        zero_state(dest)
        c0, t0 = cpu_seconds(), now()
        res = fetch_checkpoint(cfg, "latest", progress=False)
        c1, t1 = cpu_seconds(), now()
        dcp.load(dest, checkpoint_id="latest", storage_reader=TieredReader(cfg))
        c2, t2 = cpu_seconds(), now()
        t_fetch.append(t1 - t0)
        t_load.append(t2 - t1)
        t_total.append(t2 - t0)
        c_fetch.append(c1 - c0)
        c_load.append(c2 - c1)
        c_total.append(c2 - c0)
        if r == 0:
            bad = compare_state(dest, sd)
            if bad:
                raise RuntimeError(f"restore mismatch: {bad[:5]}")
            if set(res.sources.values()) != {"s3"}:
                raise RuntimeError(f"fetch took files from {res.sources}")
        drop_caches()  # the disk's part of any load after a fetch: read the fetched files once, O_DIRECT
        t_disk.append(direct_read([p for p in local.rglob("*") if p.is_file() and p.stat().st_size > MiB]))
        # the one-step restore: dcp.load straight from S3, filling the local tier as the bytes arrive
        rm(local)
        drop_caches()
        zero_state(dest)
        c0, t0 = cpu_seconds(), now()
        reader = TieredReader(cfg)
        dcp.load(dest, checkpoint_id="latest", storage_reader=reader)
        c1, t1 = cpu_seconds(), now()
        if reader.fill is None:
            raise RuntimeError("the load from S3 did not fill the local tier")
        reader.fill.wait()
        t2 = now()
        t_fill.append(t1 - t0)
        t_filled.append(t2 - t0)
        c_fill.append(c1 - c0)
        if r == 0:
            bad = compare_state(dest, sd)
            if bad:
                raise RuntimeError(f"restore (fill) mismatch: {bad[:5]}")
            if set(reader.served.values()) != {"s3"} or not reader.fill.committed:
                raise RuntimeError(f"fill: served {reader.served}, committed {reader.fill.committed}")
        log(
            f"restore {server} rep {r}: raw {t_raw[-1]:.2f} fetch {t_fetch[-1]:.2f} load {t_load[-1]:.2f} "
            f"load+fill {t_fill[-1]:.2f} (committed {t_filled[-1]:.2f})"
        )
    t_client = []
    for _ in range(reps):  # what every fetch pays first: its tier's S3 client, made from a cold page cache
        drop_caches()
        t0 = now()
        make_client(cfg.s3)
        t_client.append(now() - t0)
    del bufs
    gib = dsize / GiB
    ratio = med(t_raw) / med(t_total)
    rows += [
        row(f"{server}: raw boto3 ranged GETs (memory)", t_raw, dsize, note="ceiling", cpu_s_per_gib=med(c_raw) / gib),
        row(
            f"{server}: fetch_checkpoint('latest')",
            t_fetch,
            dsize,
            ratio=med(t_raw) / med(t_fetch),
            note="ratio: raw/fetch; CRC32C per piece, O_DIRECT writes, one fsync per file",
            cpu_s_per_gib=med(c_fetch) / gib,
        ),
        row(
            f"{server}: dcp.load from fetched copy",
            t_load,
            dsize,
            note="TieredReader (local tier, cold)",
            cpu_s_per_gib=med(c_load) / gib,
        ),
        row(
            f"{server}: fetch + load (restore)",
            t_total,
            dsize,
            ratio=ratio,
            note="ratio: raw/ours (time)",
            cpu_s_per_gib=med(c_total) / gib,
        ),
        row(
            f"{server}: O_DIRECT read of the fetched files",
            t_disk,
            dsize,
            note="what any load after a fetch reads back from this disk",
        ),
        row(
            f"{server}: floor of fetch then load here",
            [a + b for a, b in zip(t_raw, t_disk)],
            dsize,
            ratio=(med(t_raw) + med(t_disk)) / med(t_total),
            note="raw download + that read; ratio: floor/ours (time); its own ratio to raw is the best a "
            "two-step restore can reach on this machine",
        ),
        row(
            f"{server}: dcp.load from S3, filling [local] (restore)",
            t_fill,
            dsize,
            ratio=med(t_raw) / med(t_fill),
            note="ratio: raw/ours (time); [local] fill_on_load: the load returns once the state is in",
            cpu_s_per_gib=med(c_fill) / gib,
        ),
        row(
            f"{server}: ... until the local copy is committed",
            t_filled,
            dsize,
            ratio=med(t_raw) / med(t_filled),
            note="fsync + rename + metadata in the fill's background thread",
        ),
        row(
            f"{server}: of which: S3 client creation",
            t_client,
            note="a further S3 client in this process, page cache dropped (clients share one botocore loader)",
        ),
    ]
    ratios[f"{server}: restore raw/ours"] = ratio
    targets[f"{server}: restore raw/ours"] = (">=", 0.9)
    ratios[f"{server}: two-step floor raw/floor"] = med(t_raw) / (med(t_raw) + med(t_disk))
    ratios[f"{server}: restore by load+fill raw/ours"] = med(t_raw) / med(t_fill)
    targets[f"{server}: restore by load+fill raw/ours"] = (">=", 0.9)
    return local


def direct_read(paths: list[Path], block: int = 16 * MiB) -> float:
    """Seconds to read ``paths`` once with ``O_DIRECT`` into one reused page-aligned buffer."""
    import mmap

    buf = mmap.mmap(-1, block)
    t0 = now()
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            while os.readv(fd, [buf]) == block:
                pass
        finally:
            os.close(fd)
    dt = now() - t0
    buf.close()
    return dt


def section_restore(ctx: Ctx) -> dict:
    size = (64 if ctx.quick else 512) * MiB
    reps = 2 if ctx.quick else 3
    sd = make_state(size, seed=6)
    nbytes = tensor_bytes(sd)
    rows: list[dict] = []
    notes: list[str] = []
    ratios: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    tmp = ctx.work / "restore"
    tmp.mkdir()
    kept: Path | None = None
    servers: list[str] = []
    for kind in ("seaweedfs", "moto"):
        try:
            url, stop, snote = start_s3_server(kind, tmp / kind)
        except Exception as e:  # noqa: BLE001
            notes.append(f"{kind}: cannot start: {e}"[:300])
            continue
        notes.append(f"server: {snote}")
        servers.append(kind)
        try:
            local = _fetch_vs_raw(ctx, kind, url, tmp, sd, reps, rows, ratios, targets)
            if kept is None:
                kept = local
            else:
                rm(local)
        finally:
            stop()
    if kept is None:
        return {"rows": rows, "notes": notes}
    # CLI start: the command a launcher runs on every restart (fresh processes)
    cfg_path = tmp / "local-only.toml"
    cfg_path.write_text(f'[local]\npath = "{kept}"\n')
    t_cli, t_py = _cli_start(cfg_path, 3 if ctx.quick else 7)
    rows += [
        row("tierckpt-restore latest (fresh process)", t_cli, note="target < 0.5 s"),
        row("python -c pass (fresh process)", t_py, note="interpreter start, for reference"),
    ]
    targets["tierckpt-restore latest s"] = ("<=", 0.5)
    ratios["tierckpt-restore latest s"] = med(t_cli)
    # consolidate vs dcp_to_torch_save, fresh process each
    fsw = tmp / "fsw"
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(fsw))
    cases = [
        ("consolidate -> .safetensors", "safetensors", str(kept), "x.safetensors"),
        ("consolidate -> .pt", "pt", str(kept), "x.pt"),
        ("dcp_to_torch_save (FileSystemWriter copy)", "dcp_to_torch_save", str(fsw), "y.pt"),
    ]
    cres: dict[str, list[dict]] = {c[0]: [] for c in cases}
    for _r in range(2 if ctx.quick else reps):
        for name, mode, src, outname in cases:
            out = tmp / outname
            spec = {"mode": mode, "src": src, "cid": "r-0001", "out": str(out)}
            cp = subprocess.run(
                [sys.executable, str(BENCH), "--_consolidate-child", json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=600,
            )
            rm(out)
            if cp.returncode != 0:
                raise RuntimeError(f"consolidate child {mode} failed: {cp.stderr[-3000:]}")
            cres[name].append(json.loads(cp.stdout.strip().splitlines()[-1]))
    ref = med([c["time_s"] for c in cres[cases[2][0]]])
    for name, _, _, _ in cases:
        rs = cres[name]
        peak = max(c["peak_maxrss"] - c["base_maxrss"] for c in rs)
        ts = [c["time_s"] for c in rs]
        rows.append(
            row(
                name,
                ts,
                nbytes,
                ratio=ref / med(ts),
                note=(
                    f"peak RSS - base {peak / MiB:.0f} MiB (= {peak / nbytes:.2f}x state); "
                    f"abs peak {max(c['peak_maxrss'] for c in rs) / MiB:.0f} MiB; ratio: dcp_to_torch_save/this (time)"
                ),
                peak_minus_base=peak,
            )
        )
    notes.append(
        f"state {nbytes / MiB:.0f} MiB; node loss = local tier dir removed; page cache dropped before "
        f"the raw download and before the fetch (server cold both ways) if permitted: {drop_caches()}; {reps} interleaved repeats per server ({', '.join(servers)}); "
        f"[s3] part {S3_PART // MiB} MiB x {S3_CONC}; CPU-s/GiB: this process's user+system seconds per "
        "GiB of data objects (the S3 server runs in its own process, not counted)"
    )
    notes.append(
        "consolidate: each run in a fresh child process; RSS sampled every 5 ms (psutil): base after imports, "
        "peak during the call; ratio: dcp_to_torch_save time / this"
    )
    rm(tmp)
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes, "server": ",".join(servers)}
