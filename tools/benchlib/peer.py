"""Section ``peer`` (only with ``--only``): losing a node with and without ``[peer] replicas``.

2 simulated nodes x 2 ranks (``{node}`` paths, real processes, gloo), S3 behind them. Side by side
in one run: the same saves with ``replicas = 0`` and ``1`` (blocked time, time until every hop
committed, CPU), then node n1's directory is deleted and the 4 ranks resume ``latest``: from the
peer copies (replicas = 1) versus from S3 (replicas = 0: n1's files exist only there).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib.common import Ctx, GiB, MiB, log, med, row
from benchlib.s3clients import S3_BUCKET, S3_CONC, S3_PART, start_s3_server
from benchlib.timeline import write_timeline
from tierckpt.catalog.listing import committed_in_order
from tierckpt.config import config_from_dict
from tierckpt.testing import run_world
from tierckpt.tiers import make_tiers

WORKER = Path(__file__).with_name("peer_worker.py")


def _conf(base: Path, replicas: int, url: str, prefix: str) -> dict:
    from tierckpt.config import S3Config

    s3 = dataclasses.asdict(
        S3Config(bucket=S3_BUCKET, prefix=prefix, endpoint_url=url, part_size=S3_PART, concurrency=S3_CONC, keep=0)
    )
    return {
        "host": {"buffer_size": "256MiB", "chunk_size": "16MiB"},
        "local": {"path": f"{base}/{{node}}", "keep": 3, "flush_threads": 2},
        "peer": {"replicas": replicas},
        "s3": s3,
        "job": {"commit_timeout": 300.0},
    }


def _toml(cfg: dict) -> str:
    """The bench's configuration dict as TOML (flat sections of scalars; None values left out)."""
    lines = []
    for sec, body in cfg.items():
        lines.append(f"[{sec}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in body.items() if v is not None]
    return "\n".join(lines) + "\n"


def _fetch_n1(base: Path, cfg: dict) -> float:
    """``tierckpt-restore fetch latest --no-peers`` on the replacement node n1 (what an operator runs
    to rebuild its disk from S3 before the job resumes; here n0's directory is readable, so
    ``--no-peers`` keeps the copies out of it); seconds."""
    conf = base / "n1.toml"
    conf.write_text(_toml(cfg))
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "restore", "--config", str(conf), "fetch", "latest", "--quiet", "--no-peers"],
        check=True,
        env=dict(os.environ, TIERCKPT_NODE="n1"),
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    return time.perf_counter() - t0


TRAIN = {"iters": 40, "every": 10, "n": 384, "reps": 72}  # ~3 s between saves: the hops keep up (steady state)


def _training_cost(
    ctx: Ctx, tmp: Path, url: str, world: int, nodes: Any, mib: int, reps: int
) -> tuple[dict[int, dict], str]:
    """The same training loop (:func:`peer_worker.train`) with ``replicas`` 0 and 1, interleaved
    ``reps`` times: what the peer copies cost the loop end to end. The first replicas = 1 loop's
    timeline is drawn (the second value: where it went)."""
    timeline = "timeline: not drawn"
    out: dict[int, dict] = {r: {"loop": [], "drain": [], "cpu": []} for r in (0, 1)}
    for rep in range(reps):
        for replicas in (1, 0):
            base = tmp / f"train{replicas}-{rep}"
            cfg = _conf(base, replicas, url, f"peer-bench-train{replicas}-{rep}")
            res = run_world(
                world,
                "train",
                {"config": cfg, "mib": mib, **TRAIN},
                base / "run",
                script=WORKER,
                node_of=nodes,
                timeout=1800,
            )
            out[replicas]["loop"].append(max(r["loop_s"] for r in res))
            out[replicas]["drain"].append(max(r["drain_s"] for r in res))
            out[replicas]["cpu"].append(sum(r["cpu_s"] for r in res))
            if replicas == 1 and rep == 0:
                timeline = write_timeline(
                    ctx, "peer", [base / "n0", base / "n1"], what="training loop, replicas=1, saves never waited for"
                )
            shutil.rmtree(base, ignore_errors=True)
    log(f"peer: training loop {out}")
    return out, timeline


RPO_STEPS = [10, 20, 30, 40, 50, 60]
RPO_INTERVAL = 0.3


def _work_lost(ctx: Ctx, tmp: Path, url: str, world: int, nodes: Any, mib: int) -> dict[int, dict]:
    """Per ``replicas`` (0, 1): train-like saves that never wait, the job killed as soon as the
    newest checkpoint is safe somewhere, node n1's disk lost, then a resume: which step it gets."""
    out: dict[int, dict] = {}
    for replicas in (1, 0):
        base = tmp / f"rpo{replicas}"
        cfg = _conf(base, replicas, url, f"peer-bench-rpo{replicas}")
        lost = run_world(
            world,
            "save_and_lose",
            {"config": cfg, "steps": RPO_STEPS, "mib": mib, "interval": RPO_INTERVAL},
            base / "save",
            script=WORKER,
            node_of=nodes,
            timeout=1800,
        )
        if not all(r.get("safe") for r in lost):
            raise RuntimeError(f"peer bench: the newest checkpoint never became safe with replicas={replicas}: {lost}")
        shutil.rmtree(base / "n1")
        s3 = make_tiers(config_from_dict(cfg))[-1]
        try:
            on_s3 = [c.step for c in committed_in_order(s3)]
        finally:
            s3.close()
        back = run_world(
            world,
            "resume_latest",
            {"config": cfg, "mib": mib},
            base / "resume",
            script=WORKER,
            node_of=nodes,
            timeout=1800,
        )
        bad = [b for b in back if b.get("bad") or "id" not in b]
        if bad:
            raise RuntimeError(f"peer bench: resume after the node loss (replicas={replicas}) was not exact: {bad}")
        out[replicas] = {
            "newest": RPO_STEPS[-1],
            "resumed": int(back[0]["id"].split("-")[-1]),
            "s3_newest": max((s for s in on_s3 if s is not None), default=None),
            "resume_s": max(b["load_s"] for b in back),
        }
        log(f"peer: work lost with replicas={replicas}: {out[replicas]}")
    return out


def section_peer(ctx: Ctx) -> dict:
    mib = 16 if ctx.quick else 64  # per rank and step
    steps = [1, 2, 3, 4]  # step 1 warms up (process groups, pool, plans): figures are steps 2..4
    world = 4
    reps = 2 if ctx.quick else 3
    nodes = lambda r: f"n{r // 2}"  # noqa: E731
    tmp = ctx.work / "peer"
    url, stop, server = start_s3_server("seaweedfs", tmp / "s3")
    rows: list[dict] = []
    notes: list[str] = [server]
    ratios: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    try:
        res: dict[int, dict] = {}
        cfgs: dict[int, dict] = {}
        for replicas in (0, 1):
            base = tmp / f"r{replicas}"
            cfgs[replicas] = _conf(base, replicas, url, f"peer-bench-r{replicas}")
            res[replicas] = {
                "save": run_world(
                    world,
                    "save_steps",
                    {"config": cfgs[replicas], "steps": steps, "mib": mib},
                    base / "save",
                    script=WORKER,
                    node_of=nodes,
                    timeout=1800,
                ),
                "resumes": [],
            }
            shutil.rmtree(base / "n1")  # node n1 lost, with its disk

        def resume(replicas: int, what: str) -> list[dict]:
            back = run_world(
                world,
                "resume",
                {"config": cfgs[replicas], "step": steps[-1], "mib": mib},
                tmp / f"r{replicas}" / what,
                script=WORKER,
                node_of=nodes,
                timeout=1800,
            )
            bad = [b for b in back if b["bad"] or b["id"] != f"step-{steps[-1]}"]
            if bad:
                raise RuntimeError(f"peer bench: resume with replicas={replicas} was not exact: {bad}")
            return back

        for rep in range(reps):  # interleaved: from the peer copies, then reading S3 during the load
            for replicas in (1, 0):
                res[replicas]["resumes"].append(max(b["load_s"] for b in resume(replicas, f"resume{rep}")))
                shutil.rmtree(tmp / f"r{replicas}" / "n1", ignore_errors=True)  # nothing the load left there
        log(f"peer: resume from copies {res[1]['resumes']}, reading S3 {res[0]['resumes']}")
        res[0]["fetch_s"] = _fetch_n1(tmp / "r0", cfgs[0])  # the other way back: rebuild n1's disk, then load
        res[0]["after_fetch"] = max(b["load_s"] for b in resume(0, "after-fetch"))
        nbytes = world * mib * MiB
        for replicas in (0, 1):
            sv = res[replicas]["save"]
            blocked = [max(r["blocked_s"][i] for r in sv) for i in range(1, len(steps))]
            total = [max(r["total_s"][i] for r in sv) for i in range(1, len(steps))]
            cpu = sum(sum(r["cpu_s"][1:]) for r in sv)
            rows.append(row(f"save, replicas={replicas}: dcp.save blocked (slowest rank)", blocked, nbytes))
            rows.append(
                row(
                    f"save, replicas={replicas}: until committed on every hop",
                    total,
                    nbytes,
                    note=f"CPU {cpu:.2f} s over {len(steps) - 1} saves x {world} ranks",
                )
            )
            res[replicas]["cpu"] = cpu
        extra_cpu = res[1]["cpu"] - res[0]["cpu"]
        replicated = (len(steps) - 1) * nbytes
        cpu_per_gib = extra_cpu / (replicated / GiB)
        b0 = med([max(r["blocked_s"][i] for r in res[0]["save"]) for i in range(1, len(steps))])
        b1 = med([max(r["blocked_s"][i] for r in res[1]["save"]) for i in range(1, len(steps))])
        ratios["blocked replicas=1 / replicas=0"] = b1 / b0 if b0 else None
        ratios["CPU s per replicated GiB"] = cpu_per_gib
        t_peer, t_s3 = med(res[1]["resumes"]), med(res[0]["resumes"])
        rows.append(
            row(
                "resume after losing n1: from peer copies (replicas=1)",
                res[1]["resumes"],
                nbytes,
                note="n1's ranks receive their files from n0",
            )
        )
        rows.append(
            row(
                "resume after losing n1: load reading S3 (replicas=0)",
                res[0]["resumes"],
                nbytes,
                note="n1's ranks read their files from S3 during the load",
            )
        )
        t_fetch, t_after = res[0]["fetch_s"], res[0]["after_fetch"]
        rows.append(
            row(
                "resume after losing n1: fetch from S3 + load (replicas=0)",
                [t_fetch + t_after],
                nbytes,
                note=f"tierckpt-restore fetch latest on n1 {t_fetch:.2f} s (process included) + load {t_after:.2f} s",
            )
        )
        ratios["resume peers / (S3 fetch + load) (time)"] = t_peer / (t_fetch + t_after)
        targets["resume peers / (S3 fetch + load) (time)"] = ("<=", 0.5)
        ratios["resume peers / load reading S3 (time)"] = t_peer / t_s3
        notes.append(
            f"2 nodes x 2 ranks, {mib} MiB per rank and step, steps {steps} (figures: 2..), each save waited for; [s3] part "
            f"{S3_PART // MiB} MiB x {S3_CONC}; resume = slowest rank's dcp.load of its own tensors + shared "
            f"ones, in fresh processes, {reps} interleaved repeats, latest = step-{steps[-1]} in both cases (every save was waited for, "
            "so S3 was not behind; with promotion lagging, replicas=0 would resume an older step)"
        )
        cost, timeline = _training_cost(ctx, tmp, url, world, nodes, mib, reps)
        notes.append(timeline)
        for replicas in (0, 1):
            rows.append(
                row(
                    f"training loop, replicas={replicas}: {TRAIN['iters']} steps, a save every {TRAIN['every']}",
                    cost[replicas]["loop"],
                    nbytes * (TRAIN["iters"] // TRAIN["every"]),
                    note=f"slowest rank; then wait() {med(cost[replicas]['drain']):.2f} s; "
                    f"CPU {med(cost[replicas]['cpu']):.1f} s (all ranks)",
                )
            )
        ratios["training loop replicas=1 / replicas=0 (time)"] = med(cost[1]["loop"]) / med(cost[0]["loop"])
        targets["training loop replicas=1 / replicas=0 (time)"] = ("<=", 1.03)
        rpo = _work_lost(ctx, tmp, url, world, nodes, mib)
        for replicas in (0, 1):
            r = rpo[replicas]
            rows.append(
                row(
                    f"work lost with n1, replicas={replicas}: resumed step-{r['resumed']} of {r['newest']} saved",
                    [r["resume_s"]],
                    nbytes,
                    note=f"newest on S3 when the job died: step-{r['s3_newest']}; load of the step, then the state",
                )
            )
        ratios["steps lost with n1, replicas=1"] = rpo[1]["newest"] - rpo[1]["resumed"]
        ratios["steps lost with n1, replicas=0"] = rpo[0]["newest"] - rpo[0]["resumed"]
        targets["steps lost with n1, replicas=1"] = ("<=", 0)
        notes.append(
            f"training loop: 4 ranks, each {TRAIN['iters']} steps of {TRAIN['reps']} single-threaded "
            f"{TRAIN['n']}x{TRAIN['n']} matmuls, dcp.save of its {mib} MiB every {TRAIN['every']} steps, never "
            "waited for (S3 promotion in both runs); interleaved; 2 cores shared by 4 ranks and every background "
            "thread, so any CPU the copies take shows in the loop"
        )
        notes.append(
            f"work lost: {len(RPO_STEPS)} saves of {mib} MiB per rank, {RPO_INTERVAL} s of simulated compute between "
            "saves, nothing waited for; every rank dies (os._exit) the moment the newest checkpoint reached its "
            "first safe place (peer copies committed with replicas=1, the local commit with replicas=0), n1's "
            "directory is deleted, and 4 fresh ranks load latest"
        )
        notes.append(
            f"CPU per replicated GiB: (CPU with replicas=1 - CPU with replicas=0) / {replicated / GiB:.2f} GiB "
            "copied, all ranks, whole save processes"
        )
    finally:
        stop()
    shutil.rmtree(tmp, ignore_errors=True)
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes, "server": server}
