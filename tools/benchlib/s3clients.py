"""S3 servers and clients for the benchmarks: SeaweedFS or moto on loopback, raw boto3 / AWS CRT /
s3torchconnector transfers (the baselines tierckpt is measured against), and the S3 tier config."""

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

from benchlib.common import (
    MiB,
    log,
    now,
)
from tierckpt import HostConfig, LocalConfig, TierConfig
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


def have_crt() -> bool:
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


PROMOTE_THREADS = ("tierckpt-replicate", "tierckpt-s3", "tierckpt-copy")


def threads_cpu(before: dict[int, float], after: dict[int, float], prefixes: tuple[str, ...]) -> float:
    """CPU seconds spent between two :func:`thread_cpu` snapshots by live threads named ``prefixes*``."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    return sum(c - before.get(tid, 0.0) for tid, c in after.items() if names.get(tid, "").startswith(prefixes))


def delete_prefix(client: Any, prefix: str) -> None:
    keys = [k for k, _ in list_objects(client, prefix)]
    for i in range(0, len(keys), 1000):
        client.delete_objects(
            Bucket=S3_BUCKET, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
        )
