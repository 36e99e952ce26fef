"""Case ``concurrency``: two writers save the same checkpoint id at the same moment."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

from chaoslib.core import CaseResult, is_clear, load_state, make_state, only, short
from chaoslib.env import Env, tail, wait_proc
from chaoslib.faults import close_writer, save_wait
from tierckpt import CommitConflict, TieredWriter
from tierckpt.config import TierConfig, config_from_dict
from tierckpt.testing import compare as diff
from tierckpt.testing import find_error

# == case: concurrency =============================================================================


def _concurrent_save_child(payload: dict) -> int:
    """Forked child: wait at the barrier file, save ``payload['seed']``'s state as ``payload['cid']``."""
    cfg = config_from_dict(payload["config"])
    sd = make_state(payload["seed"])
    writer = TieredWriter(cfg)
    go = Path(payload["go"])
    Path(payload["ready"]).write_text("1")
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    e = save_wait(writer, sd, payload["cid"])
    out = {
        "ok": e is None,
        "clear": e is None or is_clear(e),
        "conflict": e is not None and find_error(e, CommitConflict) is not None,
        "error": "" if e is None else short(e),
    }
    Path(payload["result"]).write_text(json.dumps(out))
    return 0


CONC_SCENARIOS = ("one-engine", "two-engines", "two-engines+s3", "two-nodes-one-s3", "two-processes")


def case_concurrency(env: Env, trials: int, seed: int, *, scenarios: tuple[str, ...] = CONC_SCENARIOS) -> CaseResult:
    """``scenarios`` are taken in turn (in a seeded order): ``one-engine`` (two writers with one
    configuration in one process share an engine), ``two-engines`` (configurations differing only
    in flush_threads, same local path), ``two-engines+s3`` (same local path and S3 prefix),
    ``two-nodes-one-s3`` (own local paths, same S3 prefix), ``two-processes`` (same local path,
    sometimes plus S3)."""
    res = CaseResult("concurrency")
    t0 = time.perf_counter()
    order = [sc for sc in scenarios if env.has_s3 or sc not in ("two-engines+s3", "two-nodes-one-s3")]
    random.Random(f"{seed}-concurrency").shuffle(order)
    for i in range(trials):
        rng = random.Random(f"{seed}-concurrency-{i}")
        scen = order[i % len(order)]
        d = env.fresh("concurrency")
        seeds = (rng.randrange(1 << 20), rng.randrange(1 << 20))
        states = [make_state(s) for s in seeds]
        cid = "step-000007"
        use_s3 = scen in ("two-engines+s3", "two-nodes-one-s3") or (
            scen == "two-processes" and env.has_s3 and rng.random() < 0.5
        )
        prefix = f"chaos/{d.name}"
        cfgs = []
        for w in range(2):
            base = d / (f"node{w}" if scen == "two-nodes-one-s3" else "shared")
            base.mkdir(exist_ok=True)
            c = env.config(
                base,
                s3=use_s3,
                prefix=prefix,
                local_keep=0,
                s3_keep=0,
                fsync=False,
                flush_threads=1 if (w == 0 or scen == "one-engine") else 2,
            )
            cfgs.append(c)
        trial = f"#{i} {scen}" + (" +s3" if use_s3 and scen == "two-processes" else "")
        outcomes: list[dict] = [{}, {}]
        writers: list[TieredWriter] = []
        try:
            if scen == "two-processes":
                procs = []
                for w in range(2):
                    pay = {
                        "config": cfgs[w],
                        "seed": seeds[w],
                        "cid": cid,
                        "go": str(d / "go"),
                        "ready": str(d / f"ready{w}"),
                        "result": str(d / f"result{w}.json"),
                    }
                    procs.append(env.spawn("concurrent-save", pay, d / f"child{w}.out"))
                deadline = time.monotonic() + 120
                while not all((d / f"ready{w}").exists() for w in range(2)) and time.monotonic() < deadline:
                    time.sleep(0.005)
                (d / "go").write_text("1")
                for w, p in enumerate(procs):
                    rc = wait_proc(p, 180)
                    try:
                        outcomes[w] = json.loads((d / f"result{w}.json").read_text())
                    except (OSError, ValueError):
                        outcomes[w] = {
                            "ok": False,
                            "clear": False,
                            "error": f"child exit {rc}: {tail(d / f'child{w}.out')}",
                        }
            else:
                writers = [TieredWriter(config_from_dict(c)) for c in cfgs]
                barrier = threading.Barrier(2)

                def run(w: int) -> None:
                    barrier.wait()
                    e = save_wait(writers[w], states[w], cid)
                    outcomes[w] = {
                        "ok": e is None,
                        "clear": e is None or is_clear(e),
                        "conflict": e is not None and find_error(e, CommitConflict) is not None,
                        "error": "" if e is None else short(e),
                    }

                ts = [threading.Thread(target=run, args=(w,)) for w in range(2)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join(180)
                if any(t.is_alive() for t in ts):
                    res.fail(trial, "a save hung for 180 s")
                    continue
            check_race(res, trial, scen, cfgs, states, outcomes, cid, use_s3)
        except BaseException as ex:  # noqa: BLE001
            res.fail(trial, f"harness error: {type(ex).__name__}: {ex}")
        finally:
            for w in writers:
                close_writer(w)
            res.trials += 1
            env.cleanup(d, cfgs[0] if use_s3 else None)
    res.seconds = time.perf_counter() - t0
    return res


def which_state(cfg: TierConfig, states: list[dict], cid: str) -> tuple[int | None, str]:
    """Index of the state ``cid`` loads as from ``cfg`` (None: neither / mixed), and an error text."""
    try:
        got, _ = load_state(cfg, states[0], cid)
    except BaseException as e:  # noqa: BLE001
        return None, f"does not load: {short(e)}"
    for w, st in enumerate(states):
        if not diff(st, got):
            return w, ""
    return None, "loads as NEITHER writer's state (mixed or corrupt)"


def check_race(
    res: CaseResult,
    trial: str,
    scen: str,
    cfgs: list[dict],
    states: list[dict],
    outcomes: list[dict],
    cid: str,
    use_s3: bool,
) -> None:
    oks = [w for w in range(2) if outcomes[w].get("ok")]
    for w in range(2):
        if not outcomes[w].get("ok") and not outcomes[w].get("clear"):
            res.fail(trial, f"writer {w} failed without a tierckpt error: {outcomes[w].get('error')}")
    if scen == "two-nodes-one-s3":
        # each node commits its own local copy; exactly one of them wins the S3 commit
        for w in range(2):
            local = only(config_from_dict(cfgs[w]), "local")
            got, err = which_state(local, states, cid)
            if got != w:
                res.lose(trial, f"node {w}'s local copy {err or f'is writer {got}s state'}")
    if len(oks) != 1:
        res.fail(
            trial, f"{len(oks)} writers reported success (expected exactly one): {[o.get('error') for o in outcomes]}"
        )
        if not oks:
            return
    winner = oks[0]
    if any(o.get("conflict") for o in outcomes):
        res.note("loser: CommitConflict")
    else:
        res.note("loser: other clear error")
    shared = (
        [only(config_from_dict(cfgs[winner]), "s3")]
        if scen == "two-nodes-one-s3"
        else [only(config_from_dict(cfgs[winner]), "local")]
        + ([only(config_from_dict(cfgs[winner]), "s3")] if use_s3 else [])
    )
    for sub in shared:
        name = "s3" if sub.local is None else "local"
        got, err = which_state(sub, states, cid)
        if got is None:
            res.lose(trial, f"the committed {cid} on {name} {err}")
        elif got != winner:
            res.lose(
                trial,
                f"{name} holds writer {got}'s state but writer {winner} reported the commit",
                "error-to-other-writer" if scen == "one-engine" else "",
            )
