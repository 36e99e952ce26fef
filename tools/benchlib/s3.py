"""Section ``s3`` (only with ``--only``): promotion and S3 loads vs raw boto3."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
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
from tierckpt import HostConfig, LocalConfig, TierConfig, TieredReader, TieredWriter
from tierckpt.testing import free_port

# ---------------------------------------------------------------------------------------------
# E. S3 tier: promotion and S3 loads vs raw boto3 (moto in a subprocess, SeaweedFS)
# ---------------------------------------------------------------------------------------------

S3_PART = 16 * MiB
S3_CONC = 4
S3_BUCKET = "tierckpt-bench"

_MOTO_CHILD = (
    "import sys, logging\n"
    "from moto.server import ThreadedMotoServer\n"
    "logging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
    "s = ThreadedMotoServer(ip_address='127.0.0.1', port=int(sys.argv[1]), verbose=False)\n"
    "s.start()\n"
    "sys.stdin.read()\n"
)


S3_DATA: Path | None = None
"""Where SeaweedFS keeps its data (``--s3-data``); None: under the section's temp dir, on the disk
the local tier uses."""


def start_s3_server(kind: str, tmp: Path) -> tuple[str, Callable[[], None], str]:
    """(endpoint, stop, note). moto runs in a child process (its own GIL), SeaweedFS as ``weed mini``
    with its data under ``tmp`` (or a temp dir under :data:`S3_DATA`, removed by ``stop``)."""
    import shutil
    import tempfile

    from tools.s3servers import ensure_dummy_credentials, make_bucket, start_seaweedfs

    ensure_dummy_credentials()
    if kind == "seaweedfs":
        data = Path(tempfile.mkdtemp(prefix="bench-weed-", dir=S3_DATA)) if S3_DATA is not None else tmp
        url, stop_weed = start_seaweedfs(data)
        where = f"data in {S3_DATA}" if S3_DATA is not None else "data on the local tier's disk"
        note = f"SeaweedFS weed mini (separate process, {where}), ready after {start_seaweedfs.last_startup_s:.1f} s"

        def stop() -> None:
            stop_weed()
            if S3_DATA is not None:
                shutil.rmtree(data, ignore_errors=True)
    else:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-c", _MOTO_CHILD, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto child exited with {proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError as e:
                if time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError("moto child did not open its port") from e
                time.sleep(0.1)

        def stop() -> None:
            with contextlib.suppress(Exception):
                proc.stdin.close()  # type: ignore[union-attr]
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

        note = f"moto ThreadedMotoServer in a child process (pid {proc.pid}; own GIL, in-memory store)"
    make_bucket(url, S3_BUCKET)
    return url, stop, note


def s3_tier_cfg(local: Path | None, url: str, prefix: str, pool: int, keep_s3: int = 0) -> TierConfig:
    from tierckpt.config import S3Config

    s3 = S3Config(
        bucket=S3_BUCKET, prefix=prefix, endpoint_url=url, part_size=S3_PART, concurrency=S3_CONC, keep=keep_s3
    )
    lc = LocalConfig(path=str(local), flush_threads=4, keep=1) if local is not None else None
    return TierConfig(host=HostConfig(buffer_size=pool, chunk_size=16 * MiB), local=lc, s3=s3)


def raw_upload(client: Any, key: str, path: Path, part: int, conc: int) -> float:
    """boto3 ``create_multipart_upload``/``upload_part`` (pread per part, no checksum) on a pool."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = now()
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        uid = client.create_multipart_upload(Bucket=S3_BUCKET, Key=key)["UploadId"]
        n = -(-size // part)

        def one(pn: int) -> dict:
            off = (pn - 1) * part
            data = os.pread(fd, min(part, size - off), off)
            r = client.upload_part(Bucket=S3_BUCKET, Key=key, UploadId=uid, PartNumber=pn, Body=data)
            return {"PartNumber": pn, "ETag": r["ETag"]}

        with ThreadPoolExecutor(conc) as ex:
            parts = list(ex.map(one, range(1, n + 1)))
        client.complete_multipart_upload(Bucket=S3_BUCKET, Key=key, UploadId=uid, MultipartUpload={"Parts": parts})
    finally:
        os.close(fd)
    return now() - t0


def default_client(url: str) -> Any:
    """A boto3 client as a user writes it: defaults, path-style addressing, a pool for the threads."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=url, config=Config(s3={"addressing_style": "path"}, max_pool_connections=S3_CONC + 4)
    )


def _have_crt() -> bool:
    """Whether awscrt (a baseline only: ``pip install awscrt``) is installed."""
    try:
        import awscrt.s3  # noqa: F401

        return True
    except ImportError:
        log("s3: awscrt not installed: its baseline rows are left out (pip install awscrt)")
        return False


class Crt:
    """awscrt's S3 client (the C data plane boto3's CRT transfer manager and s3torchconnector
    wrap): multipart PUT from a file (``send_filepath``, its own ``direct_io`` reads, CRC32C per
    part) and GETs split into ``S3_PART`` ranges, ``S3_CONC`` connections, credentials from boto3's
    chain. Loopback http endpoints only (``tls_mode`` disabled)."""

    def __init__(self, url: str) -> None:
        import boto3
        from awscrt import auth, io, s3

        self.s3 = s3
        self.host = url.split("://", 1)[1].rstrip("/")
        el = io.EventLoopGroup(S3_CONC)
        bootstrap = io.ClientBootstrap(el, io.DefaultHostResolver(el))
        creds = boto3.session.Session().get_credentials().get_frozen_credentials()
        prov = auth.AwsCredentialsProvider.new_static(creds.access_key, creds.secret_key, creds.token)
        self.client = s3.S3Client(
            bootstrap=bootstrap,
            region="us-east-1",
            tls_mode=s3.S3RequestTlsMode.DISABLED,
            credential_provider=prov,
            part_size=S3_PART,
            max_active_connections_override=S3_CONC,
        )

    def upload(self, key: str, path: Path) -> float:
        from awscrt import http

        s3 = self.s3
        size = path.stat().st_size
        req = http.HttpRequest(
            "PUT",
            f"/{S3_BUCKET}/{key}",
            http.HttpHeaders(
                [("Host", self.host), ("Content-Length", str(size)), ("Content-Type", "application/octet-stream")]
            ),
        )
        t0 = now()
        r = self.client.make_request(
            type=s3.S3RequestType.PUT_OBJECT,
            request=req,
            send_filepath=str(path),
            checksum_config=s3.S3ChecksumConfig(
                algorithm=s3.S3ChecksumAlgorithm.CRC32C, location=s3.S3ChecksumLocation.HEADER
            ),
            fio_options=s3.S3FileIoOptions(should_stream=False, direct_io=True),
        )
        r.finished_future.result()
        return now() - t0

    def download(self, objs: list[tuple[str, int]], bufs: list[bytearray]) -> float:
        from awscrt import http

        s3 = self.s3
        t0 = now()
        reqs = []
        for (key, _size), buf in zip(objs, bufs):
            mv = memoryview(buf)

            def on_body(chunk: Any, offset: int, mv: memoryview = mv, **_: Any) -> None:
                mv[offset : offset + len(chunk)] = chunk

            req = http.HttpRequest("GET", f"/{S3_BUCKET}/{key}", http.HttpHeaders([("Host", self.host)]))
            reqs.append(self.client.make_request(type=s3.S3RequestType.GET_OBJECT, request=req, on_body=on_body))
        for r in reqs:
            r.finished_future.result()
        return now() - t0


def raw_download(client: Any, objs: list[tuple[str, int]], bufs: list[bytearray], part: int, conc: int) -> float:
    """Parallel ranged GETs (``part`` bytes each, ``conc`` in flight) into preallocated buffers."""
    from concurrent.futures import ThreadPoolExecutor

    tasks = [(i, off, min(part, size - off)) for i, (_, size) in enumerate(objs) for off in range(0, size, part)]

    def one(t: tuple[int, int, int]) -> None:
        i, off, n = t
        resp = client.get_object(Bucket=S3_BUCKET, Key=objs[i][0], Range=f"bytes={off}-{off + n - 1}")
        body = resp["Body"]
        mv = memoryview(bufs[i])[off : off + n]
        got = 0
        while got < n:
            k = body.readinto(mv[got:])
            if not k:
                raise RuntimeError("short read")
            got += k
        body.close()

    t0 = now()
    with ThreadPoolExecutor(conc) as ex:
        list(ex.map(one, tasks))
    return now() - t0


def list_objects(client: Any, prefix: str) -> list[tuple[str, int]]:
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET, Prefix=prefix):
        out += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
    return out


def s3tc_client(url: str) -> Any:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    return S3Client(
        region="us-east-1", endpoint=url, s3client_config=S3ClientConfig(force_path_style=True, part_size=S3_PART)
    )


def s3tc_probe() -> str | None:
    """None if s3torchconnector's DCP classes import; else why not."""
    try:
        from s3torchconnector import S3ClientConfig  # noqa: F401
        from s3torchconnector._s3client import S3Client  # noqa: F401
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"s3torchconnector not usable: {type(e).__name__}: {e}"
    return None


_PROMOTE_THREADS = ("tierckpt-replicate", "tierckpt-s3", "tierckpt-copy")


def _threads_cpu(before: dict[int, float], after: dict[int, float], prefixes: tuple[str, ...]) -> float:
    """CPU seconds spent between two :func:`thread_cpu` snapshots by live threads named ``prefixes*``."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    return sum(c - before.get(tid, 0.0) for tid, c in after.items() if names.get(tid, "").startswith(prefixes))


def _delete_prefix(client: Any, prefix: str) -> None:
    keys = [k for k, _ in list_objects(client, prefix)]
    for i in range(0, len(keys), 1000):
        client.delete_objects(
            Bucket=S3_BUCKET, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
        )


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
    crt = Crt(url) if _have_crt() else None
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
            c_prom.append(_threads_cpu(before, thread_cpu(), _PROMOTE_THREADS))
            t_prom.append(writer.history[-1].promote_s)
            files = [p for p in local.rglob("*") if p.is_file() and cid in str(p) and p.stat().st_size > MiB]
            assert len(files) == 1, files
            # (b) raw uploads of the same data file: tier's client config, boto3 defaults, awscrt
            S["up"].timed(lambda: raw_upload(client, f"raw/{kind}-{r}-t", files[0], S3_PART, S3_CONC))
            S["up_def"].timed(lambda: raw_upload(dclient, f"raw/{kind}-{r}-d", files[0], S3_PART, S3_CONC))
            if crt is not None:
                S["up_crt"].timed(lambda: crt.upload(f"raw/{kind}-{r}-c", files[0]))
            _delete_prefix(client, "raw/")
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
                _delete_prefix(client, f"tc-{kind}/")
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
