"""Case ``deleterace``: a commit and a deletion of the same id never both succeed.

A deleter child (a zygote child, another process as ``tierckpt-restore gc`` would be) loops over
every tier: lists it, plans the deletion of every partial checkpoint (``keep = 0``: nothing
committed is ever due) and applies it under the lease protocol, pausing a random 0-150 ms right
after it found a checkpoint's metadata absent (its last look before deleting the data: the
window of issue 22). Meanwhile this process saves a few checkpoints, each waited for, in one of
three set-ups chosen per trial:

``promote``
    ``[local]`` + ``[s3]``; the copy to S3 is followed by a random 0-300 ms pause before its
    commit (a slow many-rank commit): the deleter sees the copy on S3 as a partial for that long.
``lapse``
    ``[local]`` only, the save's lease lives 0.3 s (never renewed) and the commit starts after a
    random 0-0.6 s: some saves' leases lapse before their commit, and the deleter may judge them
    dead. Such a save must fail (its lease lapsed), never commit.
``reuse``
    ``[local]`` (+ ``[s3]`` when available): a killed attempt left a partial of the id about to
    be saved, which the deleter is deleting when the new save of that id starts.

Checked afterwards: every checkpoint committed on a tier loads bit-exact from that tier alone
(else it is ``lost``); every save that reported success is committed on every tier; a save
that failed failed with a tierckpt error (never committed half).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import chaos_tiers
import torch

from chaoslib.core import CaseResult, make_state, mutate, only, short
from chaoslib.env import Env, tail, wait_proc
from chaoslib.faults import close_writer, expect_loads, save_wait
from chaoslib.loss import committed
from tierckpt import TierckptError, TieredWriter
from tierckpt.catalog import lease as leases
from tierckpt.catalog.listing import list_checkpoints
from tierckpt.chain.engine import close_all
from tierckpt.chain.retention import apply_retention, plan_retention
from tierckpt.config import config_from_dict
from tierckpt.format.layout import data_key
from tierckpt.testing import clone_state, find_error
from tierckpt.tiers import make_tiers

SETUPS = ("promote", "lapse", "reuse")


def _deleter_child(payload: dict) -> int:
    """Zygote child: delete every partial checkpoint on every tier, over and over, until ``stop``
    exists; pause ``window`` (random, up to ``pause`` s) between the metadata check and the data
    deletion. One JSON line per deletion in ``results``."""
    cfg = config_from_dict(payload["config"])
    tiers = make_tiers(cfg)
    rng = random.Random(payload["seed"])
    pause = float(payload["pause"])
    for t in tiers:
        real = t.exists

        def exists(key: str, real=real) -> bool:
            found = real(key)
            if not found and key.endswith("/metadata.json"):
                time.sleep(rng.uniform(0.0, pause))  # the window: metadata absent, data about to go
            return found

        t.exists = exists  # type: ignore[method-assign]
    deadline = time.monotonic() + 120
    with open(payload["results"], "a") as out:
        out.write('{"event": "start"}\n')
        out.flush()
        while not Path(payload["stop"]).exists() and time.monotonic() < deadline:
            for t in tiers:
                try:
                    infos = list_checkpoints(t)
                    plan = plan_retention(infos, keep=0, protect=set())
                    for cid in apply_retention(t, plan, infos):
                        out.write(json.dumps({"tier": t.name, "id": cid}) + "\n")
                        out.flush()
                except TierckptError as e:  # a listing racing a deletion: try again
                    out.write(json.dumps({"error": short(e)}) + "\n")
            time.sleep(0.002)
    return 0


class _Delays(chaos_tiers.Controller):
    """A random pause after each copy into S3 (``promote``), before its commit."""

    def __init__(self, rng: random.Random, upload: float) -> None:
        super().__init__()
        self.rng, self.upload = rng, upload

    def around(self, tier: str, op: str, key: str, fn):
        out = fn()
        if f"{tier}.{op}" == "s3.upload":
            time.sleep(self.rng.uniform(0.0, self.upload))
        return out


def _stale_partial(cfg, cid: str) -> None:
    """What a killed attempt leaves: a data file of ``cid`` without metadata, on every tier."""
    for t in make_tiers(cfg):
        try:
            t.put(data_key(cid, "rank-00000-0badf00d.data"), b"\x00" * 65536)
        finally:
            t.close()


def case_deleterace(env: Env, trials: int, seed: int) -> CaseResult:
    """See the module docstring."""
    res = CaseResult("deleterace")
    t0 = time.perf_counter()
    for i in range(trials):
        rng = random.Random(f"{seed}-deleterace-{i}")
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        setup = SETUPS[i % len(SETUPS)] if env.has_s3 else rng.choice(("lapse", "reuse"))
        d = env.fresh("deleterace")
        use_s3 = setup == "promote" or (setup == "reuse" and env.has_s3 and rng.random() < 0.5)
        cfgd = env.config(d, s3=use_s3, local_keep=0, s3_keep=0, fsync=False, buffer="4MiB", chunk="1MiB")
        cfg = config_from_dict(cfgd)
        n = rng.randint(2, 3)
        cids = [f"step-{k:06d}" for k in range(1, n + 1)]
        trial = f"#{i} {setup}{' +S3' if use_s3 else ''}"
        results, stop = d / "deletions.jsonl", d / "stop"
        child = writer = None
        ttl = leases.LEASE_TTL
        states: dict[str, dict] = {}
        outcome: dict[str, str] = {}
        try:
            if setup == "reuse":
                _stale_partial(cfg, cids[-1])
            child = env.spawn(
                "race-deleter",
                {
                    "config": cfgd,
                    "stop": str(stop),
                    "results": str(results),
                    "seed": rng.randrange(1 << 30),
                    "pause": 0.15,
                },
                d / "deleter.out",
            )
            deadline = time.monotonic() + 60
            while not results.exists() and child.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            sd = make_state(rng.randrange(1 << 20), big=rng.choice((1, 2)) << 20)
            writer = TieredWriter(cfg)
            if setup == "promote":
                chaos_tiers.wrap_engine(writer.engine, _Delays(rng, 0.3))
            if setup == "lapse":
                eng, real = writer.engine, writer.engine._check_file

                def late(job, real=real, r=random.Random(rng.random())):
                    time.sleep(r.uniform(0.0, 0.6))  # the commit starts late: the lease may have lapsed
                    real(job)

                eng._check_file = late
                leases.LEASE_TTL = 0.3
            for cid in cids:
                e = save_wait(writer, sd, cid)
                states[cid] = clone_state(sd)
                if e is None:
                    outcome[cid] = "ok"
                elif find_error(e, TierckptError) is None:
                    res.fail(trial, f"save {cid} failed with a non-tierckpt error: {short(e)}")
                else:
                    outcome[cid] = f"{type(find_error(e, TierckptError)).__name__}: {find_error(e, TierckptError)}"
                writer.wait_captured()
                mutate(sd, g)
        except BaseException as ex:  # noqa: BLE001
            res.fail(trial, f"harness error: {type(ex).__name__}: {ex}")
        finally:
            leases.LEASE_TTL = ttl
            stop.touch()
            if child is not None and wait_proc(child, 60) != 0:
                res.fail(trial, f"deleter exited abnormally: {tail(d / 'deleter.out')}")
            close_writer(writer)
            close_all()
        for why in outcome.values():
            # after a lapse the deleter may take the file at any stage: before the commit's check
            # ("vanished"), or the .partial before its rename ("cannot commit"): failed, not lost
            lapse = "lapsed" in why or (setup == "lapse" and ("vanished" in why or "cannot commit" in why))
            res.note(
                "saved"
                if why == "ok"
                else "save failed: lease lapsed"
                if lapse
                else "save failed: deletion under way"
                if "being deleted" in why
                else "save failed: other"
            )
            if why != "ok" and not lapse and "being deleted" not in why:
                res.note(f"other failure: {why[:80]}")
        try:
            com = committed(cfg)
            for tier, lst in com.items():
                have = {c for c, _ in lst}
                for cid in sorted(have):
                    if cid in states:
                        expect_loads(res, trial, only(cfg, tier), states[cid], cid, f"committed on {tier}")
                    else:
                        res.fail(trial, f"{cid} committed on {tier} without a save of it")
                for cid, why in outcome.items():
                    if why == "ok" and cid not in have:
                        res.fail(trial, f"save {cid} reported success but is not committed on {tier}")
            dels = [json.loads(x) for x in results.read_text().splitlines()[1:]] if results.exists() else []
            res.note("deletions", sum(1 for x in dels if "id" in x))
        except BaseException as ex:  # noqa: BLE001
            res.fail(trial, f"checking: {type(ex).__name__}: {ex}")
        res.trials += 1
        env.cleanup(d, cfgd)
    res.seconds = time.perf_counter() - t0
    return res
