"""Section ``s3`` (only with ``--only``): promotion and S3 loads vs raw boto3."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from benchlib.common import (
    Ctx,
    GiB,
    MiB,
    compare_state,
    cpu_seconds,
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
from benchlib.cpu import thread_cpu
from benchlib.s3clients import (
    PROMOTE_THREADS,
    S3_BUCKET,
    S3_CONC,
    S3_PART,
    Crt,
    default_client,
    delete_prefix,
    have_crt,
    list_objects,
    raw_download,
    raw_upload,
    s3_tier_cfg,
    s3tc_client,
    s3tc_probe,
    start_s3_server,
    threads_cpu,
)
from tierckpt import TieredReader, TieredWriter


class _Series:
    """Times and CPU seconds of one path over the repeats."""

    def __init__(self) -> None:
        self.t: list[float] = []
        self.c: list[float] = []

    def timed(self, fn: Callable[[], Any]) -> Any:
        c0, t0 = cpu_seconds(), now()
        out = fn()
        self.t.append(now() - t0)
        self.c.append(cpu_seconds() - c0)
        return out

    def per_gib(self, nbytes: int) -> float | None:
        return med(self.c) / (nbytes / GiB) if self.c else None


def _one_size(kind: str, url: str, tmp: Path, size: int, reps: int, why_tc: str | None, notes: list[str]) -> dict:
    """Every path, interleaved per repeat, for one state size on one server."""
    from tierckpt.tiers.s3 import make_client

    sd = make_state(size, seed=5)
    nbytes = tensor_bytes(sd)
    gib = f"{nbytes / GiB:.2g} GiB"
    pool = 256 * MiB if nbytes <= 256 * MiB else (nbytes + 64 * MiB)
    prefix = f"bench-{kind}-{size // MiB}"
    local = tmp / f"local-{size // MiB}"
    cfg = s3_tier_cfg(local, url, prefix, pool, keep_s3=2)
    cfg_s3 = s3_tier_cfg(None, url, prefix, pool)
    client = make_client(cfg.s3)
    dclient = default_client(url)
    crt = Crt(url) if have_crt() else None
    writer = TieredWriter(cfg)
    S = {k: _Series() for k in ("save", "up", "up_def", "up_crt", "ld", "dl", "dl_crt", "tcw", "tcr")}
    t_prom: list[float] = []
    c_prom: list[float] = []
    dest = empty_like_state(sd)
    objs: list[tuple[str, int]] = []
    try:
        for r in range(reps):
            cid = f"s3b-{r:02d}"
            # (a) our save until promoted (capture, local durable commit, promotion, S3 commit)
            before = thread_cpu()
            S["save"].timed(lambda: (dcp.save(sd, checkpoint_id=cid, storage_writer=writer), writer.wait()))
            c_prom.append(threads_cpu(before, thread_cpu(), PROMOTE_THREADS))
            t_prom.append(writer.history[-1].promote_s)
            files = [p for p in local.rglob("*") if p.is_file() and cid in str(p) and p.stat().st_size > MiB]
            assert len(files) == 1, files
            # (b) raw uploads of the same data file: tier's client config, boto3 defaults, awscrt
            S["up"].timed(lambda: raw_upload(client, f"raw/{kind}-{r}-t", files[0], S3_PART, S3_CONC))
            S["up_def"].timed(lambda: raw_upload(dclient, f"raw/{kind}-{r}-d", files[0], S3_PART, S3_CONC))
            if crt is not None:
                S["up_crt"].timed(lambda: crt.upload(f"raw/{kind}-{r}-c", files[0]))
            delete_prefix(client, "raw/")
            # (c) load from S3 only, then raw ranged GETs of the same objects (boto3, awscrt)
            zero_state(dest)
            S["ld"].timed(lambda: dcp.load(dest, checkpoint_id=cid, storage_reader=TieredReader(cfg_s3)))
            if r == 0:
                bad = compare_state(dest, sd)
                if bad:
                    raise RuntimeError(f"S3 load mismatch: {bad[:5]}")
            objs = [o for o in list_objects(client, f"{prefix}/") if f"/{cid}/" in o[0] and o[1] > MiB]
            if not objs:
                raise RuntimeError(f"no data objects of {cid} found on S3")
            bufs = [bytearray(s) for _, s in objs]
            S["dl"].timed(lambda: raw_download(client, objs, bufs, S3_PART, S3_CONC))
            if crt is not None:
                S["dl_crt"].timed(lambda: crt.download(objs, bufs))
            del bufs
            # (d) s3torchconnector's DCP writer/reader
            if not why_tc:
                from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

                path = f"s3://{S3_BUCKET}/tc-{kind}/{r}"
                w = S3StorageWriter(region="us-east-1", path=path, thread_count=S3_CONC)
                w.fs._client = s3tc_client(url)
                S["tcw"].timed(lambda: dcp.save(sd, storage_writer=w))
                zero_state(dest)
                rd = S3StorageReader(region="us-east-1", path=path)
                rd.fs._client = s3tc_client(url)
                S["tcr"].timed(lambda: dcp.load(dest, storage_reader=rd))
                if r == 0:
                    bad = compare_state(dest, sd)
                    if bad:
                        notes.append(f"{kind}: s3torchconnector load mismatch: {bad[:3]}")
                delete_prefix(client, f"tc-{kind}/")
            log(
                f"s3 {kind} {gib} rep {r}: save->promoted {S['save'].t[-1]:.2f} (promote {t_prom[-1]:.2f}) raw up "
                f"{S['up'].t[-1]:.2f}/{S['up_def'].t[-1]:.2f}"
                + (f"/crt {S['up_crt'].t[-1]:.2f}" if S["up_crt"].t else "")
                + f" load {S['ld'].t[-1]:.2f} raw dl {S['dl'].t[-1]:.2f}"
                + (f"/crt {S['dl_crt'].t[-1]:.2f}" if S["dl_crt"].t else "")
                + (f" tc w {S['tcw'].t[-1]:.2f} r {S['tcr'].t[-1]:.2f}" if S["tcw"].t else "")
            )
    finally:
        writer.close()
    dsize = sum(s for _, s in objs)
    pg = med(c_prom) / (dsize / GiB) if c_prom else None

    def ratio(a: list[float], b: list[float]) -> float | None:
        return med(a) / med(b) if a and b else None

    n = f"{kind} {gib}"
    crt_rows = (
        [
            row(
                f"{n}: raw awscrt upload (send_filepath, direct_io)",
                S["up_crt"].t,
                dsize,
                cpu_s_per_gib=S["up_crt"].per_gib(dsize),
                note="CRC32C per part by the CRT",
            ),
            row(
                f"{n}: raw awscrt GETs",
                S["dl_crt"].t,
                dsize,
                cpu_s_per_gib=S["dl_crt"].per_gib(dsize),
                note="split by the CRT, copied in on_body",
            ),
        ]
        if crt is not None
        else []
    )
    rows = crt_rows + [
        row(
            f"{n}: raw boto3 upload, tier's client config",
            S["up"].t,
            dsize,
            cpu_s_per_gib=S["up"].per_gib(dsize),
            note="no checksum; unsigned payload, 1 MiB send blocks",
        ),
        row(
            f"{n}: raw boto3 upload, boto3 defaults",
            S["up_def"].t,
            dsize,
            cpu_s_per_gib=S["up_def"].per_gib(dsize),
            note="no checksum; payload SHA-256 signed (http)",
        ),
        row(
            f"{n}: tierckpt promotion (promote_s)",
            t_prom,
            dsize,
            ratio=ratio(S["up"].t, t_prom),
            cpu_s_per_gib=pg,
            note="ratio: raw (tier config) / ours; CPU: promotion threads",
        ),
        row(
            f"{n}: tierckpt save->promoted (dcp.save..wait)",
            S["save"].t,
            dsize,
            cpu_s_per_gib=S["save"].per_gib(dsize),
            note="capture + local durable + commit + promotion",
        ),
        row(
            f"{n}: raw boto3 ranged GETs", S["dl"].t, dsize, cpu_s_per_gib=S["dl"].per_gib(dsize), note="tier's client"
        ),
        row(
            f"{n}: TieredReader from S3 only",
            S["ld"].t,
            dsize,
            ratio=ratio(S["dl"].t, S["ld"].t),
            cpu_s_per_gib=S["ld"].per_gib(dsize),
            note="ratio: raw boto3 / ours; CRC-checked",
        ),
    ]
    ratios: dict[str, Any] = {
        f"{n} promote raw/ours": ratio(S["up"].t, t_prom),
        f"{n} S3 load raw/ours": ratio(S["dl"].t, S["ld"].t),
        f"{n} upload CPU/GiB ours/raw defaults": pg / S["up_def"].per_gib(dsize) if pg else None,
        f"{n} upload CPU/GiB ours/raw tier config": pg / S["up"].per_gib(dsize) if pg else None,
    }
    targets: dict[str, Any] = {
        f"{n} promote raw/ours": (">=", 1.0),
        f"{n} upload CPU/GiB ours/raw defaults": ("<", 1.0),
    }
    if S["tcw"].t:
        rows += [
            row(
                f"{n}: s3torchconnector S3StorageWriter",
                S["tcw"].t,
                dsize,
                ratio=ratio(S["tcw"].t, S["save"].t),
                cpu_s_per_gib=S["tcw"].per_gib(dsize),
                note="ratio: its save / our save->promoted; CPU incl. its serialization",
            ),
            row(
                f"{n}: s3torchconnector S3StorageReader",
                S["tcr"].t,
                dsize,
                ratio=ratio(S["tcr"].t, S["ld"].t),
                cpu_s_per_gib=S["tcr"].per_gib(dsize),
                note="ratio: its load / our S3 load",
            ),
        ]
        ratios[f"{n} s3tc writer / our save->promoted"] = ratio(S["tcw"].t, S["save"].t)
        ratios[f"{n} s3tc writer / our promotion"] = ratio(S["tcw"].t, t_prom)
        ratios[f"{n} s3tc reader / our S3 load"] = ratio(S["tcr"].t, S["ld"].t)
        targets[f"{n} s3tc writer / our save->promoted"] = (">=", 1.2)
        targets[f"{n} s3tc reader / our S3 load"] = (">=", 1.2)
    raw = {k: {"s": v.t, "cpu_s": v.c} for k, v in S.items()}
    raw["promote"] = {"s": t_prom, "cpu_s": c_prom}
    return {"rows": rows, "ratios": ratios, "targets": targets, "raw": raw, "bytes": dsize}


def section_s3(ctx: Ctx) -> dict:
    """Promotion, raw uploads (boto3 tuned and default, awscrt), S3 loads, raw GETs (boto3,
    awscrt) and s3torchconnector's DCP writer/reader, per server (moto, SeaweedFS) and state size
    (``--s3-gib``), repeats interleaved; wall time and CPU seconds per GiB of each."""
    sizes = [64 * MiB] if ctx.quick else [int(float(g) * GiB) for g in str(ctx.args.s3_gib).split(",")]
    reps = 2 if ctx.quick else 3
    rows: list[dict] = []
    ratios: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    notes = [
        f"[s3] part_size {S3_PART // MiB} MiB, concurrency {S3_CONC} (every client: {S3_CONC} connections); "
        f"{reps} interleaved repeats per size; medians",
        "raw upload = boto3 create_multipart_upload/upload_part on a ThreadPoolExecutor (pread per part, no "
        "checksum) of our local data file, with the tier's client config (make_client) and with boto3's defaults; "
        "raw awscrt = awscrt.s3.S3Client PUT_OBJECT with send_filepath + direct_io + CRC32C, GET_OBJECT split by "
        "the CRT; raw download = ranged GETs of 16 MiB into preallocated bytearrays",
        "promotion = writer.history[-1].promote_s (upload of the data file incl. CRC32C per part + conditional "
        "PutObject of metadata.json + S3 retention keep=2); promotion CPU = CPU of the threads tierckpt-replicate*/"
        "tierckpt-s3*; every other CPU figure = whole-process CPU (getrusage) over the timed call; servers run in "
        "other processes and are not counted",
    ]
    why_tc = s3tc_probe()
    if why_tc:
        notes.append(why_tc)
    else:
        notes.append(
            "s3torchconnector 1.5.0 (pip; + tenacity it needs but does not declare here): S3FileSystem passes no "
            "endpoint to its S3Client, so the bench replaces writer.fs._client/reader.fs._client with "
            "S3Client(endpoint=..., S3ClientConfig(force_path_style=True, part_size=16MiB)) (private attribute); "
            "writer thread_count=4; not added to pyproject"
        )
    raw_res: dict[str, Any] = {}
    series: list[dict[str, Any]] = []  # per server and size: GiB/s of every client (tools/plot_bench.py)
    kinds = [k.strip() for k in str(getattr(ctx.args, "s3_servers", "moto,seaweedfs")).split(",") if k.strip()]
    for kind in kinds:
        if kind not in ("moto", "seaweedfs"):
            raise ValueError(f"--s3-servers: unknown server {kind!r} (known: moto, seaweedfs)")
        tmp = ctx.work / f"s3-{kind}"
        tmp.mkdir()
        try:
            url, stop, snote = start_s3_server(kind, tmp)
        except Exception as e:  # noqa: BLE001
            notes.append(f"{kind}: skipped, cannot start: {e}"[:400])
            rm(tmp)
            continue
        notes.append(f"{kind}: {snote}")
        log(f"s3: {kind} at {url}")
        try:
            for size in sizes:
                out = _one_size(kind, url, tmp, size, reps, why_tc, notes)
                rows += out["rows"]
                ratios.update(out["ratios"])
                targets.update(out["targets"])
                raw_res[f"{kind} {size}"] = out["raw"]
                series.append(
                    {
                        "server": kind,
                        "bytes": out["bytes"],
                        "gib_s": {r["name"].split(": ", 1)[1]: r["gib_s"] for r in out["rows"] if r.get("gib_s")},
                    }
                )
        finally:
            stop()
            rm(tmp)
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes, "raw": raw_res, "series": series}
