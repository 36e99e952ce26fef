"""Chaos harness for tierckpt: kills, faults, corruption, races, leaks and a flaky S3, over many trials.

    python tools/chaos.py --trials N [--cases crash,faults,corrupt,concurrency,resources,s3faults,
                                              filetimes,backlog,gcload,killloop]
                          [--s3 moto|seaweedfs|none] [--json out.json] [--seed S] [--keep]

Prints one row per case (case | trials | failures | lost | seconds | notes) and exits non-zero on
any failure. ``lost`` counts committed checkpoints that could not be loaded bit-exact and loads
that returned wrong bytes without an error; it must be 0. ``failures`` counts every broken
invariant (``lost`` ones included). Every case is a function ``case_<name>(env, trials, seed)``
returning a :class:`CaseResult`, usable from tests (``tests/test_chaos.py``).

Cases:

crash
    A small GPT-style trainer (``tools/train_gpt.py``, a checkpoint every 2 steps through host
    pool -> local tier -> S3) dies by SIGKILL, either at a random time (after a random step plus a
    random delay) or at a named point inside the tiers (``tools/chaos_tiers.py``: the k-th chunk
    write, data-file close, local or S3 metadata put, S3 upload, retention delete, or right after
    ``dcp.save`` returned with the capture pending). Afterwards: every committed checkpoint on each
    tier loads bit-exact and equals the reference digest of its step (from an uninterrupted run
    with DCP's own writer); ``latest`` loads and is the newest of them; every uncommitted checkpoint
    is refused (CheckpointNotFound); a ``--resume`` run (sometimes after deleting the local tier: a
    lost node) restarts from the right state and ends bit-identical to the reference run.
faults
    ENOSPC / EROFS injected into a local write, open, close or metadata put during a save:
    ``writer.wait()`` raises a TierckptError naming the checkpoint and the cause; the previous
    checkpoints still load bit-exact; the failed one is refused; the next save (same or new id)
    commits and loads bit-exact.
corrupt
    One random byte of one random data or metadata file, on either tier, is flipped: the load
    fails with a tierckpt error, or succeeds bit-exact (from the other tier's intact copy); a
    load that returns other bytes is ``lost``. With both tiers holding an intact copy of
    everything the load must succeed.
concurrency
    Two writers save the same checkpoint id at the same moment (two threads on one engine, two
    engines sharing a local path and/or an S3 prefix, two processes): exactly one commits per
    tier, the other fails with a tierckpt error, and the committed copy is exactly one writer's
    state (the one that reported success), never a mix.
resources
    30 checkpoints in a row through a small host pool (in a fresh process): RSS, threads and open
    file descriptors stay flat after warm-up.
s3faults
    Promotions through a proxy failing 10% of S3 requests (5% 500/503 answers, 5% dropped
    connections): each promotion completes or fails with a tierckpt error; every checkpoint
    committed on S3 loads bit-exact from S3 alone; every reported success is committed on S3.
filetimes, backlog, gcload, killloop
    No committed checkpoint is ever lost: file-time changes, a restart with an unpromoted
    backlog, gc racing loads, and a trainer SIGKILLed and restarted from latest + 1 in a loop
    (``tools/chaos_loss.py``, registered below with :func:`register_cases`).

Trainer runs are forked from a preloaded zygote process (torch imported once), so a crash trial
costs about two short training runs plus a handful of loads.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import io
import json
import logging
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import chaos_tiers  # noqa: E402
import s3servers  # noqa: E402
from tierckpt import CheckpointNotFound, CommitConflict, TierckptError, TieredReader, TieredWriter  # noqa: E402
from tierckpt.catalog import list_checkpoints  # noqa: E402
from tierckpt.config import TierConfig, config_from_dict  # noqa: E402
from tierckpt.layout import split_key, step_of  # noqa: E402
from tierckpt.tiers import make_local, make_s3  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

CASES = ("crash", "faults", "corrupt", "concurrency", "resources", "s3faults")
MiB = 1 << 20
BUCKET = "tierckpt-chaos"

log = logging.getLogger("chaos")


# -- results ----------------------------------------------------------------------------------

@dataclass
class CaseResult:
    """What one case found. ``lost`` problems are counted in ``failures`` too."""

    case: str
    trials: int = 0
    failures: int = 0
    lost: int = 0
    seconds: float = 0.0
    notes: dict[str, int] = field(default_factory=dict)  # tallies shown in the table
    problems: list[str] = field(default_factory=list)  # one line per failure
    skipped: str = ""

    def note(self, what: str, n: int = 1) -> None:
        self.notes[what] = self.notes.get(what, 0) + n

    known: dict[str, int] = field(default_factory=dict)  # failures explained by a KNOWN_BUGS entry

    def fail(self, trial: Any, msg: str, known: str = "") -> None:
        self.failures += 1
        tag = ""
        if known:
            self.known[known] = self.known.get(known, 0) + 1
            tag = f" [known bug: {known}]"
        self.problems.append(f"[{self.case} {trial}] {msg}{tag}")

    def lose(self, trial: Any, msg: str, known: str = "") -> None:
        self.lost += 1
        self.fail(trial, "LOST: " + msg, known)

    @property
    def ok(self) -> bool:
        return self.failures == 0 and self.lost == 0

    @property
    def unexplained(self) -> int:
        """Failures not explained by a known bug (what a CI test asserts to be 0)."""
        return self.failures - sum(self.known.values())

    def notes_text(self, limit: int = 8) -> str:
        if self.skipped:
            return f"skipped: {self.skipped}"
        items = [(f"KNOWN BUG {k}", v) for k, v in self.known.items()] + sorted(self.notes.items(), key=lambda kv: -kv[1])
        text = ", ".join(f"{k} {v}" for k, v in items[:limit + len(self.known)])
        if len(items) > limit + len(self.known):
            text += f", +{len(items) - limit} more"
        return text

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"ok": self.ok}


def format_table(results: list[CaseResult]) -> str:
    rows = [("case", "trials", "failures", "lost", "seconds", "notes")]
    for r in results:
        rows.append((r.case, str(r.trials), str(r.failures), str(r.lost), f"{r.seconds:.1f}", r.notes_text()))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for j, row in enumerate(rows):
        lines.append(" | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row[:5], widths))) + " | " + row[5])
        if j == 0:
            lines.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * 20)
    return "\n".join(lines)


# Bugs found by this harness (library or trainer code this harness may not change). Failures they
# explain are still failures (the exit status says so); tests/test_chaos.py reproduces each one
# deterministically as a strict xfail and tolerates only these in its random trials.
KNOWN_BUGS: dict[str, str] = {}  # failures explained by an open library bug (none open now)


# -- error helpers ------------------------------------------------------------------------------

def errors_in(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes/contexts and the failures wrapped by DCP's CheckpointException."""
    seen: list[BaseException] = []
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if e is None or not isinstance(e, BaseException) or any(e is s for s in seen):
            continue
        seen.append(e)
        for v in (getattr(e, "failures", None) or {}).values():
            todo.append(v[0] if isinstance(v, tuple) else v)
        todo += [e.__cause__, e.__context__]
    return seen


def find_error(exc: BaseException, cls: type) -> BaseException | None:
    for e in errors_in(exc):
        if isinstance(e, cls):
            return e
    return None


# DCP 2.13 turns a failed read_metadata into an AssertionError carrying only the message text.
_TIERCKPT_TEXT = re.compile(r"is not committed on any tier|no committed checkpoint|CRC32C|no tier holds valid metadata|"
                            r"already committed|already exists|not valid tierckpt metadata|cannot read item")


def is_clear(exc: BaseException) -> bool:
    """A tierckpt error (possibly wrapped by DCP, possibly only as text) rather than a random crash."""
    if find_error(exc, TierckptError) is not None:
        return True
    return any(_TIERCKPT_TEXT.search(str(e)) for e in errors_in(exc))


def is_not_found(exc: BaseException) -> bool:
    if find_error(exc, CheckpointNotFound) is not None:
        return True
    return any("is not committed on any tier" in str(e) or "no committed checkpoint" in str(e) for e in errors_in(exc))


def short(exc: BaseException, n: int = 300) -> str:
    """The most telling error in ``exc``: a tierckpt error, else the first one DCP wrapped."""
    every = errors_in(exc)
    inner = [e for e in every if isinstance(e, TierckptError)] or [e for e in every if not hasattr(e, "failures")] or [exc]
    e = inner[0]
    return f"{type(e).__name__}: {e}".replace("\n", " | ")[:n]


# -- states -------------------------------------------------------------------------------------

def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def bits(n_bytes: int, dtype: torch.dtype, g: torch.Generator, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    t = torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=g).view(dtype)
    return t.reshape(shape) if shape else t


def make_state(seed: int, big: int = 1 * MiB) -> dict:
    """Random bits (NaN payloads, -0, subnormals) in several dtypes plus a non-tensor item."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "big": bits(big, torch.float32, g),
            "bf16": bits(2 * 129 * 17, torch.bfloat16, g, (129, 17)),
            "i64": bits(8 * 33, torch.int64, g),
            "scalar": torch.tensor(float(seed) + 0.5),
        },
        "meta": {"seed": seed, "name": f"state-{seed}"},
    }


def clone_state(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: clone_state(v) for k, v in x.items()}
    return x


def placeholder(x: Any) -> Any:
    """Same structure, tensors filled with 0x5A bytes (a load that skips a tensor is caught)."""
    if isinstance(x, torch.Tensor):
        t = torch.empty_like(x)
        raw(t).fill_(0x5A)
        return t
    if isinstance(x, dict):
        return {k: placeholder(v) for k, v in x.items()}
    return None


def diff(expected: Any, got: Any, prefix: str = "") -> list[str]:
    """Keys whose values differ (tensors: dtype, shape and raw bytes)."""
    bad: list[str] = []
    for k, v in expected.items():
        g = got.get(k) if isinstance(got, dict) else None
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            bad += diff(v, g if isinstance(g, dict) else {}, name + ".")
        elif isinstance(v, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.dtype != v.dtype or g.shape != v.shape or not torch.equal(raw(g), raw(v)):
                bad.append(name)
        elif v != g:
            bad.append(name)
    return bad


def mutate(state: dict, g: torch.Generator) -> None:
    """A 'training step': change every tensor in place."""
    for k, v in state["model"].items():
        r = raw(v)
        r.add_(torch.randint(1, 255, r.shape, dtype=torch.uint8, generator=g))
    state["meta"]["seed"] += 1000


def load_state(cfg: TierConfig, expected: dict, cid: str) -> tuple[dict, TieredReader]:
    target = placeholder(expected)
    reader = TieredReader(cfg)
    dcp.load(target, checkpoint_id=cid, storage_reader=reader, no_dist=True)
    return target, reader


# -- configurations -----------------------------------------------------------------------------

def toml_text(d: dict) -> str:
    out = []
    for sec, kv in d.items():
        out.append(f"[{sec}]")
        for k, v in kv.items():
            if isinstance(v, bool):
                out.append(f"{k} = {'true' if v else 'false'}")
            elif isinstance(v, (int, float)):
                out.append(f"{k} = {v}")
            else:
                out.append(f"{k} = {json.dumps(str(v))}")
        out.append("")
    return "\n".join(out)


def only(cfg: TierConfig, tier: str) -> TierConfig | None:
    """``cfg`` restricted to one tier (``local`` or ``s3``), or None if it has no such tier."""
    if tier == "local":
        return None if cfg.local is None else dataclasses.replace(cfg, s3=None)
    return None if cfg.s3 is None else dataclasses.replace(cfg, local=None)


class Env:
    """Shared resources of a chaos session: a work directory, an S3 server (moto or SeaweedFS, or
    ``endpoint`` of a running one), the zygote that forks trainers. Use as a context manager."""

    def __init__(self, s3: str = "moto", work: str | Path | None = None, endpoint: str | None = None, keep: bool = False) -> None:
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
        for name in ("tierckpt", "chaos", "torch.distributed.checkpoint", "torch.distributed", "botocore", "urllib3",
                     "werkzeug", ""):
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

    def config(self, d: Path, *, s3: bool | None = None, prefix: str = "", local: bool = True, local_keep: int = 2,
               s3_keep: int = 2, buffer: str = "2MiB", chunk: str = "256KiB", flush_threads: int = 2, fsync: bool = True,
               endpoint: str | None = None, commit_timeout: float = 30.0, **s3_over: Any) -> dict:
        """A tier configuration as a dict (TOML-shaped). ``s3=None``: S3 when the session has it."""
        use_s3 = self.has_s3 if s3 is None else (s3 and self.has_s3)
        c: dict[str, dict] = {"job": {"commit_timeout": commit_timeout}, "host": {"buffer_size": buffer, "chunk_size": chunk}}
        if local:
            c["local"] = {"path": str(d / "local"), "keep": local_keep, "flush_threads": flush_threads, "fsync": fsync}
        if use_s3:
            c["s3"] = {"bucket": BUCKET, "prefix": prefix or f"chaos/{d.name}", "endpoint_url": endpoint or self.endpoint,
                       "part_size": "5MiB", "concurrency": 4, "keep": s3_keep, "max_attempts": 4,
                       "connect_timeout": 2.0, "read_timeout": 10.0} | s3_over
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
    def spawn(self, kind: str, payload: dict, out: Path) -> "Child":
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

    def __enter__(self) -> "Env":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# imported by the zygote before it forks (torch._dynamo & co. are imported lazily by the first
# optimizer / transformer call: seconds per child otherwise)
PRELOAD = ("torch", "torch._dynamo", "torch._functorch.deprecated", "torch._decomp.decompositions_for_rng",
           "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict", "numpy.random", "numpy.fft",
           "statistics", "boto3", "botocore", "psutil", "tierckpt", "tierckpt.replicate", "tierckpt.tiers.local", "tierckpt.tiers.s3",
           "train_gpt", "chaos_tiers")


class Zygote:
    """A helper process that imports torch, tierckpt and the trainer once, then forks children on
    request (a fresh trainer costs milliseconds instead of seconds of imports). It never starts a
    thread, so forking it is safe. Protocol: JSON lines on its stdin/stdout."""

    def __init__(self) -> None:
        import subprocess

        code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(HERE)!r}]; "
                "import chaos; chaos._zygote_main()")
        self._lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=str(ROOT), text=True, bufsize=1)
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

    def spawn(self, kind: str, payload: dict, out: Path) -> "Child":
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
        elif kind == "resources":
            rc = _resources_child(payload)
        elif kind == "concurrent-save":
            rc = _concurrent_save_child(payload)
        elif kind in CHILDREN:
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


def wait_proc(p: "Child", timeout: float) -> int | None:
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


# == case: crash ===================================================================================

TRAIN = {"steps": 10, "ckpt_every": 2, "d_model": 64, "layers": 2, "batch": 4, "ctx": 32}

# operation -> the WHENs that make sense (see tools/chaos_tiers.py)
KILL_POINTS: dict[str, tuple[str, ...]] = {
    "save.return": ("after",),  # capture pending
    "local.open": ("before",),  # capture starting
    "local.write": ("before", "after"),  # flush
    "local.close": ("before", "after"),  # flush: fsync + rename
    "local.commit": ("before", "after"),  # local commit
    "local.delete": ("before", "after"),  # local retention: metadata first
    "local.delete_prefix": ("before", "mid", "after"),  # local retention: data
    "s3.upload": ("before", "mid", "after"),  # promotion
    "s3.commit": ("before", "after"),  # S3 commit
    "s3.delete": ("before", "after"),  # S3 retention
    "s3.delete_prefix": ("before", "mid", "after"),
}
STAGE_OF = {"save.return": "capture", "local.open": "capture", "local.write": "flush", "local.close": "flush",
            "local.commit": "commit", "local.delete": "retention", "local.delete_prefix": "retention",
            "s3.upload": "promotion", "s3.commit": "promotion", "s3.delete": "retention", "s3.delete_prefix": "retention"}


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a killed run's last line may be torn
    return out


def trainer_argv(cfg_path: Path, log_path: Path, seed: int, *extra: str) -> list[str]:
    t = TRAIN
    return ["--config", str(cfg_path), "--steps", str(t["steps"]), "--ckpt-every", str(t["ckpt_every"]),
            "--log", str(log_path), "--seed", str(seed), "--d-model", str(t["d_model"]), "--layers", str(t["layers"]),
            "--batch", str(t["batch"]), "--ctx", str(t["ctx"]), *extra]


class Reference:
    """Digests of an uninterrupted run (DCP's FileSystemWriter) and a census of tier calls."""

    def __init__(self, env: Env, seed: int) -> None:
        d = env.fresh("crash-reference")
        self.seed = seed
        cfgd = env.config(d, s3=True, local_keep=2, s3_keep=2)
        cfg_path = d / "tiers.toml"
        cfg_path.write_text(toml_text(cfgd))
        ref_log = d / "reference.jsonl"
        p = env.spawn("trainer", {"argv": trainer_argv(cfg_path, ref_log, seed, "--writer", "dcp", "--dcp-dir",
                                                       str(d / "dcp"), "--digests")}, d / "reference.out")
        rc = wait_proc(p, 600)
        if rc != 0:
            raise RuntimeError(f"reference run failed (exit {rc}): {tail(d / 'reference.out')}")
        ev = read_events(ref_log)
        self.digest = {e["step"]: e["digest"] for e in ev if e.get("event") == "save"}
        self.final = next(e["digest"] for e in ev if e.get("event") == "done")
        # census: the same run through the tiers, counting calls per operation (no kill)
        census = d / "census.json"
        run_log = d / "census.jsonl"
        p = env.spawn("trainer", {"argv": trainer_argv(cfg_path, run_log, seed, "--digests", "--chaos", f"count={census}")},
                      d / "census.out")
        rc = wait_proc(p, 600)
        if rc != 0:
            raise RuntimeError(f"census run failed (exit {rc}): {tail(d / 'census.out')}")
        self.counts: dict[str, int] = json.loads(census.read_text())
        ev = read_events(run_log)
        tiered = {e["step"]: e["digest"] for e in ev if e.get("event") == "save"}
        if tiered != self.digest:
            raise RuntimeError("the tiered run's digests differ from DCP's reference run: the trainer is not deterministic")
        env.cleanup(d, cfgd)


def reference(env: Env, seed: int) -> Reference:
    """One :class:`Reference` per trainer seed and session, shared by the cases (two trainer runs)."""
    refs = env.__dict__.setdefault("_references", {})
    if seed not in refs:
        refs[seed] = Reference(env, seed)
    return refs[seed]


def load_app(cfg: TierConfig, cid: str, seed: int) -> tuple[int, str, str | None]:
    """Load ``cid`` into a fresh, poisoned TinyGPT + AdamW; return (step, digest, resolved id)."""
    from train_gpt import AppState, TinyGPT, digest

    t = TRAIN
    torch.manual_seed(seed)
    model = TinyGPT(256, t["d_model"], t["layers"], 4, t["ctx"])
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    app = AppState(model, optim)
    app.state_dict()  # materializes the optimizer state
    with torch.no_grad():  # poison: a tensor the load skips cannot match the reference
        for p in model.parameters():
            p.fill_(7.0)
        for st in optim.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    v.fill_(7.0)
    app.step = -1
    reader = TieredReader(cfg)
    dcp.load({"app": app}, checkpoint_id=cid, storage_reader=reader, no_dist=True)
    return app.step, digest(model, optim), reader.resolved_id


def check_tiers(res: CaseResult, trial: Any, cfg: TierConfig, ref: Reference, stage: str) -> dict[str, set[str]]:
    """Every committed checkpoint on each tier loads bit-exact (= reference digest of its step);
    uncommitted ones are refused; ``latest`` is the newest committed one. Returns the committed
    ids per tier."""
    committed: dict[str, set[str]] = {}
    partial: dict[str, set[str]] = {}
    for name in ("local", "s3"):
        sub = only(cfg, name)
        if sub is None:
            continue
        tier = make_local(sub) if name == "local" else make_s3(sub)
        try:
            infos = list_checkpoints(tier)
        finally:
            tier.close()
        committed[name] = {c.checkpoint_id for c in infos if c.committed}
        partial[name] = {c.checkpoint_id for c in infos if not c.committed}
        for cid in sorted(committed[name]):
            step = step_of(cid)
            try:
                got_step, dig, _ = load_app(sub, cid, ref.seed)
            except BaseException as e:  # noqa: BLE001
                res.lose(trial, f"{stage}: committed {cid} on {name} does not load: {short(e)}")
                continue
            if got_step != step or dig != ref.digest.get(step):
                res.lose(trial, f"{stage}: committed {cid} on {name} loaded WRONG state (step {got_step}, digest "
                                f"{dig[:12]} vs reference {str(ref.digest.get(step))[:12]})")
        for cid in sorted(partial[name]):
            try:
                load_app(sub, cid, ref.seed)
            except BaseException as e:  # noqa: BLE001
                if not is_not_found(e):
                    res.fail(trial, f"{stage}: uncommitted {cid} on {name} refused, but not as CheckpointNotFound: {short(e)}")
                continue
            res.lose(trial, f"{stage}: uncommitted {cid} on {name} was LOADED")
    every = set().union(*committed.values()) if committed else set()
    try:
        step, dig, resolved = load_app(cfg, "latest", ref.seed)
    except BaseException as e:  # noqa: BLE001
        if every:
            res.lose(trial, f"{stage}: latest does not load although {sorted(every)} are committed: {short(e)}")
        elif not is_not_found(e):
            res.fail(trial, f"{stage}: latest with nothing committed: expected CheckpointNotFound, got {short(e)}")
        return committed
    if resolved not in every:
        res.lose(trial, f"{stage}: latest resolved to {resolved}, which is not committed anywhere ({sorted(every)})")
    elif dig != ref.digest.get(step) or step != step_of(resolved):
        res.lose(trial, f"{stage}: latest ({resolved}) loaded a WRONG state")
    newest = max(every, key=lambda c: step_of(c) or -1)
    if resolved != newest:
        res.fail(trial, f"{stage}: latest resolved to {resolved}, but {newest} is the newest committed checkpoint")
    return committed


def choose_kill(rng: random.Random, ref: Reference, has_s3: bool, point: str | None = None) -> tuple[str, int, str] | None:
    points = [p for p in KILL_POINTS if ref.counts.get(p, 0) > 0 and (has_s3 or not p.startswith("s3."))]
    if point is not None:
        points = [p for p in points if p == point]
    if not points:
        return None
    point = rng.choice(points)
    return point, rng.randint(1, ref.counts[point]), rng.choice(KILL_POINTS[point])


def case_crash(env: Env, trials: int, seed: int, *, node_loss_rate: float = 0.25, random_kill_rate: float = 0.35,
               plan: tuple[str, ...] = ()) -> CaseResult:
    """``plan``: kill points to take in turn (``"random"`` for a random-time kill, or a key of
    :data:`KILL_POINTS`); by default each trial draws a random-time kill (``random_kill_rate``) or a
    random point, its call number and its timing."""
    res = CaseResult("crash")
    t0 = time.perf_counter()
    train_seed = seed % 1000
    ref = reference(env, train_seed)
    steps = TRAIN["steps"]
    for i in range(trials):
        rng = random.Random(f"{seed}-crash-{i}")
        d = env.fresh("crash")
        cfgd = env.config(d, local_keep=2, s3_keep=2)
        cfg_path = d / "tiers.toml"
        cfg_path.write_text(toml_text(cfgd))
        cfg = config_from_dict(cfgd)
        run_log = d / "run1.jsonl"
        if plan:
            want = plan[i % len(plan)]
            kill = None if want == "random" else choose_kill(rng, ref, env.has_s3, want)
        else:
            kill = None if rng.random() < random_kill_rate else choose_kill(rng, ref, env.has_s3)
        extra: list[str] = []
        if kill is not None:
            point, k, when = kill
            extra = ["--chaos", f"kill={point}:{k}:{when},delay={rng.uniform(0.0, 0.05):.3f}"]
            what = f"{STAGE_OF[point]}:{point}:{when}"
        p = env.spawn("trainer", {"argv": trainer_argv(cfg_path, run_log, train_seed, *extra)}, d / "run1.out")
        if kill is None:
            kill_step, delay = rng.randint(1, steps - 1), rng.uniform(0.0, 0.6)
            what = "random-time"
            deadline = time.monotonic() + 300
            while p.is_alive() and time.monotonic() < deadline:
                if any(e.get("event") == "step" and e["step"] >= kill_step for e in read_events(run_log)):
                    time.sleep(delay)
                    p.kill()
                    break
                time.sleep(0.02)
        rc = wait_proc(p, 300)
        trial = f"#{i} {what}"
        if rc is None:
            res.fail(trial, f"trainer hung (killed after 300 s): {tail(d / 'run1.out')}")
        elif rc == 0:
            res.note("ran to the end (no kill)")
        elif rc not in (137, -9):
            res.fail(trial, f"trainer failed by itself (exit {rc}): {tail(d / 'run1.out')}")
        else:
            res.note(f"killed {what.split(':')[0]}")
        check_tiers(res, trial, cfg, ref, "after the kill")
        lost_node = env.has_s3 and rng.random() < node_loss_rate
        if lost_node:
            shutil.rmtree(d / "local", ignore_errors=True)
            res.note("node lost before resume")
        # resume: a new process continues from latest and must end bit-identical to the reference
        log2 = d / "run2.jsonl"
        p = env.spawn("trainer", {"argv": trainer_argv(cfg_path, log2, train_seed, "--resume")}, d / "run2.out")
        rc2 = wait_proc(p, 300)
        ev = read_events(log2)
        if rc2 != 0:
            out2 = tail(d / "run2.out", 3000)
            known = "resume-without-checkpoint" if ("no committed checkpoint on any tier" in out2 and
                                                    not any(e.get("event") == "resumed" for e in ev)) else ""
            last_line = next((ln for ln in reversed(out2.split(" | ")) if ln.strip()), "")
            res.fail(trial, f"resumed run failed (exit {rc2}): {last_line[:300]}", known)
        else:
            resumed = next((e for e in ev if e.get("event") == "resumed"), None)
            done = next((e for e in ev if e.get("event") == "done"), None)
            if resumed is not None:
                s = resumed["step"]
                if resumed["digest"] != ref.digest.get(s) or step_of(resumed["checkpoint"]) != s:
                    res.lose(trial, f"resumed from {resumed['checkpoint']} (step {s}) with a WRONG state")
            if done is None or done["digest"] != ref.final:
                res.fail(trial, "the resumed run did not end bit-identical to the uninterrupted reference run")
        final = check_tiers(res, trial, cfg, ref, "after the resume")
        last = f"step-{steps:06d}"
        if rc2 == 0 and last not in set().union(*final.values()):
            res.fail(trial, f"after the resume {last} is not committed anywhere ({final})")
        if "s3" in final and last in final.get("local", set()) - final["s3"]:
            # committed locally (by the killed run or the resumed one): the backlog pass must promote it
            res.fail(trial, f"after the resume {last} is committed locally but never reached S3")
        res.trials += 1
        env.cleanup(d, cfgd)
    res.seconds = time.perf_counter() - t0
    return res


# == case: faults ==================================================================================

FAULT_OPS = ("local.write", "local.open", "local.close", "local.commit")


def save_wait(writer: TieredWriter, sd: dict, cid: str) -> BaseException | None:
    """``dcp.save`` + ``writer.wait()``; the error, if any."""
    try:
        dcp.save(sd, checkpoint_id=cid, storage_writer=writer, no_dist=True)
        writer.wait()
    except BaseException as e:  # noqa: BLE001
        return e
    return None


def expect_loads(res: CaseResult, trial: Any, cfg: TierConfig, expected: dict, cid: str, what: str) -> bool:
    try:
        got, reader = load_state(cfg, expected, cid)
    except BaseException as e:  # noqa: BLE001
        res.lose(trial, f"{what}: {cid} does not load: {short(e)}")
        return False
    bad = diff(expected, got)
    if bad:
        res.lose(trial, f"{what}: {cid} loaded WRONG bytes in {bad[:4]}")
        return False
    return True


def expect_refused(res: CaseResult, trial: Any, cfg: TierConfig, like: dict, cid: str, what: str) -> None:
    try:
        load_state(cfg, like, cid)
    except BaseException as e:  # noqa: BLE001
        if not is_not_found(e):
            res.fail(trial, f"{what}: {cid} refused, but not as CheckpointNotFound: {short(e)}")
        return
    res.lose(trial, f"{what}: uncommitted {cid} was LOADED")


def leftovers(root: Path) -> tuple[int, int]:
    """(data files inside committed checkpoints that their metadata does not name, files of
    uncommitted checkpoints) on a local tier root."""
    by_id: dict[str, list[str]] = {}
    for p in root.rglob("*"):
        if p.is_file():
            sk = split_key(p.relative_to(root).as_posix())
            if sk is not None:
                by_id.setdefault(sk[0], []).append(sk[1])
    orphans = partial = 0
    for cid, names in by_id.items():
        if "metadata.json" not in names:
            partial += len(names)
            continue
        body = (root / cid / "metadata.json").read_bytes().partition(b"\n")[2]
        named = set(json.loads(body)["files"])
        orphans += sum(1 for n in names if n != "metadata.json" and n not in named)
    return orphans, partial


def close_writer(writer: TieredWriter | None) -> None:
    if writer is None:
        return
    with contextlib.suppress(BaseException):
        writer.engine.close()
    s3 = writer.engine.s3
    if s3 is not None:
        with contextlib.suppress(BaseException):
            (s3.real if isinstance(s3, chaos_tiers.TierProxy) else s3).close()


def case_faults(env: Env, trials: int, seed: int) -> CaseResult:
    res = CaseResult("faults")
    t0 = time.perf_counter()
    for i in range(trials):
        rng = random.Random(f"{seed}-faults-{i}")
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        d = env.fresh("faults")
        cfgd = env.config(d, s3=rng.random() < 0.5, local_keep=0, s3_keep=0, fsync=False)
        cfg = config_from_dict(cfgd)
        op = rng.choice(FAULT_OPS)
        err = rng.choice((errno.ENOSPC, errno.EROFS))
        trial = f"#{i} {op} {errno.errorcode[err]}"
        writer = None
        try:
            writer = TieredWriter(cfg)
            ctl = chaos_tiers.FaultController()
            chaos_tiers.wrap_engine(writer.engine, ctl)
            sd = make_state(rng.randrange(1 << 20))
            good: dict[str, dict] = {}
            for n in range(1, rng.randint(1, 2) + 1):
                cid = f"step-{n:06d}"
                e = save_wait(writer, sd, cid)
                if e is not None:
                    res.fail(trial, f"save {cid} before the fault failed: {short(e)}")
                good[cid] = clone_state(sd)
                writer.wait_captured()
                mutate(sd, g)
            n += 1
            bad_id = f"step-{n:06d}"
            nchunks = -(-sum(raw(v).numel() for v in sd["model"].values()) // (256 << 10))
            k = rng.randint(1, max(1, nchunks)) if op == "local.write" else 1
            ctl.arm(op, k, err)
            e = save_wait(writer, sd, bad_id)
            ctl.disarm()
            if e is None:
                res.fail(trial, f"save {bad_id} with {errno.errorcode[err]} in {op} succeeded (fired: {ctl.fired})")
            else:
                msg = str(e)
                if not isinstance(e, TierckptError):
                    res.fail(trial, f"wait() raised {type(e).__name__}, not a TierckptError: {msg[:200]}")
                elif bad_id not in msg:
                    res.fail(trial, f"the error does not name the checkpoint {bad_id}: {msg[:200]}")
                elif os.strerror(err) not in msg and errno.errorcode[err] not in msg and "disk full" not in msg:
                    res.fail(trial, f"the error does not name the cause ({os.strerror(err)}): {msg[:200]}")
                else:
                    res.note(f"{op} failed clearly")
            with contextlib.suppress(BaseException):
                writer.wait()  # nothing left to raise
            for cid, st in good.items():
                expect_loads(res, trial, cfg, st, cid, "after the fault")
            if e is not None:
                expect_refused(res, trial, cfg, sd, bad_id, "after the fault")
                if cfg.s3 is not None:
                    expect_refused(res, trial, only(cfg, "s3"), sd, bad_id, "after the fault (S3)")
            # training goes on: the next save commits (a retry of the same id, or the next one)
            writer.wait_captured()
            mutate(sd, g)
            next_id = bad_id if (e is not None and rng.random() < 0.5) else f"step-{n + 1:06d}"
            e2 = save_wait(writer, sd, next_id)
            if e2 is not None:
                res.fail(trial, f"the save after the fault ({next_id}) failed: {short(e2)}")
            else:
                expect_loads(res, trial, cfg, sd, next_id, "after the fault")
                expect_loads(res, trial, cfg, sd, "latest", "after the fault (latest)")
                orphans, partial = leftovers(cfg.local.resolved_path())
                if orphans:
                    res.note("unreferenced data file left in a committed checkpoint (retried id)")
                if partial:
                    res.note("files of the failed checkpoint left after the next commit")
                if cfg.s3 is not None:
                    expect_loads(res, trial, only(cfg, "s3"), sd, next_id, "after the fault (S3)")
        except BaseException as ex:  # noqa: BLE001
            res.fail(trial, f"harness error: {type(ex).__name__}: {ex}")
        finally:
            close_writer(writer)
        res.trials += 1
        env.cleanup(d, cfgd)
    res.seconds = time.perf_counter() - t0
    return res


# == case: corrupt =================================================================================

def case_corrupt(env: Env, trials: int, seed: int) -> CaseResult:
    res = CaseResult("corrupt")
    t0 = time.perf_counter()
    rng = random.Random(f"{seed}-corrupt")
    d = env.fresh("corrupt")
    cfgd = env.config(d, local_keep=0, s3_keep=0, fsync=False)
    cfg = config_from_dict(cfgd)
    writer = TieredWriter(cfg)
    states: dict[str, dict] = {}
    try:
        for n, cid in enumerate(("step-000001", "step-000002")):
            sd = make_state(rng.randrange(1 << 20))
            e = save_wait(writer, sd, cid)
            if e is not None:
                raise RuntimeError(f"corrupt: cannot save {cid}: {e}")
            states[cid] = clone_state(sd)
    finally:
        close_writer(writer)
    # every file of both checkpoints, on each tier
    files: list[tuple[str, str]] = []  # (tier, key)
    root = cfg.local.resolved_path()
    for p in sorted(root.rglob("*")):
        if p.is_file() and split_key(p.relative_to(root).as_posix()) is not None:
            files.append(("local", p.relative_to(root).as_posix()))
    prefix = cfgd.get("s3", {}).get("prefix", "")
    if env.has_s3:
        c = env.client()
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
            for o in page.get("Contents", ()):
                key = o["Key"][len(prefix) + 1:]
                if split_key(key) is not None:
                    files.append(("s3", key))
    tiers = sorted({t for t, _ in files})

    def read(tier: str, key: str) -> bytes:
        if tier == "local":
            return (root / key).read_bytes()
        return env.client().get_object(Bucket=BUCKET, Key=f"{prefix}/{key}")["Body"].read()

    def write(tier: str, key: str, data: bytes) -> None:
        if tier == "local":
            path = root / key
            st = path.stat()
            path.write_bytes(data)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the commit order is the files' mtime order
        else:
            env.client().put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=data)

    def restore(tier: str, key: str, data: bytes) -> None:
        write(tier, key, data)
        if tier == "s3" and key.endswith("metadata.json"):
            # S3's LastModified is the commit time: re-put the newer commits after it, in order
            # (same bytes), so that the rewrite does not make an older checkpoint 'latest'
            cid = split_key(key)[0]
            for newer in sorted(states):
                if newer > cid:
                    k = f"{newer}/metadata.json"
                    write("s3", k, read("s3", k))

    for i in range(trials):
        tier, key = rng.choice(files)
        cid = split_key(key)[0]
        original = read(tier, key)
        at = rng.randrange(len(original))
        mask = rng.randrange(1, 256)
        flipped = bytearray(original)
        flipped[at] ^= mask
        kind = "metadata" if key.endswith("metadata.json") else "data"
        reader_tiers = rng.choice([tiers, [tier]]) if len(tiers) > 1 else tiers
        rcfg = cfg if len(reader_tiers) > 1 else only(cfg, reader_tiers[0])
        target_id = rng.choice([cid, "latest"])
        trial = f"#{i} {kind} on {tier} [{at}]^{mask:#04x} via {'+'.join(reader_tiers)} load {target_id}"
        write(tier, key, bytes(flipped))
        try:
            try:
                got, reader = load_state(rcfg, states[cid], target_id)
            except BaseException as e:  # noqa: BLE001
                if not is_clear(e):
                    res.fail(trial, f"failed without a tierckpt error: {short(e)}")
                elif len(reader_tiers) > 1:
                    res.fail(trial, f"failed although the other tier holds an intact copy: {short(e)}")
                else:
                    res.note(f"{kind} on {tier}: clear error")
                continue
            resolved = reader.resolved_id
            expected = states.get(resolved or "")
            if expected is None:
                res.lose(trial, f"loaded unknown checkpoint {resolved}")
                continue
            bad = diff(expected, got)
            newest = max(states)
            if bad:
                res.lose(trial, f"SILENTLY WRONG load of {resolved}: {bad[:4]} differ")
            elif target_id == "latest" and resolved != newest and (
                    len(reader_tiers) > 1 or not (kind == "metadata" and cid == newest)):
                res.fail(trial, f"latest resolved to {resolved}, not to the newest intact {newest}")
            else:
                if resolved != cid and cid == newest:
                    res.note(f"{kind} on {tier}: latest skipped the corrupt newest")
                elif resolved != cid:
                    res.note(f"{kind} on {tier}: latest (intact) loaded")
                elif len(reader_tiers) > 1:
                    res.note(f"{kind} on {tier}: bit-exact from the other tier")
                else:
                    res.note(f"{kind} on {tier}: bit-exact (harmless flip)")
        finally:
            restore(tier, key, original)
            res.trials += 1
    env.cleanup(d, cfgd)
    res.seconds = time.perf_counter() - t0
    return res


# == case: concurrency =============================================================================

def _concurrent_save_child(payload: dict) -> int:
    """Forked child: wait at the barrier file, save ``payload['seed']``'s state as ``payload['cid']``."""
    cfg = config_from_dict(payload["config"])
    sd = make_state(payload["seed"])
    writer = TieredWriter(cfg)
    go = Path(payload["go"])
    Path(payload["ready"]).write_text("1")
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    e = save_wait(writer, sd, payload["cid"])
    out = {"ok": e is None, "clear": e is None or is_clear(e), "conflict": e is not None and find_error(e, CommitConflict) is not None,
           "error": "" if e is None else short(e)}
    Path(payload["result"]).write_text(json.dumps(out))
    return 0


CONC_SCENARIOS = ("one-engine", "two-engines", "two-engines+s3", "two-nodes-one-s3", "two-processes")


def case_concurrency(env: Env, trials: int, seed: int, *, scenarios: tuple[str, ...] = CONC_SCENARIOS) -> CaseResult:
    """``scenarios`` are taken in turn (in a seeded order): ``one-engine`` (two writers with one
    configuration in one process share an engine), ``two-engines`` (configurations differing only
    in flush_threads, same local path), ``two-engines+s3`` (same local path and S3 prefix),
    ``two-nodes-one-s3`` (own local paths, same S3 prefix), ``two-processes`` (same local path,
    sometimes plus S3)."""
    res = CaseResult("concurrency")
    t0 = time.perf_counter()
    order = [sc for sc in scenarios if env.has_s3 or sc not in ("two-engines+s3", "two-nodes-one-s3")]
    random.Random(f"{seed}-concurrency").shuffle(order)
    for i in range(trials):
        rng = random.Random(f"{seed}-concurrency-{i}")
        scen = order[i % len(order)]
        d = env.fresh("concurrency")
        seeds = (rng.randrange(1 << 20), rng.randrange(1 << 20))
        states = [make_state(s) for s in seeds]
        cid = "step-000007"
        use_s3 = scen in ("two-engines+s3", "two-nodes-one-s3") or (scen == "two-processes" and env.has_s3 and rng.random() < 0.5)
        prefix = f"chaos/{d.name}"
        cfgs = []
        for w in range(2):
            base = d / (f"node{w}" if scen == "two-nodes-one-s3" else "shared")
            base.mkdir(exist_ok=True)
            c = env.config(base, s3=use_s3, prefix=prefix, local_keep=0, s3_keep=0, fsync=False,
                           flush_threads=1 if (w == 0 or scen == "one-engine") else 2)
            cfgs.append(c)
        trial = f"#{i} {scen}" + (" +s3" if use_s3 and scen == "two-processes" else "")
        outcomes: list[dict] = [{}, {}]
        writers: list[TieredWriter] = []
        try:
            if scen == "two-processes":
                procs = []
                for w in range(2):
                    pay = {"config": cfgs[w], "seed": seeds[w], "cid": cid, "go": str(d / "go"), "ready": str(d / f"ready{w}"),
                           "result": str(d / f"result{w}.json")}
                    procs.append(env.spawn("concurrent-save", pay, d / f"child{w}.out"))
                deadline = time.monotonic() + 120
                while not all((d / f"ready{w}").exists() for w in range(2)) and time.monotonic() < deadline:
                    time.sleep(0.005)
                (d / "go").write_text("1")
                for w, p in enumerate(procs):
                    rc = wait_proc(p, 180)
                    try:
                        outcomes[w] = json.loads((d / f"result{w}.json").read_text())
                    except (OSError, ValueError):
                        outcomes[w] = {"ok": False, "clear": False, "error": f"child exit {rc}: {tail(d / f'child{w}.out')}"}
            else:
                writers = [TieredWriter(config_from_dict(c)) for c in cfgs]
                barrier = threading.Barrier(2)

                def run(w: int) -> None:
                    barrier.wait()
                    e = save_wait(writers[w], states[w], cid)
                    outcomes[w] = {"ok": e is None, "clear": e is None or is_clear(e),
                                   "conflict": e is not None and find_error(e, CommitConflict) is not None,
                                   "error": "" if e is None else short(e)}

                ts = [threading.Thread(target=run, args=(w,)) for w in range(2)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join(180)
                if any(t.is_alive() for t in ts):
                    res.fail(trial, "a save hung for 180 s")
                    continue
            check_race(res, trial, scen, cfgs, states, outcomes, cid, use_s3)
        except BaseException as ex:  # noqa: BLE001
            res.fail(trial, f"harness error: {type(ex).__name__}: {ex}")
        finally:
            for w in writers:
                close_writer(w)
            res.trials += 1
            env.cleanup(d, cfgs[0] if use_s3 else None)
    res.seconds = time.perf_counter() - t0
    return res


def which_state(cfg: TierConfig, states: list[dict], cid: str) -> tuple[int | None, str]:
    """Index of the state ``cid`` loads as from ``cfg`` (None: neither / mixed), and an error text."""
    try:
        got, _ = load_state(cfg, states[0], cid)
    except BaseException as e:  # noqa: BLE001
        return None, f"does not load: {short(e)}"
    for w, st in enumerate(states):
        if not diff(st, got):
            return w, ""
    return None, "loads as NEITHER writer's state (mixed or corrupt)"


def check_race(res: CaseResult, trial: str, scen: str, cfgs: list[dict], states: list[dict], outcomes: list[dict],
               cid: str, use_s3: bool) -> None:
    oks = [w for w in range(2) if outcomes[w].get("ok")]
    for w in range(2):
        if not outcomes[w].get("ok") and not outcomes[w].get("clear"):
            res.fail(trial, f"writer {w} failed without a tierckpt error: {outcomes[w].get('error')}")
    if scen == "two-nodes-one-s3":
        # each node commits its own local copy; exactly one of them wins the S3 commit
        for w in range(2):
            local = only(config_from_dict(cfgs[w]), "local")
            got, err = which_state(local, states, cid)
            if got != w:
                res.lose(trial, f"node {w}'s local copy {err or f'is writer {got}s state'}")
    if len(oks) != 1:
        res.fail(trial, f"{len(oks)} writers reported success (expected exactly one): {[o.get('error') for o in outcomes]}")
        if not oks:
            return
    winner = oks[0]
    if any(o.get("conflict") for o in outcomes):
        res.note("loser: CommitConflict")
    else:
        res.note("loser: other clear error")
    shared = [only(config_from_dict(cfgs[winner]), "s3")] if scen == "two-nodes-one-s3" else \
             [only(config_from_dict(cfgs[winner]), "local")] + ([only(config_from_dict(cfgs[winner]), "s3")] if use_s3 else [])
    for sub in shared:
        name = "s3" if sub.local is None else "local"
        got, err = which_state(sub, states, cid)
        if got is None:
            res.lose(trial, f"the committed {cid} on {name} {err}")
        elif got != winner:
            res.lose(trial, f"{name} holds writer {got}'s state but writer {winner} reported the commit",
                     "error-to-other-writer" if scen == "one-engine" else "")


# == case: resources ===============================================================================

def _resources_child(payload: dict) -> int:
    """Forked child: ``n`` checkpoints in a row, then ``loads`` loads of ``latest``; samples RSS,
    threads and open fds after each."""
    import gc

    import psutil

    cfg = config_from_dict(payload["config"])
    g = torch.Generator().manual_seed(payload["seed"])
    sd = make_state(payload["seed"], big=payload["big"])
    proc = psutil.Process()

    def sample() -> dict:
        return {"rss": proc.memory_info().rss, "threads": proc.num_threads(), "fds": proc.num_fds()}

    writer = TieredWriter(cfg)
    saves, loads, errors = [], [], []
    for i in range(1, payload["n"] + 1):
        dcp.save(sd, checkpoint_id=f"step-{i:06d}", storage_writer=writer, no_dist=True)
        writer.wait_captured()
        last = clone_state(sd)
        mutate(sd, g)
        try:
            writer.wait()
        except TierckptError as e:
            errors.append(str(e)[:300])
        saves.append(sample())
    for _ in range(payload["loads"]):
        try:
            got, _ = load_state(cfg, last, "latest")
            if diff(last, got):
                errors.append("latest loaded wrong")
        except BaseException as e:  # noqa: BLE001
            errors.append(f"load failed: {short(e)}")
        gc.collect()
        loads.append(sample())
    Path(payload["result"]).write_text(json.dumps({"saves": saves, "loads": loads, "errors": errors}))
    return 0


def _growth(res: CaseResult, trial: str, what: str, s: list[dict], warmup: int, slack: dict[str, int],
            worst: dict[str, float]) -> None:
    """Threads and fds: the peak after warm-up may exceed the warm-up value by ``slack``. RSS
    wanders in a band of a few MiB (malloc arenas, the size of the state), so it fails only when
    it *trends*: the least-squares slope over the samples after warm-up, times their number, and
    the rise from the first to the last few samples both exceed the slack."""
    import statistics

    post = s[warmup:]
    w = s[warmup - 1]
    for k in ("threads", "fds"):
        grew = max(x[k] for x in post) - w[k]
        worst[k] = max(worst.get(k, grew), grew)
        if grew > slack[k]:
            res.fail(trial, f"{what}: {k} grew {w[k]} -> {max(x[k] for x in post)} after warm-up (allowed +{slack[k]})")
    ys = [x["rss"] / MiB for x in post]
    xs = list(range(len(ys)))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-9, sum((x - mx) ** 2 for x in xs))
    trend = slope * len(ys)
    k = max(1, len(ys) // 4)
    rise = statistics.median(ys[-k:]) - statistics.median(ys[:k])
    worst["rss_trend"] = max(worst.get("rss_trend", trend), trend)
    if trend > slack["rss"] / MiB and rise > slack["rss"] / MiB / 2:
        res.fail(trial, f"{what}: RSS keeps growing after warm-up: {slope:+.2f} MiB per step, "
                        f"{ys[0]:.0f} -> {ys[-1]:.0f} MiB over {len(ys)} steps")


def case_resources(env: Env, trials: int, seed: int, *, n: int = 30, loads: int = 16, warmup: int = 10,
                   load_warmup: int = 8) -> CaseResult:
    res = CaseResult("resources")
    t0 = time.perf_counter()
    worst_s: dict[str, float] = {}
    worst_l: dict[str, float] = {}
    for i in range(trials):
        rng = random.Random(f"{seed}-resources-{i}")
        d = env.fresh("resources")
        cfgd = env.config(d, local_keep=2, s3_keep=2, buffer="2MiB", chunk="256KiB", fsync=rng.random() < 0.5)
        out = d / "result.json"
        p = env.spawn("resources", {"config": cfgd, "n": n, "loads": loads, "seed": rng.randrange(1 << 20),
                                    "big": 3 * MiB, "result": str(out)}, d / "child.out")
        rc = wait_proc(p, 900)
        trial = f"#{i}"
        res.trials += 1
        if rc != 0 or not out.exists():
            res.fail(trial, f"resource run failed (exit {rc}): {tail(d / 'child.out')}")
            env.cleanup(d, cfgd)
            continue
        data = json.loads(out.read_text())
        for e in data["errors"]:
            res.fail(trial, f"checkpoint failed: {e}")
        # saving reuses the pool and threads: flat after warm-up
        _growth(res, trial, f"{n} saves", data["saves"], warmup, {"rss": 16 * MiB, "threads": 1, "fds": 2}, worst_s)
        # each TieredReader builds its own tiers (with S3, a boto3 client per reader, never closed):
        # memory plateaus once the garbage collector reclaims them; it must not keep growing
        _growth(res, trial, f"{loads} loads", data["loads"], load_warmup, {"rss": 24 * MiB, "threads": 1, "fds": 2}, worst_l)
        env.cleanup(d, cfgd)
    for what, w in ((f"{n} saves", worst_s), (f"{loads} loads", worst_l)):
        if w:
            res.note(f"{what}: worst RSS trend {w['rss_trend']:+.1f}MiB, threads {w['threads']:+d}, fds {w['fds']:+d}")
    res.seconds = time.perf_counter() - t0
    return res


# == case: s3faults ================================================================================

def case_s3faults(env: Env, trials: int, seed: int, *, error_rate: float = 0.05, drop_rate: float = 0.05) -> CaseResult:
    """Promotions alternate between a writer with botocore's retries (``max_attempts = 4``: they
    should nearly all succeed) and one without (``max_attempts = 1``: many fail, which exercises the
    failure path); both share the local tier and the S3 prefix."""
    res = CaseResult("s3faults")
    t0 = time.perf_counter()
    if not env.has_s3:
        res.skipped = "no S3 server (--s3 none)"
        return res
    sys.path.insert(0, str(ROOT / "tests"))
    from faultproxy import FaultProxy

    rng = random.Random(f"{seed}-s3faults")
    d = env.fresh("s3faults")
    proxy = FaultProxy(env.endpoint, error_rate=error_rate, drop_rate=drop_rate, seed=rng.randrange(1 << 30)).start()
    cfgds = [env.config(d, endpoint=proxy.url, prefix=f"chaos/{d.name}", local_keep=2, s3_keep=0, fsync=False,
                        max_attempts=attempts, connect_timeout=2.0, read_timeout=5.0) for attempts in (4, 1)]
    cfgd = cfgds[0]
    cfg = config_from_dict(cfgd)
    direct = dataclasses.replace(cfg, s3=dataclasses.replace(cfg.s3, endpoint_url=env.endpoint))
    writers = [TieredWriter(config_from_dict(c)) for c in cfgds]
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    sd = make_state(rng.randrange(1 << 20), big=6 * MiB)  # > part_size: multipart uploads
    reported: dict[str, bool] = {}
    states: dict[str, dict] = {}
    try:
        for i in range(trials):
            cid = f"step-{i + 1:06d}"
            writer = writers[i % 2]
            retries = "with retries" if i % 2 == 0 else "without retries"
            states[cid] = clone_state(sd)
            e = save_wait(writer, sd, cid)
            reported[cid] = e is None
            if e is not None:
                if not isinstance(e, TierckptError) or cid not in str(e):
                    res.fail(f"#{i}", f"promotion of {cid} failed unclearly: {type(e).__name__}: {str(e)[:200]}")
                else:
                    res.note(f"failed clearly ({retries})")
            else:
                res.note(f"promoted ({retries})")
            writer.wait_captured()
            mutate(sd, g)
            res.trials += 1
    finally:
        for w in writers:
            close_writer(w)
    st = proxy.stats
    res.note(f"S3 requests {st['requests']}: 500/503 {st['errors']}, dropped {st['drops']}")
    proxy_s3 = only(cfg, "s3")
    s3_only = only(direct, "s3")
    tier = make_s3(s3_only)
    try:
        infos = list_checkpoints(tier)
        uploads = tier.client.list_multipart_uploads(Bucket=BUCKET, Prefix=cfg.s3.prefix + "/").get("Uploads", []) or []
    finally:
        tier.close()
    committed = {c.checkpoint_id for c in infos if c.committed}
    for cid, ok in reported.items():
        if ok and cid not in committed:
            res.fail(cid, "reported promoted, but not committed on S3")
        if not ok and cid in committed:
            res.note("failed promotion committed anyway")
    for cid in sorted(committed):
        if cid not in states:
            res.lose(cid, "unknown checkpoint committed on S3")
            continue
        expect_loads(res, cid, s3_only, states[cid], cid, "S3 (direct)")
    # reads through the faulty proxy: bit-exact or a clear error
    for cid in sorted(committed)[-3:]:
        try:
            got, _ = load_state(proxy_s3, states[cid], cid)
        except BaseException as e:  # noqa: BLE001
            if not is_clear(e):
                res.fail(cid, f"load through the faulty proxy failed unclearly: {short(e)}")
            else:
                res.note("faulty read failed clearly")
            continue
        if diff(states[cid], got):
            res.lose(cid, "load through the faulty proxy returned WRONG bytes")
    if uploads:
        res.note(f"multipart uploads left open {len(uploads)}")
    proxy.stop()
    env.cleanup(d, cfgd)
    res.seconds = time.perf_counter() - t0
    return res


# == driver ========================================================================================

CASE_FUNCS: dict[str, Callable[..., CaseResult]] = {
    "crash": case_crash, "faults": case_faults, "corrupt": case_corrupt,
    "concurrency": case_concurrency, "resources": case_resources, "s3faults": case_s3faults,
}
# zygote child kinds added by other modules (``_child_main`` dispatches to them)
CHILDREN: dict[str, Callable[[dict], int]] = {}


def register_cases(funcs: dict[str, Callable[..., CaseResult]], children: dict[str, Callable[[dict], int]] | None = None) -> None:
    """Add cases kept in other modules to :data:`CASES`/:data:`CASE_FUNCS` (and their zygote children)."""
    global CASES
    CASE_FUNCS.update(funcs)
    CASES = CASES + tuple(n for n in funcs if n not in CASES)
    CHILDREN.update(children or {})


def run_cases(env: Env, cases: list[str], trials: int, seed: int, progress: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    out = []
    for name in cases:
        t0 = time.perf_counter()
        try:
            r = CASE_FUNCS[name](env, trials, seed)
        except BaseException as e:  # noqa: BLE001 - a broken case is a failure, not a crash of the harness
            r = CaseResult(name)
            r.fail("setup", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            r.seconds = time.perf_counter() - t0
        out.append(r)
        if progress is not None:
            progress(r)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5, help="trials per case")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    ap.add_argument("--s3", choices=["moto", "seaweedfs", "none"], default="moto")
    ap.add_argument("--json", default="", help="write the results (with every problem) here")
    ap.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASE_FUNCS]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    torch.set_num_threads(1)
    print(f"[chaos] seed {seed}, {args.trials} trials per case, cases {','.join(cases)}, S3: {args.s3}", flush=True)
    t0 = time.perf_counter()

    def progress(r: CaseResult) -> None:
        print(f"[chaos] {r.case}: {r.trials} trials, {r.failures} failures, {r.lost} lost in {r.seconds:.1f} s", flush=True)

    with Env(args.s3, keep=args.keep) as env:
        if args.keep:
            print(f"[chaos] working in {env.work}", flush=True)
        results = run_cases(env, cases, args.trials, seed, progress)
    total = time.perf_counter() - t0
    print()
    print(format_table(results))
    print(f"\n{total:.1f} s in all; rerun with --seed {seed}")
    problems = [p for r in results for p in r.problems]
    if problems:
        print(f"\n{len(problems)} problem(s):")
        for p in problems[:50]:
            print("  " + p)
        if len(problems) > 50:
            print(f"  ... and {len(problems) - 50} more (see --json)")
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": seed, "trials": args.trials, "s3": args.s3, "seconds": total,
                                               "results": [r.to_json() for r in results]}, indent=2))
    return 0 if all(r.ok for r in results) else 1


# More cases live in their own modules and register themselves; run as a script, this module is
# also ``chaos`` for them (one set of classes and tables, not a second copy).
sys.modules.setdefault("chaos", sys.modules[__name__])
import chaos_loss  # noqa: E402,F401 - filetimes, backlog, gcload, killloop

if __name__ == "__main__":
    sys.exit(main())
