"""Helpers shared by the sections of ``tools/bench.py``: timing, tables, page-cache control, the
one-rank process group, contention probes, the context every section gets, and the state
dict of the ``local`` and ``cpu`` sections."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tierckpt import HostConfig, LocalConfig, TierConfig
from tierckpt.testing import free_port

REPO = Path(__file__).resolve().parent.parent.parent
BENCH = REPO / "tools" / "bench.py"  # the CLI; child processes of sections re-run it with --_<kind>-child

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def now() -> float:
    return time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def row(
    name: str,
    times: list[float] | None = None,
    nbytes: int | None = None,
    ratio: float | None = None,
    note: str = "",
    **extra: Any,
) -> dict:
    """One table row: ``times`` in seconds (median/min computed here); GiB/s from ``nbytes``/median."""
    r: dict[str, Any] = {"name": name, "median_s": None, "min_s": None, "gib_s": None, "ratio": ratio, "note": note}
    if times:
        r["median_s"] = med(times)
        r["min_s"] = min(times)
        r["all_s"] = list(times)
        if nbytes:
            r["gib_s"] = nbytes / GiB / r["median_s"] if r["median_s"] else None
    r.update(extra)
    return r


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(title: str, sec: dict) -> None:
    rows = sec.get("rows", [])
    w = max([len(r["name"]) for r in rows] + [20])
    cpu = any(r.get("cpu_s_per_gib") is not None for r in rows)  # CPU seconds per GiB, when measured
    print()
    print(f"== {title} ==")
    print(
        f"{'name':<{w}} | {'median s':>9} | {'min s':>9} | {'GiB/s':>7} | {'ratio':>7} | "
        + (f"{'CPU-s/GiB':>9} | " if cpu else "")
        + "note"
    )
    print("-" * (w + 52 + (12 if cpu else 0)))
    for r in rows:
        print(
            f"{r['name']:<{w}} | {fmt(r['median_s'], '9.4f')} | {fmt(r['min_s'], '9.4f')} | "
            f"{fmt(r['gib_s'], '7.3f')} | {fmt(r['ratio'], '7.3f')} | "
            + (f"{fmt(r.get('cpu_s_per_gib'), '9.3f')} | " if cpu else "")
            + r.get("note", "")
        )
    for k, v in sec.get("ratios", {}).items():
        tgt = sec.get("targets", {}).get(k)
        ok = ""
        if tgt is not None and v is not None:
            op, val = tgt
            good = {">=": v >= val, "<=": v <= val, "<": v < val, ">": v > val}[op]
            ok = f"  (target {op} {val}: {'MET' if good else 'MISSED'})"
        print(f"  ratio {k} = {fmt(v, '.4f')}{ok}")
    for n in sec.get("notes", []):
        print(f"  note: {n}")


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False if not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm_file_tree(path: Path) -> None:
    """Read every file under ``path`` (to make a load equally warm when caches cannot be dropped)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    buf = bytearray(16 * MiB)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def rm(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def init_pg() -> None:
    if dist.is_initialized():
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)


def tensor_bytes(sd: Any) -> int:
    if isinstance(sd, torch.Tensor):
        return sd.numel() * sd.element_size()
    if isinstance(sd, dict):
        return sum(tensor_bytes(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(tensor_bytes(v) for v in sd)
    return 0


def tiered_cfg(path: Path, pool: int, chunk: int, keep: int = 1, threads: int = 4) -> TierConfig:
    return TierConfig(
        host=HostConfig(buffer_size=pool, chunk_size=chunk),
        local=LocalConfig(path=str(path), flush_threads=threads, keep=keep),
    )


def size_label(n: int) -> str:
    return f"{n // GiB}GiB" if n >= GiB and n % GiB == 0 else f"{n // MiB}MiB"


def machine_info(work: Path) -> dict:
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "disk_path": str(work),
        "niceness": os.nice(0),
    }
    with contextlib.suppress(OSError):
        info["autogroup"] = Path("/proc/self/autogroup").read_text().strip()
    with contextlib.suppress(Exception):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(Exception):
        import psutil

        info["ram_gib"] = round(psutil.virtual_memory().total / GiB, 1)
    with contextlib.suppress(Exception):
        best = ("", "", "")
        real = os.path.realpath(work)
        for line in open("/proc/mounts"):
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
        info["disk_device"], info["disk_mount"], info["disk_fstype"] = best
        st = os.statvfs(work)
        info["disk_free_gib"] = round(st.f_bavail * st.f_frsize / GiB, 1)
    with contextlib.suppress(Exception):
        info["git_head"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        info["git_dirty"] = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True, timeout=10
        ).stdout.splitlines()
    return info


def _psi(kind: str) -> float | None:
    """Cumulative microseconds some task stalled on ``kind`` (cpu/io), from /proc/pressure."""
    try:
        for line in open(f"/proc/pressure/{kind}"):
            if line.startswith("some"):
                return float(line.split("total=")[1])
    except (OSError, IndexError, ValueError):
        return None
    return None


class Contention:
    """What else ran on the machine during a section: other processes' CPU use, load, pressure."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self.t0 = now()
        self.sys0 = psutil.cpu_times()
        self.own0 = self._own()
        self.psi0 = {k: _psi(k) for k in ("cpu", "io")}
        self.load0 = os.getloadavg()

    def _own(self) -> float:
        import resource

        a = resource.getrusage(resource.RUSAGE_SELF)
        b = resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

    def done(self) -> dict:
        wall = now() - self.t0
        s1 = self._psutil.cpu_times()
        busy = sum(
            getattr(s1, f) - getattr(self.sys0, f)
            for f in ("user", "nice", "system", "irq", "softirq", "steal")
            if hasattr(s1, f)
        )
        own = self._own() - self.own0
        out = {
            "wall_s": wall,
            "own_cpu_cores": own / wall,
            "other_cpu_cores": max(0.0, busy - own) / wall,
            "loadavg_start": self.load0,
            "loadavg_end": os.getloadavg(),
        }
        for k, v0 in self.psi0.items():
            v1 = _psi(k)
            if v0 is not None and v1 is not None:
                out[f"psi_{k}_some_pct"] = 100.0 * (v1 - v0) / 1e6 / wall
        return out

    @staticmethod
    def line(c: dict) -> str:
        s = (
            f"contention: other processes used {c['other_cpu_cores']:.2f} cores on average (this run "
            f"{c['own_cpu_cores']:.2f}); loadavg {c['loadavg_start'][0]:.1f} -> {c['loadavg_end'][0]:.1f}"
        )
        if "psi_cpu_some_pct" in c:
            s += f"; CPU pressure {c['psi_cpu_some_pct']:.0f}%, IO pressure {c.get('psi_io_some_pct', 0):.0f}%"
        return s


def cpu_seconds() -> float:
    """CPU seconds (user+system) this process used so far, all threads."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Ctx:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.quick = args.quick
        self.repeats = args.repeats


# ---------------------------------------------------------------------------------------------
# A. local tier: save bandwidth vs the disk ceiling, load vs FileSystemReader
# ---------------------------------------------------------------------------------------------


def make_state(total: int, seed: int = 0) -> dict:
    """A few dozen fp32/bf16 tensors of mixed sizes (~``total`` bytes), small tensors, non-tensor items."""
    g = torch.Generator().manual_seed(seed)
    weights = [16, 12, 10, 8, 8, 6, 6, 5, 5, 4, 4, 4, 3, 3, 3, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    unit = total / sum(weights)
    sd: dict[str, Any] = {}
    for i, w in enumerate(weights):
        dtype = torch.bfloat16 if i % 3 == 2 else torch.float32
        es = 2 if dtype == torch.bfloat16 else 4
        cols = 4096 if i % 2 == 0 else 1536
        rows = max(1, int(w * unit) // es // cols)
        t = torch.empty(rows, cols, dtype=dtype)
        t.uniform_(-1.0, 1.0, generator=g)
        sd[f"layers.{i:02d}.weight"] = t
    sd["layers.00.bias"] = torch.randn(4096, generator=g)
    sd["norm.weight"] = torch.randn(1536, generator=g, dtype=torch.float32).to(torch.bfloat16)
    sd["odd_shape"] = torch.randn(7, 13, 5, generator=g)
    sd["scalar"] = torch.tensor(3.5)
    sd["int_step"] = torch.tensor(123456, dtype=torch.int64)
    sd["step"] = 1234
    sd["meta"] = {"name": "bench", "lr": 3e-4}
    return sd


def empty_like_state(sd: dict) -> dict:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        elif isinstance(v, dict):
            out[k] = {kk: type(vv)() for kk, vv in v.items()}
        else:
            out[k] = type(v)()
    return out


def zero_state(sd: dict) -> None:
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            v.zero_()
        elif isinstance(v, dict):
            for kk, vv in list(v.items()):
                v[kk] = type(vv)()
        else:
            sd[k] = type(v)()


def compare_state(got: dict, want: dict) -> list[str]:
    bad = []
    for k, v in want.items():
        g = got.get(k)
        if isinstance(v, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.dtype != v.dtype or g.shape != v.shape or not torch.equal(g, v):
                bad.append(k)
        elif g != v:
            bad.append(k)
    return bad


def raw_write(path: Path, nbytes: int, buf: torch.Tensor, threads: int, direct: bool = False) -> float:
    """``pwrite`` ``nbytes`` from the touched ``buf`` (64 MiB writes) into one file, then fsync.

    ``direct``: the same I/O as the local tier's sink: the file preallocated
    (``posix_fallocate``), written with ``O_DIRECT`` from the page-aligned ``buf`` (the last
    partial 4 KiB block through a buffered descriptor)."""
    mv = memoryview(buf.numpy())
    step = 64 * MiB
    nslices = len(mv) // step
    t0 = now()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    wfd = fd
    if direct:
        os.posix_fallocate(fd, 0, nbytes)
        wfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:

        def span(lo: int, hi: int) -> None:
            off = lo
            while off < hi:
                n = min(step, hi - off)
                j = (off // step) % nslices  # cycle over the touched buffer, 64 MiB at a time
                src = mv[j * step : j * step + n]
                if direct and n % 4096:
                    a = n - n % 4096
                    w = (os.pwrite(wfd, src[:a], off) if a else 0) + os.pwrite(fd, src[a:], off + a)
                else:
                    w = os.pwrite(wfd, src, off)
                off += w

        if threads == 1:
            span(0, nbytes)
        else:
            per = (nbytes // threads + step - 1) // step * step
            ts = [threading.Thread(target=span, args=(i * per, min(nbytes, (i + 1) * per))) for i in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        os.fsync(fd)
    finally:
        os.close(fd)
        if wfd != fd:
            os.close(wfd)
    return now() - t0


class RssPeak:
    """Peak resident memory of this process, sampled every 5 ms on a thread while the ``with``
    block runs (``ru_maxrss`` is inherited across fork/exec on Linux, so it would report the
    parent's high-water mark). ``base``: RSS when created; ``peak``: highest seen (settable, to
    measure several steps in one block)."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.base = self.peak = self.rss()
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._sample, daemon=True)

    def rss(self) -> int:
        return self._proc.memory_info().rss

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.005)

    def __enter__(self) -> RssPeak:
        self._th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._th.join()
        self.peak = max(self.peak, self.rss())
