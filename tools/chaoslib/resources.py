"""Cases ``resources`` (RSS, threads and fds stay flat) and ``s3faults`` (a flaky S3 proxy)."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from chaoslib.core import BUCKET, CaseResult, MiB, is_clear, load_state, make_state, mutate, only, short
from chaoslib.env import ROOT, Env, tail, wait_proc
from chaoslib.faults import close_writer, expect_loads, save_wait
from tierckpt import TierckptError, TieredWriter
from tierckpt.catalog.listing import list_checkpoints
from tierckpt.config import config_from_dict
from tierckpt.testing import clone_state
from tierckpt.testing import compare as diff
from tierckpt.tiers import make_s3

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


def _growth(
    res: CaseResult, trial: str, what: str, s: list[dict], warmup: int, slack: dict[str, int], worst: dict[str, float]
) -> None:
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
        res.fail(
            trial,
            f"{what}: RSS keeps growing after warm-up: {slope:+.2f} MiB per step, "
            f"{ys[0]:.0f} -> {ys[-1]:.0f} MiB over {len(ys)} steps",
        )


def case_resources(
    env: Env, trials: int, seed: int, *, n: int = 30, loads: int = 16, warmup: int = 10, load_warmup: int = 8
) -> CaseResult:
    res = CaseResult("resources")
    t0 = time.perf_counter()
    worst_s: dict[str, float] = {}
    worst_l: dict[str, float] = {}
    for i in range(trials):
        rng = random.Random(f"{seed}-resources-{i}")
        d = env.fresh("resources")
        cfgd = env.config(d, local_keep=2, s3_keep=2, buffer="2MiB", chunk="256KiB", fsync=rng.random() < 0.5)
        out = d / "result.json"
        p = env.spawn(
            "resources",
            {
                "config": cfgd,
                "n": n,
                "loads": loads,
                "seed": rng.randrange(1 << 20),
                "big": 3 * MiB,
                "result": str(out),
            },
            d / "child.out",
        )
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
        _growth(
            res, trial, f"{loads} loads", data["loads"], load_warmup, {"rss": 24 * MiB, "threads": 1, "fds": 2}, worst_l
        )
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
    cfgds = [
        env.config(
            d,
            endpoint=proxy.url,
            prefix=f"chaos/{d.name}",
            local_keep=2,
            s3_keep=0,
            fsync=False,
            max_attempts=attempts,
            connect_timeout=2.0,
            read_timeout=5.0,
        )
        for attempts in (4, 1)
    ]
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
