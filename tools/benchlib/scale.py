"""Section ``scale`` (only with ``--only``): what tierckpt's coordination costs per rank as the job grows.

For each N of ``--scale-ranks`` (default 2,4,8,16), :func:`tierckpt.testing.scale.run_scale` runs a
job of N real processes (2 ranks per simulated node, ``[local] path = ".../{node}"`` + ``[s3]`` on
moto in a child process; each rank 1 MiB of its own, a replicated tensor and the step) through a
save, a restart with every file on the local disks, a node loss and a full loss, plus the same save
and load with DCP's ``FileSystemWriter``/``FileSystemReader`` as the baseline; every rank counts
its S3 requests, object-collective bytes, store operations and collective rounds
(:mod:`tierckpt.testing.counting`).

:func:`report` is the part a simulator plugs into: it takes a list of per-N result dicts (each
``{"world": N, "source": "real" | "sim" | ..., "phases": {phase: summary}}``, a summary as
:func:`tierckpt.testing.scale.summarize` makes it) and returns the table rows, the fitted exponent
of every count against N (log-log least squares, per source) and the projection against S3's
documented per-prefix request rates; :func:`print_report` prints it.
"""

from __future__ import annotations

import math
import resource
import shutil
import time
from collections import Counter
from typing import Any

from benchlib.common import Ctx, log
from tierckpt.testing.scale import LOAD_PHASES, run_scale

S3_WRITE_RATE = 3500.0
"""S3's documented PUT/COPY/POST/DELETE requests per second per partitioned prefix."""
S3_READ_RATE = 5500.0
"""S3's documented GET/HEAD requests per second per partitioned prefix."""
SAVE_INTERVAL_S = 600.0
"""A checkpoint every 10 minutes (the projection's cadence)."""
PROJECT_TO = (1024, 4096, 16384)
FIT_MIN_N = 4
"""Exponents are fitted over the N >= this (the issue's range: 4..16 real ranks) when two or more are there."""

TABLE_PHASES = ("first_save", "save", "restart", "node_loss", "full_loss")
BASELINE = {
    "first_save": "dcp_save",
    "save": "dcp_save",
    "restart": "dcp_load",
    "node_loss": "dcp_load",
    "full_loss": "dcp_load",
}
METRICS = ("s3_requests", "s3_read", "s3_write", "obj_recv_bytes", "store_ops", "rounds", "p2p_recv_bytes", "groups")
SHORT_OP = {
    "GetObject": "GET",
    "HeadObject": "HEAD",
    "ListObjectsV2": "LIST",
    "PutObject": "PUT",
    "DeleteObject": "DEL",
    "DeleteObjects": "DELS",
    "ListMultipartUploads": "LISTMPU",
    "CopyObject": "COPY",
    "CreateMultipartUpload": "MPU",
    "UploadPart": "PART",
    "CompleteMultipartUpload": "CMPU",
    "AbortMultipartUpload": "ABORT",
}


# -- the report (real rows now, simulator rows later) ---------------------------------------------


def fit_exponent(points: list[tuple[float, float]]) -> dict[str, float] | None:
    """Least-squares line through (log N, log value) of the points with value > 0:
    ``{"k": slope, "a": intercept, "n": points used}``; None with fewer than two distinct N."""
    pts = [(math.log(n), math.log(v)) for n, v in points if v and v > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    k = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return {"k": k, "a": my - k * mx, "n": len(pts)}


def _predict(fit: dict[str, float] | None, n: int) -> float | None:
    return None if fit is None else math.exp(fit["a"] + fit["k"] * math.log(n))


def _rows(results: list[dict]) -> list[dict]:
    rows = []
    for res in sorted(results, key=lambda r: (r.get("source", "real"), r["world"])):
        for ph in TABLE_PHASES:
            s = res["phases"].get(ph)
            if s is None:
                continue
            base = res["phases"].get(BASELINE[ph], {})
            n = res["world"]
            g = s.get
            rows.append(
                {
                    "source": res.get("source", "real"),
                    "world": n,
                    "phase": ph,
                    "s3_requests": s["s3_requests"],
                    "s3_per_rank": s["s3_requests"] / n,
                    "s3_read": s["s3_read"],
                    "s3_write": s["s3_write"],
                    "s3_per_rank_max": g("s3_per_rank_max"),
                    "s3_by_op": g("s3_by_op", {}),
                    "s3_retries": g("s3_attempts", s["s3_requests"]) - s["s3_requests"],
                    "obj_recv_bytes": g("obj_recv_bytes"),
                    "dcp_obj_recv_bytes": base.get("obj_recv_bytes"),
                    "obj_vs_dcp": (g("obj_recv_bytes") or 0) / base["obj_recv_bytes"]
                    if base.get("obj_recv_bytes")
                    else None,
                    "store_ops": g("store_ops"),
                    "store_polls": g("store_polls", 0),
                    "rounds": g("rounds"),
                    "dcp_rounds": base.get("rounds"),
                    "p2p_recv_bytes": g("p2p_recv_bytes", 0),
                    "groups": g("groups"),
                }
            )
    return rows


def _exponents(results: list[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """source -> phase -> metric -> fit (DCP's baseline phases included), over N >= :data:`FIT_MIN_N`
    when that leaves two N or more."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for src in sorted({r.get("source", "real") for r in results}):
        mine = [r for r in results if r.get("source", "real") == src]
        if len({r["world"] for r in mine if r["world"] >= FIT_MIN_N}) >= 2:
            mine = [r for r in mine if r["world"] >= FIT_MIN_N]
        phases = sorted({ph for r in mine for ph in r["phases"]})
        out[src] = {
            ph: {
                m: fit_exponent([(r["world"], r["phases"][ph].get(m, 0)) for r in mine if ph in r["phases"]])
                for m in METRICS
            }
            for ph in phases
        }
    return out


def _projection(results: list[dict], fits: dict) -> list[dict]:
    """Per phase and N (every measured N, then :data:`PROJECT_TO`): S3 reads and writes per job
    (measured, else extrapolated with the fitted exponent of the largest-N source), the seconds one
    prefix needs to serve them at S3's documented rates, and for a save the share of a 10-minute
    checkpoint interval."""
    out = []
    by_n = {r["world"]: r for r in results}  # an N given by two sources: the later one in the list counts
    src = max(results, key=lambda r: r["world"]).get("source", "real") if results else "real"
    for ph in ("save", "restart", "node_loss", "full_loss"):
        for n in sorted(set(by_n) | set(PROJECT_TO)):
            if n in by_n and ph in by_n[n]["phases"]:
                rd, wr = by_n[n]["phases"][ph]["s3_read"], by_n[n]["phases"][ph]["s3_write"]
                how = f"counted ({by_n[n].get('source', 'real')})"
            else:
                f = fits.get(src, {}).get(ph, {})
                rd, wr, how = _predict(f.get("s3_read"), n), _predict(f.get("s3_write"), n), f"extrapolated ({src} fit)"
                if rd is None and wr is None:
                    continue
            rd, wr = rd or 0.0, wr or 0.0
            secs = max(rd / S3_READ_RATE, wr / S3_WRITE_RATE)
            out.append(
                {
                    "phase": ph,
                    "world": n,
                    "how": how,
                    "s3_read": rd,
                    "s3_write": wr,
                    "s3_requests": rd + wr,
                    "seconds_at_one_prefix": secs,
                    "share_of_interval": secs / SAVE_INTERVAL_S if ph == "save" else None,
                    "avg_rate_per_s_every_10min": (rd + wr) / SAVE_INTERVAL_S if ph == "save" else None,
                }
            )
    return out


def _targets(rows: list[dict], fits: dict) -> tuple[dict[str, Any], dict[str, tuple[str, float]]]:
    """The issue's targets, evaluated at the largest measured N of the real rows (reported, not asserted)."""
    real = [r for r in rows if r["source"] == "real"]
    if not real:
        return {}, {}
    n = max(r["world"] for r in real)
    at = {r["phase"]: r for r in real if r["world"] == n}
    ratios: dict[str, Any] = {}
    targets: dict[str, tuple[str, float]] = {}

    def put(name: str, value: Any, op: str, limit: float) -> None:
        ratios[name] = value
        targets[name] = (op, limit)

    if "save" in at:
        put(f"save at N={n}: S3 requests per job - N", at["save"]["s3_requests"] - n, "<=", 10)
    if "restart" in at:
        put(f"restart (all local) at N={n}: S3 requests per job", at["restart"]["s3_requests"], "<=", 10)
    if "full_loss" in at:
        put(f"full loss at N={n}: S3 requests per rank", at["full_loss"]["s3_per_rank"], "<=", 3)
    for ph in LOAD_PHASES:
        if ph in at and at[ph]["obj_vs_dcp"] is not None:
            put(f"{ph} at N={n}: object-collective bytes / DCP FileSystemReader's", at[ph]["obj_vs_dcp"], "<=", 1.5)
    rf = fits.get("real", {})
    k = (rf.get("full_loss", {}).get("s3_requests") or {}).get("k")
    if k is not None:
        put("full loss: exponent of S3 requests vs N", k, "<=", 1.05)
    kt, kd = (
        (rf.get("restart", {}).get("obj_recv_bytes") or {}).get("k"),
        (rf.get("dcp_load", {}).get("obj_recv_bytes") or {}).get("k"),
    )
    if kt is not None and kd is not None:
        put("restart: object-bytes exponent - DCP load's", kt - kd, "<=", 0.1)
    return ratios, targets


def report(results: list[dict]) -> dict[str, Any]:
    """The hook for every source of rows: per-N result dicts in, ``{"rows", "exponents", "projection",
    "ratios", "targets"}`` out (JSON-able). Rows of different ``source`` are fitted apart.

    A result dict: ``{"world": N, "source": "real" | "sim" | ..., "phases": {phase: summary}}`` with
    phases among :data:`TABLE_PHASES` (and ``dcp_save``/``dcp_load`` for the baseline columns). A
    summary needs ``s3_requests``, ``s3_read``, ``s3_write`` (S3's rate classes,
    :func:`tierckpt.testing.scale.s3_class`); ``s3_by_op``, ``s3_per_rank_max``, ``obj_recv_bytes``,
    ``rounds``, ``p2p_recv_bytes``, ``store_ops``, ``groups`` are shown when present (a simulator
    maps its own counts onto these names). The projection extrapolates from the source of the
    largest N given."""
    rows = _rows(results)
    fits = _exponents(results)
    ratios, targets = _targets(rows, fits)
    return {
        "rows": rows,
        "exponents": fits,
        "projection": _projection(results, fits),
        "ratios": ratios,
        "targets": targets,
    }


# -- printing ---------------------------------------------------------------------------------


def _n(v: Any) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def _kb(b: float | None) -> str:
    return "-" if b is None else f"{b / 1000:.1f}KB"


def _ops(by_op: dict[str, int]) -> str:
    return " ".join(f"{SHORT_OP.get(k, k)} {v}" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1]))


def print_report(rep: dict[str, Any]) -> None:
    print("\n== scale: counts per phase (all ranks of the job unless 'per rank') ==")
    print(
        f"{'src':<4} {'N':>5} {'phase':<10} | {'S3 req':>6} {'/rank':>6} {'max/rk':>6} {'rd':>5} {'wr':>5} | "
        f"{'obj bytes':>9} {'DCP':>8} {'x DCP':>6} | {'rounds':>6} {'DCP':>4} | {'store':>6} {'polls':>5} | "
        f"{'p2p':>8} {'grp':>3} | S3 by op"
    )
    for r in rep["rows"]:
        print(
            f"{r['source']:<4} {r['world']:>5} {r['phase']:<10} | {_n(r['s3_requests']):>6} {r['s3_per_rank']:>6.1f} "
            f"{_n(r['s3_per_rank_max']):>6} {_n(r['s3_read']):>5} {_n(r['s3_write']):>5} | {_kb(r['obj_recv_bytes']):>9} "
            f"{_kb(r['dcp_obj_recv_bytes']):>8} {'-' if r['obj_vs_dcp'] is None else format(r['obj_vs_dcp'], '.1f'):>6} | "
            f"{_n(r['rounds']):>6} {_n(r['dcp_rounds']):>4} | {_n(r['store_ops']):>6} "
            f"{_n(r['store_polls']):>5} | {_kb(r['p2p_recv_bytes']):>8} {_n(r['groups']):>3} | {_ops(r['s3_by_op'])}"
            + (f" (+{r['s3_retries']} retries)" if r["s3_retries"] else "")
        )
    print("\n== scale: fitted exponent k (count ~ N^k, log-log least squares) ==")
    for src, phases in rep["exponents"].items():
        print(f"{'src':<4} {'phase':<10} | " + " ".join(f"{m:>14}" for m in METRICS))
        for ph, fits in phases.items():
            print(
                f"{src:<4} {ph:<10} | "
                + " ".join(f"{'-' if f is None else format(f['k'], '.2f'):>14}" for f in (fits[m] for m in METRICS))
            )
    print(
        f"\n== scale: projection against S3's per-prefix rates ({S3_WRITE_RATE:.0f} PUT/COPY/POST/DELETE, "
        f"{S3_READ_RATE:.0f} GET/HEAD per s; LIST counted as GET) =="
    )
    print(f"{'phase':<10} {'N':>6} {'how':<24} | {'reads':>10} {'writes':>10} | {'s at 1 prefix':>13} | note")
    for p in rep["projection"]:
        note = (
            f"{100 * p['share_of_interval']:.2f}% of a 10-min interval; {p['avg_rate_per_s_every_10min']:.1f} req/s on average"
            if p["phase"] == "save"
            else "the whole job restarting at once"
        )
        print(
            f"{p['phase']:<10} {p['world']:>6} {p['how']:<24} | {p['s3_read']:>10.0f} {p['s3_write']:>10.0f} | "
            f"{p['seconds_at_one_prefix']:>13.2f} | {note}"
        )


def print_sites(res: dict[str, Any], phases: tuple[str, ...] = ("save", "restart", "node_loss", "full_loss")) -> dict:
    """Where each phase's S3 requests come from at this N: per call site (operation <- tierckpt
    call chain), the count on rank 0, the mean over the other ranks, and the job's total."""
    out: dict[str, list[dict]] = {}
    n = res["world"]
    for ph in phases:
        per_rank = res.get("per_rank", {}).get(ph)
        if not per_rank:
            continue
        total: Counter = Counter()
        for d in per_rank:
            total.update(d["s3"]["sites"])
        print(f"\n== scale: where the S3 requests of '{ph}' come from at N={n} (rank 0 | mean of the others | job) ==")
        out[ph] = []
        for site, k in total.most_common():
            r0 = per_rank[0]["s3"]["sites"].get(site, 0)
            others = (k - r0) / (n - 1) if n > 1 else 0.0
            out[ph].append({"site": site, "rank0": r0, "others_mean": others, "job": k})
            print(f"{r0:>4} | {others:>6.2f} | {k:>5} | {site}")
    return out


# -- simulated rows ----------------------------------------------------------------------------

SIM_PHASES = {"restart": "restart", "node_loss": "node_loss", "full_loss": "full_loss"}


def simulated(n: int) -> dict:
    """One ``source: "sim"`` result: :mod:`tierckpt.testing.simulator` runs the load's own
    coordination code for ``n`` simulated ranks (2 per node) after each scenario, counting S3
    requests, object-collective bytes, rounds and point-to-point bytes as the real rows do."""
    from tierckpt.testing.simulator import build_job, simulate_load

    phases: dict[str, dict] = {}
    t0 = time.perf_counter()
    c0 = time.process_time()
    for phase, scenario in SIM_PHASES.items():
        out = simulate_load(build_job(n, 2), scenario)
        by_op = Counter(out["s3_by_op"])
        phases[phase] = {
            "world": n,
            "s3_requests": out["s3_requests"],
            "s3_by_op": dict(by_op),
            "s3_read": sum(v for op, v in by_op.items() if op in ("GetObject", "HeadObject", "ListObjectsV2")),
            "s3_write": sum(v for op, v in by_op.items() if op not in ("GetObject", "HeadObject", "ListObjectsV2")),
            "s3_per_rank_max": out["s3_max_per_rank"],
            "obj_recv_bytes": out["collective_bytes"],
            "rounds": out["collective_rounds"],
            "p2p_recv_bytes": out["p2p_bytes"],
        }
    return {
        "world": n,
        "source": "sim",
        "phases": phases,
        "wall_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
    }


# -- the section ------------------------------------------------------------------------------


def section_scale(ctx: Ctx) -> dict:
    import dataclasses

    from benchlib.s3clients import S3_BUCKET, start_s3_server
    from tierckpt.config import S3Config

    ranks = [int(x) for x in str(ctx.args.scale_ranks).split(",") if x.strip()]
    if ctx.quick:
        ranks = [n for n in ranks if n <= 4] or ranks[:1]
    tmp = ctx.work / "scale"
    url, stop, server = start_s3_server("moto", tmp / "s3")
    results: list[dict] = []
    notes = [server]
    runs: list[dict] = []
    try:
        for n in ranks:
            s3 = dataclasses.asdict(
                S3Config(
                    bucket=S3_BUCKET,
                    prefix=f"scale-{n}",
                    endpoint_url=url,
                    part_size=5 << 20,
                    concurrency=4,
                    max_attempts=5,
                )
            )
            c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            log(f"scale: {n} ranks ...")
            res = run_scale(n, s3, tmp / f"n{n}", ranks_per_node=2, timeout=1800)
            c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            res["wall_s"] = time.perf_counter() - t0
            res["rank_cpu_s"] = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
            log(f"scale: {n} ranks done in {res['wall_s']:.0f} s (ranks' CPU {res['rank_cpu_s']:.0f} s)")
            runs.append({"world": n, "wall_s": res["wall_s"], "rank_cpu_s": res["rank_cpu_s"]})
            results.append(res)
            shutil.rmtree(tmp / f"n{n}", ignore_errors=True)
    finally:
        stop()
    sim_ranks = [int(x) for x in str(getattr(ctx.args, "sim_ranks", "") or "").split(",") if x.strip()]
    if ctx.quick:
        sim_ranks = [n for n in sim_ranks if n <= 1024]
    for n in sim_ranks:
        log(f"scale: simulating {n} ranks ...")
        results.append(simulated(n))
    rep = report(results)
    print_report(rep)
    sites = {
        res["world"]: print_sites(res)
        for res in results
        if ranks and res.get("source", "real") == "real" and res["world"] == max(ranks)
    }
    notes.append(
        "each N: 2 ranks per simulated node, [local] '.../{node}' (no fsync) + [s3] (moto, 5 MiB parts); "
        "1 MiB per rank + a 16 KiB replicated tensor + the step; two saves (first_save, save: each waited until "
        "committed on every tier), then fresh processes dcp.load('latest'): restart (every file local), node_loss "
        "(last node's directory deleted), full_loss (every local directory deleted); DCP = FileSystemWriter/Reader "
        "on one shared directory, same state"
    )
    notes.append(
        "S3 req = API calls (a LIST page is one); obj bytes = pickled bytes each rank received through "
        "all_gather_object/broadcast_object_list/gather_object/scatter_object_list from other ranks (own object "
        "excluded), summed over ranks; rounds = collective calls (object + tensor, p2p excluded) of the busiest rank; "
        "store = store ops of all ranks (polls that found nothing apart: timing-dependent); p2p = bytes received by "
        "irecv/recv (peer file service); grp = process groups created per rank"
    )
    notes += [f"N={r['world']}: {r['wall_s']:.0f} s wall, ranks' CPU {r['rank_cpu_s']:.0f} s" for r in runs]
    notes += [
        f"sim N={r['world']}: {r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} CPU-s (three scenarios)"
        for r in results
        if r.get("source") == "sim"
    ]
    return {
        "rows": [],
        "ratios": rep["ratios"],
        "targets": rep["targets"],
        "notes": notes,
        "report": rep,
        "sites": sites,
        "results": results,
    }
