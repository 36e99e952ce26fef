"""Case ``filetimes``: file times changed under committed checkpoints never change ``latest``."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import torch

from chaoslib.core import BUCKET, CaseResult, load_state, make_state, short, toml_text
from chaoslib.env import Env
from chaoslib.loss import expect_only, open_tier, run_cli, save_series, with_keep
from restore import find_latest, gc_checkpoints, list_all, open_tiers
from restore.catalog import key_path
from tierckpt.catalog.listing import committed_in_order, list_checkpoints
from tierckpt.config import TierConfig, config_from_dict
from tierckpt.testing import compare as diff

# == case: filetimes ================================================================================

PERTURBATIONS = ("older touched into the future", "newest set into the past", "older restored from a copy")


def perturb(env: Env, rng: random.Random, cfg: TierConfig, order: list[str]) -> list[str]:
    """Change the file times (never the contents) of committed checkpoints, 1-3 ways; returns how.
    S3 cannot set times: objects are re-put (LastModified = now) or deleted and put back."""
    kinds = rng.sample(PERTURBATIONS, rng.randint(1, 3))
    now, restored = time.time(), rng.choice(order[:-1])
    tiers = {name: t for name in ("local", "s3") if (t := open_tier(cfg, name)) is not None}
    try:
        objs = {name: {c.checkpoint_id: c.objects for c in list_checkpoints(t)} for name, t in tiers.items()}
    finally:
        for t in tiers.values():
            t.close()
    s3c = env.client() if "s3" in objs else None

    def files(cid: str) -> list[Path]:  # metadata last, as a careful operator restores
        return sorted(
            (key_path(cfg.local.resolved_path(), o.key) for o in objs["local"][cid].values()),
            key=lambda p: p.name == "metadata.json",
        )

    def keys(cid: str) -> list[str]:
        return sorted(
            (f"{cfg.s3.prefix}/{o.key}" for o in objs.get("s3", {}).get(cid, {}).values()),
            key=lambda k: k.endswith("metadata.json"),
        )

    def s3get(k: str) -> bytes:
        return s3c.get_object(Bucket=BUCKET, Key=k)["Body"].read()

    for kind in kinds:
        if kind == PERTURBATIONS[0]:
            for cid in order[:-1]:
                t = now + rng.uniform(3600, 365 * 86400)
                for p in files(cid):
                    os.utime(p, (t, t))
                for k in keys(cid):
                    s3c.put_object(Bucket=BUCKET, Key=k, Body=s3get(k))
        elif kind == PERTURBATIONS[1]:
            t = now - rng.uniform(86400, 10 * 365 * 86400)
            for p in files(order[-1]):
                os.utime(p, (t, t))
        else:
            for p in files(restored):
                data = p.read_bytes()
                p.unlink()
                p.write_bytes(data)  # a new file, fresh times: a restore from a backup
            blobs = {k: s3get(k) for k in keys(restored)}
            for k in reversed(blobs):
                s3c.delete_object(Bucket=BUCKET, Key=k)
            for k, data in blobs.items():
                s3c.put_object(Bucket=BUCKET, Key=k, Body=data)
    return kinds


def check_newest(res: CaseResult, trial: str, cfg: TierConfig, cfg_path: Path, order: list[str], states: dict) -> None:
    """``latest`` (restore.find_latest per tier and over both, the CLI, TieredReader) is the newest
    commit and loads bit-exact; ``list`` (library, CLI, each tier) is in commit order."""
    newest = order[-1]
    tiers = open_tiers(cfg)
    try:
        found = {"both tiers": find_latest(tiers).checkpoint_id} | {
            t.name: find_latest([t]).checkpoint_id for t in tiers
        }
        listed = {"restore.list_all": [x.checkpoint_id for x in list_all(tiers) if x.committed_anywhere]}
        listed |= {f"commit order on {t.name}": [c.checkpoint_id for c in committed_in_order(t)] for t in tiers}
    finally:
        for t in tiers:
            t.close()
    rc, out = run_cli(["--config", str(cfg_path), "latest"])
    found["tierckpt-restore latest"] = out.strip() if rc == 0 else f"exit {rc}"
    rc, out = run_cli(["--config", str(cfg_path), "list", "--json"])
    listed["tierckpt-restore list"] = [x["checkpoint_id"] for x in json.loads(out) if x["committed"]] if rc == 0 else []
    for what, got in found.items():
        if got != newest:
            res.fail(trial, f"latest ({what}) is {got}, the newest commit is {newest}")
    for what, got in listed.items():
        if got != order:
            res.fail(trial, f"{what}: {got} != commit order {order}")
    try:
        got_sd, reader = load_state(cfg, states[newest], "latest")
    except BaseException as e:  # noqa: BLE001
        res.lose(trial, f"latest does not load: {short(e)}")
        return
    cid = reader.resolved_id
    if cid not in states or diff(states[cid], got_sd):
        res.lose(trial, f"latest ({cid}) loaded WRONG bytes")
    elif cid != newest:
        res.fail(trial, f"latest (TieredReader) is {cid}, the newest commit is {newest}")


def case_filetimes(env: Env, trials: int, seed: int) -> CaseResult:
    """File times never decide what is newest: 3-5 checkpoints saved (local + S3; some by a new job,
    ids sometimes out of step order), then :func:`perturb` (sometimes followed by a new job's save).
    ``latest`` and ``list`` (:func:`check_newest`) follow the commit order, the newest loads
    bit-exact, gc keep=1 (library or CLI) leaves exactly the newest per tier (deleting it: lost)."""
    res = CaseResult("filetimes")
    t0 = time.perf_counter()
    for i in range(trials):
        rng = random.Random(f"{seed}-filetimes-{i}")
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        d = env.fresh("filetimes")
        cfgd = env.config(d, local_keep=0, s3_keep=0, fsync=False)
        cfg = config_from_dict(cfgd)
        cfg_path = d / "tiers.toml"
        cfg_path.write_text(toml_text(cfgd))
        n = rng.randint(3, 5)
        steps = list(range(1, n + 2))
        if rng.random() < 0.25:  # commit order is the truth, whatever the ids say
            rng.shuffle(steps)
            res.note("ids out of step order")
        cids = [f"step-{s:06d}" for s in steps]
        sd = make_state(rng.randrange(1 << 20), big=256 << 10)
        trial = f"#{i}"
        try:
            states = save_series(cfg, sd, g, cids[:n], rng, new_job=0.3)
            did = perturb(env, rng, cfg, list(states))
            trial = f"#{i} {' + '.join(did)}"
            for x in did:
                res.note(x)
            if rng.random() < 0.4:  # a new job after the changes numbers its commit after all of them
                states |= save_series(cfg, sd, g, cids[n:])
                res.note("a new job saved after the changes")
                trial += " + new save"
            order = list(states)
            check_newest(res, trial, cfg, cfg_path, order, states)
            keep1 = with_keep(cfgd, 1)
            if rng.random() < 0.5:
                gc_checkpoints(config_from_dict(keep1))
            else:
                (d / "keep1.toml").write_text(toml_text(keep1))
                if (rc := run_cli(["--config", str(d / "keep1.toml"), "gc"])[0]) != 0:
                    res.fail(trial, f"tierckpt-restore gc exited {rc}")
            expect_only(res, trial, cfg, order[-1], states[order[-1]], "after gc keep=1")
        except BaseException as ex:  # noqa: BLE001
            res.fail(trial, f"harness error: {type(ex).__name__}: {ex}")
        res.trials += 1
        env.cleanup(d, cfgd)
    res.seconds = time.perf_counter() - t0
    return res
