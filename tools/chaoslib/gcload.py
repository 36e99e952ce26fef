"""Case ``gcload``: gc and keep=1 retention racing loads in another process."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from chaoslib.core import _TIERCKPT_TEXT, CaseResult, is_not_found, make_state, placeholder, short
from chaoslib.crash import read_events
from chaoslib.env import Env, tail, wait_proc
from chaoslib.loss import expect_only, save_series, state_digest, with_keep
from restore import gc_checkpoints
from tierckpt import CheckpointBeingDeleted, CorruptCheckpoint, TieredReader
from tierckpt.config import config_from_dict
from tierckpt.testing import errors_in, find_error

# == case: gcload ===================================================================================

GONE = re.compile(
    r"being deleted|was deleted|is not committed|not committed on|holds a committed copy|no committed checkpoint"
)


def classify(exc: BaseException) -> str:
    """A failed load: ``corrupt`` (CorruptCheckpoint, ChecksumMismatch or their texts), ``deleted
    under the reader`` (after it took its lease: a deletion ignored it), ``gone`` (being deleted,
    not committed) or ``unclear``."""
    texts = [str(e) for e in errors_in(exc)]
    if any(re.search(r"was deleted from .* while it was being read", t) for t in texts):
        return "deleted under the reader"
    if find_error(exc, CheckpointBeingDeleted) is not None:
        return "gone"  # a CorruptCheckpoint too (the resume loop's fallback), but no damage
    if find_error(exc, CorruptCheckpoint) is not None or (
        any(_TIERCKPT_TEXT.search(t) for t in texts) and not any(GONE.search(t) for t in texts)
    ):
        return "corrupt"
    return "gone" if is_not_found(exc) or any(GONE.search(t) for t in texts) else "unclear"


def _loader_child(payload: dict) -> int:
    """Zygote child: load ``target`` with one TieredReader until ``stop`` exists; a JSON line per load."""
    cfg = config_from_dict(payload["config"])
    like = make_state(payload["state_seed"], big=payload["big"])
    reader = TieredReader(cfg)
    deadline = time.monotonic() + 120
    with open(payload["results"], "a") as out:
        out.write('{"event": "start"}\n')
        out.flush()
        n = 0
        while not Path(payload["stop"]).exists() and time.monotonic() < deadline:
            n += 1
            target = placeholder(like)
            try:
                dcp.load(target, checkpoint_id=payload["target"], storage_reader=reader, no_dist=True)
                rec = {"n": n, "ok": True, "match": state_digest(target) == payload["digest"]}
            except BaseException as e:  # noqa: BLE001
                rec = {"n": n, "ok": False, "kind": classify(e), "err": short(e)}
            out.write(json.dumps(rec) + "\n")
            out.flush()
    return 0


def case_gcload(env: Env, trials: int, seed: int) -> CaseResult:
    """Deletions never pull a checkpoint from under a load: a child loads an older checkpoint in a
    loop (TieredReader, bit-exact check) while this process runs ``restore.gc.gc_checkpoints`` and/or
    saves a newer checkpoint, both with keep=1; sometimes the loader is SIGKILLed. Each load succeeds
    bit-exact or fails saying the checkpoint is being deleted / not committed: never CorruptCheckpoint
    or ChecksumMismatch, never deleted under its lease, never wrong bytes (lost). Then gc keep=1 must
    leave exactly the newest on each tier (no lease left behind), loading bit-exact."""
    res = CaseResult("gcload")
    t0 = time.perf_counter()
    for i in range(trials):
        rng = random.Random(f"{seed}-gcload-{i}")
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        d = env.fresh("gcload")
        use_s3 = env.has_s3 and rng.random() < 0.6
        cfgd = env.config(d, s3=use_s3, local_keep=0, s3_keep=0, fsync=False, buffer="4MiB", chunk="1MiB")
        cfg, keep1 = config_from_dict(cfgd), config_from_dict(with_keep(cfgd, 1))
        big, state_seed, n = rng.choice((1, 2, 4)) << 20, rng.randrange(1 << 20), rng.randint(2, 4)
        sd = make_state(state_seed, big=big)
        action, kill_loader = rng.choice(("gc", "save", "gc+save")), rng.random() < 0.3
        target = f"step-{rng.randint(1, n - 1):06d}"
        trial = f"#{i} {action}{' +S3' if use_s3 else ''}{', loader killed' if kill_loader else ''}"
        results, stop = d / "loads.jsonl", d / "stop"
        child = None

        def loads() -> list[dict]:
            return [e for e in read_events(results) if "n" in e]

        try:
            states = save_series(cfg, sd, g, [f"step-{k:06d}" for k in range(1, n + 1)])
            child = env.spawn(
                "loss-loader",
                {
                    "config": cfgd,
                    "target": target,
                    "state_seed": state_seed,
                    "big": big,
                    "digest": state_digest(states[target]),
                    "results": str(results),
                    "stop": str(stop),
                },
                d / "loader.out",
            )
            deadline = time.monotonic() + 60
            while not read_events(results) and child.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            if "gc" in action:
                hit = [a for a in gc_checkpoints(keep1).actions if a.checkpoint_id == target]
                res.note("gc deleted the target" if any(a.deleted for a in hit) else "gc spared the leased target")
            if "save" in action:
                states |= save_series(keep1, sd, g, [f"step-{n + 1:06d}"])
            seen = len(loads())
            want, deadline = seen + rng.randint(1, 3), time.monotonic() + 60
            while len(loads()) < want and child.is_alive() and time.monotonic() < deadline:
                time.sleep(0.005 if kill_loader else 0.02)
                if kill_loader and len(loads()) > seen:
                    time.sleep(rng.uniform(0.0, 0.05))  # most likely inside the next load
                    child.kill()
            stop.touch()
            if (rc := wait_proc(child, 60)) != 0 and not (kill_loader and rc in (-9, 137)):
                res.fail(trial, f"loader exited {rc}: {tail(d / 'loader.out')}")
            for r in loads():
                if r["ok"] and not r["match"]:
                    res.lose(trial, f"load #{r['n']} of {target} returned WRONG bytes without an error")
                elif not r["ok"] and r["kind"] != "gone":
                    res.fail(trial, f"load #{r['n']} of {target} failed with a {r['kind']} error: {r['err']}")
                res.note("load ok" if r["ok"] else f"load refused: {r['kind']}")
            gc_checkpoints(keep1)  # the loader is gone: nothing it held may keep the target now
            newest = list(states)[-1]
            expect_only(res, trial, cfg, newest, states[newest], "gc keep=1 after the loads")
        except BaseException as ex:  # noqa: BLE001
            res.fail(trial, f"harness error: {type(ex).__name__}: {ex}")
        finally:
            if child is not None and child.is_alive():
                child.kill()
                child.join(10)
        res.trials += 1
        env.cleanup(d, cfgd)
    res.seconds = time.perf_counter() - t0
    return res
