#!/usr/bin/env python
"""The ``planning`` bench: how long ``dcp.save`` blocks when a rank saves hundreds to thousands of tensors.

    python tools/bench_planning.py [--ranks 2,4,8] [--tensors 600,6000] [--reps 5] [--mib 20]
                                   [--out bench-out/bench_planning.json] [--no-restart] [--quick]
                                   [--nice -15]

For every (ranks, tensors per rank) pair it starts ``ranks`` processes joined by a gloo process
group (loopback, one CPU thread each). Every rank holds ``--tensors`` fp32 tensors (``--mib`` MiB
in all, rank-unique keys under ``model.``, as sharded training state is) and one replicated
non-tensor item. Each process saves the same state with every mode below, interleaved (the
order rotates per repetition) after one warm-up round; before each timed call the ranks meet at
a barrier, and after it each mode waits until its save is complete (so no save runs into the
next); before the barrier each process runs ``gc.collect()`` (untimed; ``--no-gc-collect`` to
skip), so that no mode pays for the previous one's garbage: with torch loaded a full collection
takes ~0.1 s, and without this they land at random in the timed calls. Modes:

* ``floor``       a no-op StorageWriter (resolves every item, stores nothing): DCP's own cost
* ``floor+cache`` the same with ``DefaultSavePlanner(enable_plan_caching=True)``
* ``fs``          sync ``dcp.save`` to DCP's ``FileSystemWriter`` (fsync on, DCP's default)
* ``async``       ``dcp.async_save`` to ``FileSystemWriter`` (DCP's default stager)
* ``tier``        ``dcp.save`` through one ``TieredWriter`` (local tier, fsync on)
* ``tier+cache``  the same with ``DefaultSavePlanner(enable_plan_caching=True)``

Figures per mode: the time ``dcp.save``/``async_save`` blocked (per repetition the slowest
rank; the median over repetitions), process CPU seconds during that call (all threads, summed
over ranks), and CPU seconds until the save was complete (the background work included).
Ratios are taken within one run: ``tier`` over ``floor``, ``tier+cache`` over ``floor+cache``.

``restart`` (unless ``--no-restart``): ``--restarts`` times, fresh processes on the same local
tier (a job restarted with an unchanged model) create their writer, load the latest checkpoint,
then time their *first* ``tier+cache`` save (one sample per restart), then measure
``floor+cache`` (and steady ``tier+cache``) in the same processes.

Each plan-caching mode uses its own planner subclass, so DCP's process-wide plan cache (keyed by
the planner's class name) never mixes writers. Writes JSON to ``--out`` and prints tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODES = ["floor", "floor+cache", "fs", "async", "tier", "tier+cache"]
MiB = 1 << 20


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- worker side ---------------------------------------------------------------------------------


def _worker_imports():
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from benchlib.lazy import NullWriter  # DCP's planning floor, shared with tools/bench.py's lazy section
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    # One planner class per caching mode: DCP's plan cache is keyed by the planner's class name.
    class FloorCachePlanner(DefaultSavePlanner):
        pass

    class TierCachePlanner(DefaultSavePlanner):
        pass

    return torch, dist, dcp, DefaultSavePlanner, FileSystemWriter, NullWriter, FloorCachePlanner, TierCachePlanner


def _state(torch, rank: int, tensors: int, mib: float) -> dict:
    per = max(1, int(mib * MiB / 4 / tensors))
    g = torch.Generator().manual_seed(rank)
    model = {f"r{rank}.layers.{i}.weight": torch.randn(per, generator=g) for i in range(tensors)}
    return {"model": model, "step": 100}


def _tier_config(root: str):
    from tierckpt import HostConfig, LocalConfig, TierConfig
    from tierckpt.config import JobConfig

    return TierConfig(
        host=HostConfig(buffer_size=64 * MiB, chunk_size=8 * MiB),
        local=LocalConfig(path=root, keep=2, fsync=True, flush_threads=2),
        job=JobConfig(log_level="ERROR"),
    )


def worker(a: argparse.Namespace) -> None:
    torch, dist, dcp, DefaultSavePlanner, FileSystemWriter, NullWriter, FloorCachePlanner, TierCachePlanner = (
        _worker_imports()
    )
    from tierckpt import TieredReader, TieredWriter
    from tierckpt.save import plancache

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = Path(a.work)
    sd = _state(torch, rank, a.tensors, a.mib)
    tier = TieredWriter(_tier_config(str(work / "tier")))
    fs_root = work / "fs"
    out: dict[str, Any] = {"rank": rank, "modes": {}}

    def run(mode: str, cid: str) -> tuple[float, float, float, float]:
        """(blocked wall, CPU during it, CPU until complete, wall until complete) of one save."""
        if a.gc_collect:
            gc.collect()  # every mode starts without the previous one's garbage (a full collection is ~0.1 s here)
        dist.barrier()
        c0, t0 = cpu_seconds(), time.perf_counter()
        fut = None
        if mode == "floor":
            dcp.save(sd, checkpoint_id=cid, storage_writer=NullWriter(), planner=DefaultSavePlanner())
        elif mode == "floor+cache":
            dcp.save(
                sd, checkpoint_id=cid, storage_writer=NullWriter(), planner=FloorCachePlanner(enable_plan_caching=True)
            )
        elif mode == "fs":
            dcp.save(sd, storage_writer=FileSystemWriter(str(fs_root / cid)), planner=DefaultSavePlanner())
        elif mode == "async":
            fut = dcp.async_save(sd, storage_writer=FileSystemWriter(str(fs_root / cid)), planner=DefaultSavePlanner())
        elif mode == "tier":
            dcp.save(sd, checkpoint_id=cid, storage_writer=tier, planner=DefaultSavePlanner())
        elif mode == "tier+cache":
            dcp.save(sd, checkpoint_id=cid, storage_writer=tier, planner=TierCachePlanner(enable_plan_caching=True))
        else:
            raise ValueError(mode)
        t1, c1 = time.perf_counter(), cpu_seconds()
        if fut is not None:
            fut.result()
        if mode.startswith("tier"):
            tier.wait()
        t2, c2 = time.perf_counter(), cpu_seconds()
        if mode in ("fs", "async"):
            dist.barrier()
            if rank == 0:
                shutil.rmtree(fs_root / cid, ignore_errors=True)
        return t1 - t0, c1 - c0, c2 - c0, t2 - t0

    def record(mode: str, r: tuple) -> None:
        m = out["modes"].setdefault(mode, {"blocked_s": [], "cpu_blocked_s": [], "cpu_total_s": [], "total_s": []})
        for k, v in zip(("blocked_s", "cpu_blocked_s", "cpu_total_s", "total_s"), r):
            m[k].append(v)

    if a.phase == "main":
        modes = a.modes.split(",")
        for rep in range(a.warmup + a.reps):
            k = rep % len(modes)
            for mode in modes[k:] + modes[:k]:
                r = run(mode, f"{mode.replace('+', '-')}-{rep:03d}")
                if rep >= a.warmup:
                    record(mode, r)
    else:  # restart: a new process on the same tier, unchanged model
        target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
        t0 = time.perf_counter()
        dcp.load(target, checkpoint_id="latest", storage_reader=TieredReader(_tier_config(str(work / "tier"))))
        out["load_s"] = time.perf_counter() - t0
        record("tier+cache first", run("tier+cache", f"restart{a.tag}-first"))
        out["seeded"] = plancache.status().seeded
        for rep in range(a.warmup + a.reps):
            for mode in ("floor+cache", "tier+cache"):
                r = run(mode, f"restart{a.tag}-{mode.replace('+', '-')}-{rep:03d}")
                if rep >= a.warmup:
                    record(mode, r)
    tier.wait()
    Path(a.result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


# -- parent side ---------------------------------------------------------------------------------


def launch(ranks: int, args: list[str], work: Path, timeout: float) -> list[dict]:
    """Run ``--worker ARGS`` on ``ranks`` ranks (real processes, gloo); each rank's result, or exit."""
    from tierckpt.testing.launch import launch_ranks

    codes, logs = launch_ranks(
        ranks,
        lambda r: [sys.executable, __file__, "--worker", *args, "--result", str(work / f"result{r}.json")],
        work,
        timeout=timeout,
        env_of=lambda r: {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    if any(c != 0 for c in codes):
        tails = "\n".join(f"--- rank {r}\n" + logs[r][-3000:] for r in range(ranks))
        raise SystemExit(f"bench workers failed (exit codes {codes}):\n{tails}")
    return [json.loads((work / f"result{r}.json").read_text()) for r in range(ranks)]


def summarize(per_rank: list[dict]) -> dict:
    """Per mode: per repetition the slowest rank's blocked time and the CPU summed over ranks; medians."""
    out = {}
    for mode in per_rank[0]["modes"]:
        ms = [r["modes"][mode] for r in per_rank]
        n = len(ms[0]["blocked_s"])
        blocked = [max(m["blocked_s"][i] for m in ms) for i in range(n)]
        cpu_b = [sum(m["cpu_blocked_s"][i] for m in ms) for i in range(n)]
        cpu_t = [sum(m["cpu_total_s"][i] for m in ms) for i in range(n)]
        total = [max(m["total_s"][i] for m in ms) for i in range(n)]
        out[mode] = {
            "blocked_ms": [round(x * 1e3, 2) for x in blocked],
            "median_ms": round(statistics.median(blocked) * 1e3, 2),
            "cpu_blocked_s": round(statistics.median(cpu_b), 4),
            "cpu_total_s": round(statistics.median(cpu_t), 4),
            "complete_ms": round(statistics.median(total) * 1e3, 2),
        }
    return out


def ratios(s: dict) -> dict:
    r = {}
    if "tier" in s and "floor" in s:
        r["tier/floor"] = round(s["tier"]["median_ms"] / s["floor"]["median_ms"], 3)
    if "tier+cache" in s and "floor+cache" in s:
        r["tier+cache/floor+cache"] = round(s["tier+cache"]["median_ms"] / s["floor+cache"]["median_ms"], 3)
    if "floor+cache" in s and "floor" in s:
        r["floor+cache/floor"] = round(s["floor+cache"]["median_ms"] / s["floor"]["median_ms"], 3)
    if "tier+cache first" in s and "floor+cache" in s:
        r["restart first/floor+cache"] = round(s["tier+cache first"]["median_ms"] / s["floor+cache"]["median_ms"], 3)
    return r


def print_tables(runs: list[dict]) -> None:
    print("\nblocked in dcp.save (median of the slowest rank per repetition), CPU s summed over ranks")
    hdr = f"{'ranks':>5} {'tensors':>7}  {'mode':<17} {'blocked ms':>10} {'ratio':>6} {'cpu in call':>11} {'cpu total':>9} {'complete ms':>11}"
    print(hdr)
    print("-" * len(hdr))
    for run in runs:
        for phase in ("main", "restart"):
            s = run.get(phase)
            if not s:
                continue
            for mode, m in s.items():
                floor = "floor+cache" if mode.startswith("tier+cache") else ("floor" if mode == "tier" else None)
                ratio = f"{m['median_ms'] / s[floor]['median_ms']:.2f}x" if floor and floor in s else ""
                name = mode if phase == "main" else f"restart {mode}"
                print(
                    f"{run['ranks']:>5} {run['tensors']:>7}  {name:<17} {m['median_ms']:>10.1f} {ratio:>6} "
                    f"{m['cpu_blocked_s']:>11.3f} {m['cpu_total_s']:>9.3f} {m['complete_ms']:>11.1f}"
                )
        print()
    modes = [m for m in MODES if any(m in r.get("main", {}) for r in runs)]
    print("growth: median blocked ms by ranks x tensors per rank")
    keys = [(r["ranks"], r["tensors"]) for r in runs]
    print(f"{'mode':<12} " + " ".join(f"{f'{k[0]}r x {k[1]}':>12}" for k in keys))
    for mode in modes:
        cells = []
        for r in runs:
            m = r.get("main", {}).get(mode)
            cells.append(f"{m['median_ms']:>12.1f}" if m else f"{'':>12}")
        print(f"{mode:<12} " + " ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--tensors", default="600,6000")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--mib", type=float, default=20.0, help="MiB of tensors per rank")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-restart", action="store_true")
    ap.add_argument("--restarts", type=int, default=3, help="restarted jobs per configuration (one first save each)")
    ap.add_argument("--quick", action="store_true", help="2 ranks, 600 tensors, 3 repetitions")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "bench_planning.json"))
    ap.add_argument("--dir", default=str(REPO / "bench-out"))
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument(
        "--nice", type=int, default=0, help="add to the niceness of the bench processes (negative: root only)"
    )
    ap.add_argument(
        "--no-gc-collect",
        dest="gc_collect",
        action="store_false",
        help="do not run gc.collect() before each timed save (full collections then land at random)",
    )
    # worker-only
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="main", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="0", help=argparse.SUPPRESS)
    ap.add_argument("--tensors-one", type=int, dest="tensors_one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.tensors = a.tensors_one
        worker(a)
        return
    if a.quick:
        a.ranks, a.tensors, a.reps = "2", "600", 3
    if a.nice:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + a.nice)  # the workers inherit it
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    runs = []
    started = time.time()
    load0 = os.getloadavg()
    for ranks in [int(x) for x in a.ranks.split(",")]:
        for tensors in [int(x) for x in a.tensors.split(",")]:
            work = Path(tempfile.mkdtemp(prefix=f"planning-{ranks}r-{tensors}t-", dir=a.dir))
            try:
                common = [
                    "--work",
                    str(work),
                    "--tensors-one",
                    str(tensors),
                    "--mib",
                    str(a.mib),
                    "--reps",
                    str(a.reps),
                    "--warmup",
                    str(a.warmup),
                ] + ([] if a.gc_collect else ["--no-gc-collect"])
                t0 = time.time()
                main_res = launch(ranks, common + ["--phase", "main", "--modes", a.modes], work, a.timeout)
                run: dict[str, Any] = {"ranks": ranks, "tensors": tensors, "main": summarize(main_res)}
                if not a.no_restart and "tier+cache" in a.modes.split(","):
                    restarts = [
                        launch(
                            ranks,
                            common + ["--phase", "restart", "--tag", str(i), "--reps", str(max(1, a.reps // 2))],
                            work,
                            a.timeout,
                        )
                        for i in range(a.restarts)
                    ]
                    merged = [
                        {
                            "modes": {
                                m: {k: sum((rs[r]["modes"][m][k] for rs in restarts), []) for k in v}
                                for m, v in restarts[0][r]["modes"].items()
                            }
                        }
                        for r in range(ranks)
                    ]
                    run["restart"] = summarize(merged)
                    run["restart_load_s"] = max(r.get("load_s", 0.0) for rs in restarts for r in rs)
                    run["restart_seeded"] = [all(r.get("seeded") for r in rs) for rs in restarts]
                run["ratios"] = ratios(run["main"]) | {
                    k: v for k, v in ratios(run.get("restart", {})).items() if k.startswith("restart")
                }
                run["wall_s"] = round(time.time() - t0, 1)
                runs.append(run)
                print(f"{ranks} ranks x {tensors} tensors: {json.dumps(run['ratios'])} ({run['wall_s']} s)", flush=True)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    import torch

    doc = {
        "bench": "planning",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "host": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "load_avg_start": load0,
            "load_avg_end": os.getloadavg(),
        },
        "mib_per_rank": a.mib,
        "reps": a.reps,
        "warmup": a.warmup,
        "gc_collect_before_each_save": a.gc_collect,
        "restarts": a.restarts,
        "nice": a.nice,
        "elapsed_s": round(time.time() - started, 1),
        "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print_tables(runs)
    print(f"\nJSON: {a.out}")


if __name__ == "__main__":
    main()
