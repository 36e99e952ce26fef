"""Section ``peer`` (only with ``--only``): losing a node with and without ``[peer] replicas``.

2 simulated nodes x 2 ranks (``{node}`` paths, real processes, gloo), S3 behind them. Side by side
in one run: the same saves with ``replicas = 0`` and ``1`` (blocked time, time until every hop
committed, CPU), then node n1's directory is deleted and the 4 ranks resume ``latest``: from the
peer copies (replicas = 1) versus from S3 (replicas = 0: n1's files exist only there).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from tierckpt.testing import run_world

from benchlib.common import Ctx, GiB, MiB, log, med, row
from benchlib.s3 import S3_BUCKET, S3_CONC, S3_PART, start_s3_server

WORKER = Path(__file__).with_name("peer_worker.py")


def _conf(base: Path, replicas: int, url: str, prefix: str) -> dict:
    from tierckpt.config import S3Config

    s3 = dataclasses.asdict(S3Config(bucket=S3_BUCKET, prefix=prefix, endpoint_url=url, part_size=S3_PART,
                                     concurrency=S3_CONC, keep=0))
    return {"host": {"buffer_size": "256MiB", "chunk_size": "16MiB"},
            "local": {"path": f"{base}/{{node}}", "keep": 3, "flush_threads": 2},
            "peer": {"replicas": replicas}, "s3": s3, "job": {"commit_timeout": 300.0}}


def section_peer(ctx: Ctx) -> dict:
    mib = 16 if ctx.quick else 64  # per rank and step
    steps = [1, 2, 3]
    world = 4
    nodes = lambda r: f"n{r // 2}"  # noqa: E731
    tmp = ctx.work / "peer"
    url, stop, server = start_s3_server("seaweedfs", tmp / "s3")
    rows: list[dict] = []
    notes: list[str] = [server]
    ratios: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    try:
        res: dict[int, dict] = {}
        for replicas in (0, 1):
            base = tmp / f"r{replicas}"
            cfg = _conf(base, replicas, url, f"peer-bench-r{replicas}")
            out = run_world(world, "save_steps", {"config": cfg, "steps": steps, "mib": mib}, base / "save",
                            script=WORKER, node_of=nodes, timeout=1800)
            shutil.rmtree(base / "n1")  # node n1 lost, with its disk
            back = run_world(world, "resume", {"config": cfg, "step": steps[-1], "mib": mib}, base / "resume",
                             script=WORKER, node_of=nodes, timeout=1800)
            bad = [b for b in back if b["bad"] or b["id"] != f"step-{steps[-1]}"]
            if bad:
                raise RuntimeError(f"peer bench: resume with replicas={replicas} was not exact: {bad}")
            res[replicas] = {"save": out, "resume": back}
            log(f"peer replicas={replicas}: resume {max(b['load_s'] for b in back):.2f} s")
        nbytes = world * mib * MiB
        for replicas in (0, 1):
            sv = res[replicas]["save"]
            blocked = [max(r["blocked_s"][i] for r in sv) for i in range(len(steps))]
            total = [max(r["total_s"][i] for r in sv) for i in range(len(steps))]
            cpu = sum(sum(r["cpu_s"]) for r in sv)
            rows.append(row(f"save, replicas={replicas}: dcp.save blocked (slowest rank)", blocked, nbytes))
            rows.append(row(f"save, replicas={replicas}: until committed on every hop", total, nbytes,
                            note=f"CPU {cpu:.2f} s over {len(steps)} saves x {world} ranks"))
            res[replicas]["cpu"] = cpu
        extra_cpu = res[1]["cpu"] - res[0]["cpu"]
        replicated = len(steps) * nbytes
        cpu_per_gib = extra_cpu / (replicated / GiB)
        b0 = med([max(r["blocked_s"][i] for r in res[0]["save"]) for i in range(len(steps))])
        b1 = med([max(r["blocked_s"][i] for r in res[1]["save"]) for i in range(len(steps))])
        ratios["blocked replicas=1 / replicas=0"] = b1 / b0 if b0 else None
        targets["blocked replicas=1 / replicas=0"] = ("<=", 1.03)
        ratios["CPU s per replicated GiB"] = cpu_per_gib
        t_peer = max(b["load_s"] for b in res[1]["resume"])
        t_s3 = max(b["load_s"] for b in res[0]["resume"])
        rows.append(row("resume after losing n1: from peer copies (replicas=1)", [t_peer], nbytes,
                        note=f"{sum(b['from_peers'] for b in res[1]['resume']) / MiB:.0f} MiB over the transport"))
        rows.append(row("resume after losing n1: from S3 (replicas=0)", [t_s3], nbytes,
                        note="n1's ranks read their files from S3"))
        ratios["resume peers / S3 (time)"] = t_peer / t_s3
        targets["resume peers / S3 (time)"] = ("<=", 0.5)
        notes.append(f"2 nodes x 2 ranks, {mib} MiB per rank and step, steps {steps}, each save waited for; [s3] part "
                     f"{S3_PART // MiB} MiB x {S3_CONC}; resume = slowest rank's dcp.load of its own tensors + shared "
                     f"ones, in fresh processes, latest = step-{steps[-1]} in both cases (every save was waited for, "
                     "so S3 was not behind; with promotion lagging, replicas=0 would resume an older step)")
        notes.append(f"CPU per replicated GiB: (CPU with replicas=1 - CPU with replicas=0) / {replicated / GiB:.2f} GiB "
                     "copied, all ranks, whole save processes")
    finally:
        stop()
    shutil.rmtree(tmp, ignore_errors=True)
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes, "server": server}
