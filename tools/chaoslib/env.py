"""The chaos session (:class:`Env`: work directory, S3 server, configurations) and the zygote
that forks trainers and other children with torch already imported."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import s3servers

from chaoslib.core import BUCKET

TOOLS = Path(__file__).resolve().parent.parent  # tools/ (was HERE in chaos.py)
ROOT = TOOLS.parent

# zygote child kinds (``_child_main`` dispatches to them); chaos.py and the case modules add theirs
CHILDREN: dict[str, Callable[[dict], int]] = {}


class Env:
    """Shared resources of a chaos session: a work directory, an S3 server (moto or SeaweedFS, or
    ``endpoint`` of a running one), the zygote that forks trainers. Use as a context manager."""

    def __init__(
        self, s3: str = "moto", work: str | Path | None = None, endpoint: str | None = None, keep: bool = False
    ) -> None:
        self.s3 = s3
        self.keep = keep
        self._own_work = work is None
        self.work = Path(work) if work is not None else Path(tempfile.mkdtemp(prefix="tierckpt-chaos-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.endpoint: str | None = endpoint
        self._stop: Callable[[], None] | None = None
        self._zygote: Zygote | None = None
        self._n = 0
        self._logfile = self.work / "tierckpt.log"
        self._quiet_logs()
        try:
            if s3 != "none" and endpoint is None:
                s3servers.ensure_dummy_credentials()
                if s3 == "moto":
                    self.endpoint, self._stop = s3servers.start_moto()
                elif s3 == "seaweedfs":
                    self.endpoint, self._stop = s3servers.start_seaweedfs(self.work / "seaweedfs")
                else:
                    raise ValueError(f"--s3 must be moto, seaweedfs or none, got {s3!r}")
            if self.endpoint:
                s3servers.ensure_dummy_credentials()
                s3servers.make_bucket(self.endpoint, BUCKET)
        except BaseException:
            self.close()
            raise

    def _quiet_logs(self) -> None:
        """tierckpt's ERROR lines (expected in chaos) go to a file, DCP's tracebacks nowhere."""
        h = logging.FileHandler(self._logfile)
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        self._log_handler = h
        self._saved_loggers: list[tuple[logging.Logger, list, bool, int]] = []
        for name in (
            "tierckpt",
            "chaos",
            "torch.distributed.checkpoint",
            "torch.distributed",
            "botocore",
            "urllib3",
            "werkzeug",
            "",
        ):
            lg = logging.getLogger(name)
            self._saved_loggers.append((lg, list(lg.handlers), lg.propagate, lg.level))
        for name in ("tierckpt", "chaos"):
            lg = logging.getLogger(name)
            lg.handlers = [h]
            lg.propagate = False
            lg.setLevel(logging.INFO)
        for name in ("torch.distributed.checkpoint", "torch.distributed", "botocore", "urllib3", "werkzeug"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        root = logging.getLogger()
        if not root.handlers:  # DCP logs its load failures (with tracebacks) on the root logger
            root.addHandler(h)

    def _restore_logs(self) -> None:
        for lg, handlers, propagate, level in self._saved_loggers:
            lg.handlers, lg.propagate = handlers, propagate
            lg.setLevel(level)
        self._log_handler.close()

    @property
    def has_s3(self) -> bool:
        return bool(self.endpoint)

    def fresh(self, name: str) -> Path:
        self._n += 1
        d = self.work / f"{name}-{self._n:04d}"
        d.mkdir(parents=True)
        return d

    def config(
        self,
        d: Path,
        *,
        s3: bool | None = None,
        prefix: str = "",
        local: bool = True,
        local_keep: int = 2,
        s3_keep: int = 2,
        buffer: str = "2MiB",
        chunk: str = "256KiB",
        flush_threads: int = 2,
        fsync: bool = True,
        endpoint: str | None = None,
        commit_timeout: float = 30.0,
        **s3_over: Any,
    ) -> dict:
        """A tier configuration as a dict (TOML-shaped). ``s3=None``: S3 when the session has it."""
        use_s3 = self.has_s3 if s3 is None else (s3 and self.has_s3)
        c: dict[str, dict] = {
            "job": {"commit_timeout": commit_timeout},
            "host": {"buffer_size": buffer, "chunk_size": chunk},
        }
        if local:
            c["local"] = {"path": str(d / "local"), "keep": local_keep, "flush_threads": flush_threads, "fsync": fsync}
        if use_s3:
            c["s3"] = {
                "bucket": BUCKET,
                "prefix": prefix or f"chaos/{d.name}",
                "endpoint_url": endpoint or self.endpoint,
                "part_size": "5MiB",
                "concurrency": 4,
                "keep": s3_keep,
                "max_attempts": 4,
                "connect_timeout": 2.0,
                "read_timeout": 10.0,
            } | s3_over
        return c

    def client(self) -> Any:
        assert self.endpoint
        return s3servers.s3_client(self.endpoint)

    def drop_prefix(self, prefix: str) -> None:
        """Delete every object (and multipart upload) under ``prefix/`` (keeps moto's memory small)."""
        if not self.endpoint:
            return
        c = self.client()
        with contextlib.suppress(Exception):
            for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
                if keys:
                    c.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})
            for u in c.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix + "/").get("Uploads", []) or []:
                c.abort_multipart_upload(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"])

    def cleanup(self, d: Path, cfg: dict | None = None) -> None:
        if cfg is not None and "s3" in cfg:
            self.drop_prefix(cfg["s3"]["prefix"])
        if not self.keep:
            shutil.rmtree(d, ignore_errors=True)

    # -- forked children ------------------------------------------------------------------
    def spawn(self, kind: str, payload: dict, out: Path) -> Child:
        """Fork a child from the preloaded zygote (torch & co. imported once) running ``kind``."""
        if self._zygote is None:
            self._zygote = Zygote()
        return self._zygote.spawn(kind, payload, out)

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        if self._stop is not None:
            self._stop()
            self._stop = None
        self._restore_logs()
        if self._own_work and not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> Env:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# imported by the zygote before it forks (torch._dynamo & co. are imported lazily by the first
# optimizer / transformer call: seconds per child otherwise)
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch._functorch.deprecated",
    "torch._decomp.decompositions_for_rng",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "numpy.random",
    "numpy.fft",
    "statistics",
    "boto3",
    "botocore",
    "psutil",
    "tierckpt",
    "tierckpt.chain.replicate",
    "tierckpt.tiers.local",
    "tierckpt.tiers.s3",
    "train_gpt",
    "chaos_tiers",
)


class Zygote:
    """A helper process that imports torch, tierckpt and the trainer once, then forks children on
    request (a fresh trainer costs milliseconds instead of seconds of imports). It never starts a
    thread, so forking it is safe. Protocol: JSON lines on its stdin/stdout."""

    def __init__(self) -> None:
        import subprocess

        code = f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(TOOLS)!r}]; import chaos; chaos._zygote_main()"
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=str(ROOT),
            text=True,
            bufsize=1,
        )
        if self._ask({"op": "ping"}).get("pong") is not True:
            raise RuntimeError("chaos zygote did not start")
        self.children: list[Child] = []

    def _ask(self, msg: dict) -> dict:
        with self._lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"chaos zygote died (exit {self.proc.poll()})")
        return json.loads(line)

    def spawn(self, kind: str, payload: dict, out: Path) -> Child:
        r = self._ask({"op": "spawn", "kind": kind, "payload": payload, "out": str(out)})
        c = Child(self, int(r["pid"]))
        self.children.append(c)
        return c

    def close(self) -> None:
        for c in self.children:
            if c.exitcode is None:
                c.kill()
                c.join(10)
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait(timeout=10)


class Child:
    """A forked child (the subset of ``multiprocessing.Process`` the cases use)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        if self.exitcode is None:
            r = self.zygote._ask({"op": "poll", "pid": self.pid})
            self.exitcode = r.get("exitcode")
        return self.exitcode is None

    def kill(self) -> None:
        if self.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)


def _zygote_main() -> None:
    """The zygote's loop (see :class:`Zygote`)."""
    import importlib

    for m in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(m)
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "ping":
            reply: dict = {"pong": True}
        elif op == "spawn":
            pid = os.fork()
            if pid == 0:
                try:
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, 0)
                    _child_main(msg["kind"], msg["payload"], msg["out"])
                finally:
                    os._exit(1)
            reply = {"pid": pid}
        elif op == "poll":
            try:
                done, status = os.waitpid(msg["pid"], os.WNOHANG)
            except ChildProcessError:
                reply = {"exitcode": -999}
            else:
                reply = {"exitcode": os.waitstatus_to_exitcode(status) if done else None}
        else:
            reply = {"error": f"unknown op {op!r}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def _child_main(kind: str, payload: dict, out: str) -> None:
    """Entry point of forked children: output to ``out``; atexit handlers run as in a real exit."""
    import atexit

    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = sys.stdout
    random.seed()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    rc = 1
    try:
        if kind == "trainer":
            import train_gpt

            rc = int(train_gpt.main(payload["argv"]) or 0)
        elif kind in CHILDREN:  # "resources", "concurrent-save" and the kinds of other modules
            rc = int(CHILDREN[kind](payload) or 0)
        else:
            raise ValueError(kind)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        rc = 1
    try:
        atexit._run_exitfuncs()
    finally:
        os._exit(rc)


def wait_proc(p: Child, timeout: float) -> int | None:
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(10)
        return None
    return p.exitcode


def tail(path: Path, n: int = 800) -> str:
    try:
        return path.read_text(errors="replace")[-n:].replace("\n", " | ")
    except OSError:
        return "(no output)"
