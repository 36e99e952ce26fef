#!/usr/bin/env python
"""Side-by-side benchmark of tierckpt against the raw disk, ``torch.save`` and DCP's own writers.

    python tools/bench.py [--size-gib 2] [--cpu-gib 0.75] [--out bench-out/bench.json]
                          [--only local,cpu,lazy,e2e,rss,commit] [--dir DIR] [--repeats 3] [--quick] [--nice N]
                          [--s3-gib 0.5] [--s3-data DIR] [--s3-servers moto,seaweedfs]
                                                            (sections s3, restore, peer: --only s3,restore)
                          [--lazy-mib 96,192] [--e2e-every 1,2,4] [--e2e-iters 8] [--e2e-rounds 3]   (plot series)
                          [--scale-ranks 2,4,8,16]          (section scale: --only scale)

Sections (each a function returning a dict; ratios are computed within the run). Every section
counts CPU seconds (this process's user+system time, all threads) next to wall time where it
times something; tables show a CPU-s/GiB column when measured.

* ``local``: one ~``--size-gib`` state dict (a few dozen fp32/bf16 tensors of mixed sizes, a few
  small ones, non-tensor items). Saves: raw ``pwrite``+``fsync`` of the same byte count, buffered
  and with ``O_DIRECT`` from a page-aligned buffer into a preallocated file (1 and 2 threads; the
  best ``O_DIRECT`` one is the ceiling: the same I/O the local tier does), ``torch.save``+fsync,
  DCP ``FileSystemWriter`` (default and
  ``thread_count=4``), ``TieredWriter`` for two pool/chunk sizes (time until ``wait()``: durable and
  committed; the time blocked in ``dcp.save`` is reported too). Loads, page cache dropped before
  each when possible: ``torch.load`` + copy into the destination, DCP ``FileSystemReader`` and
  ``TieredReader`` into preallocated state dicts, verified once outside the timing. Measurements
  are interleaved (A B C A B C ...); median and min are reported.
* ``lazy``: an MLP trained with Adam, a checkpoint after every optimizer step; the time the
  training thread is blocked per checkpoint with sync ``dcp.save(FileSystemWriter)``,
  ``dcp.async_save`` (its default stager) and ``TieredWriter`` + ``attach(optimizer)``. With
  ``--lazy-mib 96,192,...`` once per state size (a ``series``: stall against state size).
* ``cpu``: CPU seconds per checkpointed GiB in steady state: a ~``--cpu-gib`` state saved again
  and again (each save waited for), newest 2 kept (TieredWriter ``keep=2``; DCP directories
  removed), blocks of saves interleaved over TieredWriter, sync ``FileSystemWriter`` and
  ``dcp.async_save``; per-thread breakdown from ``/proc/self/task`` and ``writer.stats``. Also
  TieredWriter with the capture checks (``verify_capture = "all"``/``"sample"`` + ``nonfinite =
  "warn"``): their ratio to off as whole-process figures and as (off + the checks' own CPU) / off.
* ``e2e``: a small GPT-style model trained on random tokens, a checkpoint every iteration: total
  wall time with no checkpoint, TieredWriter, ``dcp.async_save``, sync FileSystemWriter, in
  interleaved rounds (the no-checkpoint blocks of different rounds give the drift). With
  ``--e2e-every 1,2,4`` also with a checkpoint every k iterations, in the same rounds (a ``series``:
  overhead against the checkpoint interval); ``--e2e-iters``/``--e2e-rounds`` set the block length
  and the number of rounds.
  Then (``--e2e-s3``, SeaweedFS by default) the same training with [local] + [s3] on a loopback
  server, ``[s3] compression`` "none" vs "zstd" side by side (``tools/benchlib/e2e_s3.py``).
* ``s3`` (only with ``--only``): per server (moto in a subprocess, SeaweedFS ``weed mini``), on a
  ~256 MiB state (64 MiB ``--quick``), interleaved: raw boto3 multipart upload of our data file
  (same part size/concurrency, no checksums) vs our promotion (``promote_s``); TieredReader from
  S3 only vs raw parallel ranged GETs into preallocated buffers; s3torchconnector's DCP
  ``S3StorageWriter``/``S3StorageReader`` when it is installed.
* ``restore`` (only with ``--only``): node loss: ``fetch_checkpoint`` + ``dcp.load`` from the fetched
  copy vs raw ranged GETs of the same objects; ``consolidate_checkpoint`` to .safetensors/.pt vs
  ``dcp_to_torch_save`` of a FileSystemWriter copy, each in a fresh process (time, peak RSS).
* ``peer`` (only with ``--only``): 2 simulated nodes x 2 ranks with S3 (SeaweedFS) behind them:
  the same saves with ``[peer] replicas = 0`` and ``1`` (blocked time, time until every hop
  committed, CPU per replicated GiB), then node n1's directory is deleted and the 4 ranks resume
  ``latest``: from the peer copies vs from S3.
* ``scale`` (only with ``--only``): what coordination costs per rank as the job grows: for each N
  of ``--scale-ranks``, N real processes (2 per simulated node, ``{node}`` local paths + S3 on
  moto) count their S3 requests by kind, object-collective bytes, store operations and collective
  rounds through a save, a restart from local disks, a node loss and a full loss, beside DCP's
  ``FileSystemWriter``/``FileSystemReader``; a table per phase, the fitted exponent of each count
  vs N, where each phase's S3 requests come from (call sites) and a projection against S3's
  per-prefix request rates (``tools/benchlib/scale.py``).
* ``compress`` (only with ``--only``): compression by byte planes on real training state (ratios
  and speeds per category against zstd, blosc2, ZipNN and DCP's ZStandard extension), promotion
  through an S3 endpoint throttled to ``--throttle-mbs``, server-side copies in a 90%-frozen
  fine-tune (``tools/benchlib/compress.py``).
* ``rss``: peak RSS (psutil, sampled every 5 ms) of a fresh process during TieredWriter saves for
  pools of 1/4 and 1x of a ~1 GiB state (and ``dcp.async_save`` staging as a reference).
* ``commit``: commit latency of a small (~14 MiB) checkpoint on one local tier in a save-every-step
  loop (``dcp.save`` + ``wait_captured()``, keep 3, fsync on): durable -> committed per save
  (median, p99 ms), captures and commits per second, the lag in steps (captured, not committed),
  CPU seconds (``tools/benchlib/commit.py``).

The ``e2e`` and ``peer`` sections also draw the timeline of their tiered saves (each phase on each
rank against wall time, as ``tierckpt-restore timeline`` does) next to the JSON:
``<out stem>-e2e-timeline.png``, ``<out stem>-peer-timeline.png`` (needs matplotlib).

Every file it writes lives in a temporary directory under ``--dir`` (default: the repo's
``bench-out/``, which git ignores) and is removed at the end. The JSON goes to ``--out``.
A one-rank gloo process group is initialized for all DCP calls.

This file is the command line; each section lives in ``tools/benchlib/<section>.py`` and the
helpers they share in ``tools/benchlib/common.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from benchlib.commit import section_commit  # noqa: E402
from benchlib.common import Contention, Ctx, init_pg, log, machine_info, now, print_table  # noqa: E402
from benchlib.compress import section_compress  # noqa: E402
from benchlib.cpu import section_cpu  # noqa: E402
from benchlib.e2e import section_e2e  # noqa: E402
from benchlib.lazy import section_lazy  # noqa: E402
from benchlib.local import section_local  # noqa: E402
from benchlib.peer import section_peer  # noqa: E402
from benchlib.restore import consolidate_child, section_restore  # noqa: E402
from benchlib.rss import rss_child, section_rss  # noqa: E402
from benchlib.s3 import section_s3  # noqa: E402
from benchlib.scale import section_scale  # noqa: E402

SECTION_NAMES = ("local", "cpu", "lazy", "e2e", "rss", "commit", "s3", "restore", "peer", "scale", "compress")
DEFAULT_SECTIONS = (
    "local",
    "cpu",
    "lazy",
    "e2e",
    "rss",
    "commit",
)  # s3/restore/peer/scale/compress: only with --only (need S3 servers, add minutes)


SECTIONS: dict[str, Callable[[Ctx], dict]] = {
    "local": section_local,
    "cpu": section_cpu,
    "lazy": section_lazy,
    "e2e": section_e2e,
    "rss": section_rss,
    "commit": section_commit,
    "s3": section_s3,
    "restore": section_restore,
    "peer": section_peer,
    "scale": section_scale,
    "compress": section_compress,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-gib", type=float, default=2.0, help="state size of section local (default 2)")
    ap.add_argument("--s3-gib", default="0.5", help="state sizes of section s3, comma-separated (default 0.5)")
    ap.add_argument(
        "--sim-ranks",
        default="1024,2048,4096,8192,16384",
        help="simulated job sizes of section scale (tierckpt.testing.simulator), comma-separated; '' for none",
    )
    ap.add_argument(
        "--scale-ranks",
        default="2,4,8,16",
        help="job sizes of section scale, comma-separated (default 2,4,8,16; --quick keeps those <= 4)",
    )
    ap.add_argument(
        "--lazy-mib",
        default="",
        help="section lazy: target state sizes in MiB, comma-separated (default 320; 64 with --quick); "
        "several sizes give the stall-against-state-size series that tools/plot_bench.py draws",
    )
    ap.add_argument(
        "--e2e-every",
        default="1",
        help="section e2e: checkpoint intervals in iterations, comma-separated (default 1); several give "
        "the overhead-against-interval series that tools/plot_bench.py draws",
    )
    ap.add_argument(
        "--e2e-iters",
        type=int,
        default=None,
        help="section e2e: timed iterations per block (default 6; 3 with --quick)",
    )
    ap.add_argument(
        "--e2e-rounds",
        type=int,
        default=None,
        help="section e2e: interleaved rounds of blocks (default 2; 1 with --quick)",
    )
    ap.add_argument(
        "--s3-servers",
        default="moto,seaweedfs",
        help="sections s3: the servers to measure on, comma-separated (default moto,seaweedfs)",
    )
    ap.add_argument("--cpu-gib", type=float, default=0.75, help="state size of section cpu (default 0.75)")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "bench.json"), help="JSON output path")
    ap.add_argument(
        "--only",
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma-separated sections of {SECTION_NAMES} (default: {','.join(DEFAULT_SECTIONS)})",
    )
    ap.add_argument("--dir", default=str(REPO / "bench-out"), help="a temp dir is created (and removed) under it")
    ap.add_argument(
        "--throttle-mbs",
        default="250",
        help="section compress: upload bandwidths of the throttled S3 endpoint, MB/s, comma-separated (default 250)",
    )
    ap.add_argument(
        "--e2e-s3",
        default="seaweedfs",
        choices=("seaweedfs", "moto", "off"),
        help="section e2e: also train with an S3 hop on this loopback server, [s3] compression none vs zstd",
    )
    ap.add_argument(
        "--s3-data",
        default=None,
        help="where SeaweedFS keeps its data (default: under --dir, the local tier's disk; /dev/shm "
        "models an object store on other machines, whose disks this node does not share)",
    )
    ap.add_argument("--repeats", type=int, default=None, help="repeats in section local (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 repeat (development, < 2 minutes)")
    ap.add_argument(
        "--nice",
        type=int,
        default=0,
        help="add this to the process niceness first (negative needs root: less noise from other jobs)",
    )
    ap.add_argument("--_in-session", dest="in_session", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_rss-child", dest="rss_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_consolidate-child", dest="cons_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.s3_data:
        import benchlib.s3clients

        benchlib.s3clients.S3_DATA = Path(args.s3_data)

    if args.cons_child:
        print(json.dumps(consolidate_child(json.loads(args.cons_child))))
        return 0

    if args.rss_child:
        print(json.dumps(rss_child(json.loads(args.rss_child))))
        return 0

    if args.nice and not args.in_session:
        # With sched_autogroup, niceness only ranks threads inside one session: run the benchmark
        # in a session of its own and give that session's autogroup the niceness too.
        cmd = (
            [sys.executable, str(Path(__file__).resolve())]
            + list(sys.argv[1:] if argv is None else argv)
            + ["--_in-session"]
        )
        return subprocess.run(cmd, start_new_session=True).returncode
    if args.nice:
        with contextlib.suppress(OSError):
            Path("/proc/self/autogroup").write_text(f"{args.nice}\n")
        try:
            os.nice(args.nice)
        except OSError as e:
            log(f"--nice {args.nice} not applied: {e}")
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    for s in only:
        if s not in SECTIONS:
            ap.error(f"unknown section {s!r} (known: {', '.join(SECTION_NAMES)})")
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierckpt-bench-", dir=args.dir))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t_start = now()
    cmdline = [a for a in sys.argv if a != "--_in-session"]
    result: dict[str, Any] = {
        "command": " ".join(["python"] + cmdline),
        "machine": machine_info(work),
        "quick": args.quick,
        "sections": {},
    }
    ctx = Ctx(args, work)
    try:
        init_pg()
        for s in only:
            t0 = now()
            log(f"section {s} ...")
            probe = Contention()
            sec = SECTIONS[s](ctx)
            sec["section_wall_s"] = now() - t0
            sec["contention"] = probe.done()
            sec.setdefault("notes", []).append(Contention.line(sec["contention"]))
            result["sections"][s] = sec
            result["total_wall_s"] = now() - t_start
            out.write_text(json.dumps(result, indent=1, default=str))
            print_table(f"{s} ({sec['section_wall_s']:.0f} s)", sec)
            sys.stdout.flush()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()
    print(
        f"\nwrote {out}; total {now() - t_start:.0f} s; machine: {result['machine'].get('cpu_affinity')} cores, "
        f"torch {torch.__version__}, disk {result['machine'].get('disk_device')} ({work.parent})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
