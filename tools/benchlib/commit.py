"""Section ``commit``: how fast a small single-tier checkpoint commits, and whether commits keep up
with a save-every-step loop (issue #32, item 8).

One process saves a ~14 MiB state (``make_state``) every step: ``dcp.save`` with a
``TieredWriter`` on one local tier (``keep = 3``, a 512 MiB host pool: 256 MiB with ``--quick``,
so captures can run far ahead of commits if commits are slow), then ``wait_captured()``, as a
training loop with ``attach(optimizer)`` does, for ``N`` steps (200; 60 with ``--quick``); once
with fsync on, once with it off (the commit path alone, without a loaded disk's fsync latency). Per save it records when it was captured, durable (its file written) and
committed (its metadata written), from the futures of ``writer.last``; after each
``wait_captured()`` it counts the saves captured but not committed yet (the *lag*, in steps).

First row: the first save right after ``TieredWriter(cfg)`` with a fresh 1 GiB pool (until
captured, until committed). Then per loop: commit latency (durable -> committed, per save: median and p99 in ms), capture ->
committed, and the loop (wall time, captures and commits per second, the largest and the final
lag, CPU seconds of the process per save). Only the public API and the save's futures are used,
so the same section runs against an older tierckpt (``PYTHONPATH``) for a before/after.
"""

from __future__ import annotations

import statistics
import threading
from typing import Any

import torch.distributed.checkpoint as dcp

from benchlib.common import Ctx, GiB, MiB, cpu_seconds, log, make_state, now, rm, row, tensor_bytes
from tierckpt import HostConfig, LocalConfig, TierConfig, TieredWriter

STATE = 14 * MiB


def _p(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``xs`` by nearest rank; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _loop(ctx: Ctx, fsync: bool, steps: int, pool: int) -> tuple[list[dict], dict[str, float]]:
    """One save-every-step loop on a fresh local tier; its rows and its ratios."""
    tag = "fsync on" if fsync else "fsync off"
    d = ctx.work / f"commit-{'fsync' if fsync else 'nofsync'}"
    cfg = TierConfig(
        host=HostConfig(buffer_size=pool, chunk_size=16 * MiB),
        local=LocalConfig(path=str(d), keep=3, flush_threads=2, fsync=fsync),
    )
    sd = make_state(STATE, seed=11)
    nbytes = tensor_bytes(sd)
    w = TieredWriter(cfg)
    marks: list[dict[str, float]] = []
    lock = threading.Lock()

    def mark(rec: dict[str, float], what: str) -> Any:
        def done(_f: Any) -> None:
            with lock:
                rec[what] = now()

        return done

    log(f"commit ({tag}): {steps} saves of {nbytes / MiB:.1f} MiB, one every step (pool {pool // MiB} MiB)")
    # warm-up save (pool allocation, DCP's first-call costs); not counted
    dcp.save(sd, checkpoint_id="warm-0", storage_writer=w)
    w.wait()
    lags: list[int] = []
    cpu0, t0 = cpu_seconds(), now()
    for s in range(1, steps + 1):
        sd["step"] = s
        dcp.save(sd, checkpoint_id=f"step-{s}", storage_writer=w)
        w.wait_captured()
        job = w.last
        rec: dict[str, float] = {"captured": now()}
        marks.append(rec)
        job.durable.add_done_callback(mark(rec, "durable"))
        job.committed.add_done_callback(mark(rec, "committed"))
        with lock:
            lags.append(sum(1 for r in marks if "committed" not in r))
    loop_s = now() - t0
    with lock:
        lag_end = sum(1 for r in marks if "committed" not in r)
    w.wait()
    all_s = now() - t0
    cpu = cpu_seconds() - cpu0
    rm(d)
    with lock:
        commit = [r["committed"] - r["durable"] for r in marks]
        e2e = [r["committed"] - r["captured"] for r in marks]
        in_loop = sum(1 for r in marks if r["committed"] <= t0 + loop_s)
    p50, p99 = statistics.median(commit), _p(commit, 0.99) or 0.0
    e50, e99 = statistics.median(e2e), _p(e2e, 0.99) or 0.0
    rows = [
        row(
            f"{tag}: commit latency (durable -> committed)",
            commit,
            note=f"per save, {steps} saves: median {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms",
            p50_ms=p50 * 1e3,
            p99_ms=p99 * 1e3,
        ),
        row(
            f"{tag}: capture -> committed",
            e2e,
            note=f"median {e50 * 1e3:.1f} ms, p99 {e99 * 1e3:.1f} ms",
            p50_ms=e50 * 1e3,
            p99_ms=e99 * 1e3,
        ),
        row(
            f"{tag}: save-every-step loop",
            [loop_s],
            nbytes * steps,
            note=(
                f"until the last capture: {steps / loop_s:.1f} captures/s, {in_loop / loop_s:.1f} commits/s; "
                f"lag max {max(lags)} steps, at the last capture {lag_end}; all committed after {all_s:.2f} s; "
                f"CPU {cpu:.2f} s ({cpu / steps * 1e3:.1f} ms/save)"
            ),
            captures_per_s=steps / loop_s,
            commits_per_s=in_loop / loop_s,
            lag_max_steps=max(lags),
            lag_end_steps=lag_end,
            cpu_s=cpu,
            cpu_s_per_gib=cpu / (nbytes * steps / GiB),
        ),
    ]
    key = "fsync" if fsync else "nofsync"
    ratios = {f"{key}_commits_per_capture_in_loop": in_loop / steps, f"{key}_lag_max_steps": float(max(lags))}
    return rows, ratios


def _first_save(ctx: Ctx) -> dict:
    """The first save right after ``TieredWriter(cfg)`` with a fresh 1 GiB pool (the default size;
    32 MiB more, so that no pool of an earlier section is reused): seconds until captured and
    until committed (the pool's first touch runs meanwhile)."""
    d = ctx.work / "commit-first"
    cfg = TierConfig(host=HostConfig(buffer_size=GiB + 32 * MiB), local=LocalConfig(path=str(d), keep=3))
    sd = make_state(STATE, seed=12)
    t0 = now()
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id="first-1", storage_writer=w)
    w.wait_captured()
    captured = now() - t0
    w.last.committed.result()
    committed = now() - t0
    w.wait()
    rm(d)
    return row(
        "first save after TieredWriter() (fresh 1 GiB pool)",
        [committed],
        note=f"captured after {captured:.3f} s, committed after {committed:.3f} s (fsync on)",
        captured_s=captured,
        committed_s=committed,
    )


def section_commit(ctx: Ctx) -> dict:
    steps = 60 if ctx.quick else 200
    pool = (256 if ctx.quick else 512) * MiB
    rows: list[dict] = [_first_save(ctx)]
    ratios: dict[str, float] = {}
    for fsync in (True, False):
        r, q = _loop(ctx, fsync, steps, pool)
        rows += r
        ratios |= q
    notes = [
        f"one local tier (keep 3), pool {pool // MiB} MiB, state {STATE / MiB:.0f} MiB; dcp.save + "
        "wait_captured() every step; lag = saves captured but not committed, counted after each "
        "wait_captured(); CPU = this process, all threads, over the loop and the final wait(); "
        "with fsync on a commit pays two fsyncs (metadata file, directory) behind the data files' writes"
    ]
    return {"rows": rows, "notes": notes, "ratios": ratios, "targets": {"nofsync_lag_max_steps": ("<=", 5)}}
