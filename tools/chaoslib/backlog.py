"""Case ``backlog``: a restart with checkpoints committed locally but never promoted."""

from __future__ import annotations

import random
import time

from chaoslib.core import CaseResult, toml_text
from chaoslib.crash import check_tiers, read_events, reference, trainer_argv
from chaoslib.env import Env, tail, wait_proc
from chaoslib.loss import committed, ids
from tierckpt.config import config_from_dict

# == case: backlog ==================================================================================

BACKLOG_KILLS = (
    ("local.commit", "after"),
    ("s3.upload", "before"),
    ("s3.upload", "mid"),
    ("s3.commit", "before"),
    ("no-s3", ""),
)


def case_backlog(env: Env, trials: int, seed: int, *, plan: tuple[str, ...] = ()) -> CaseResult:
    """A restart promotes what a killed job committed locally and never uploaded. The trainer
    (``[s3] keep = 0``) dies at a point of :data:`BACKLOG_KILLS`, or its first job ran without
    ``[s3]``; then a ``--resume`` run with S3. Every checkpoint committed locally at the kill and
    newer than S3's newest must be committed on S3 afterwards; everything committed loads bit-exact
    (``check_tiers``); the resumed run ends bit-identical to an uninterrupted one. Gone from every
    tier although it was on S3 or owed to it: lost. ``plan``: kill kinds in turn (else random)."""
    res = CaseResult("backlog")
    t0 = time.perf_counter()
    if not env.has_s3:
        res.skipped = "no S3 server (--s3 none)"
        return res
    train_seed = seed % 1000
    ref = reference(env, train_seed)
    for i in range(trials):
        rng = random.Random(f"{seed}-backlog-{i}")
        point, when = rng.choice([k for k in BACKLOG_KILLS if not plan or k[0] == plan[i % len(plan)]])
        d = env.fresh("backlog")
        cfgd = env.config(d, local_keep=rng.choice((2, 3)), s3_keep=0)
        cfg = config_from_dict(cfgd)
        cfg_path, run1_cfg = d / "tiers.toml", d / "tiers.toml"
        cfg_path.write_text(toml_text(cfgd))
        extra: list[str] = []
        if point == "no-s3":
            run1_cfg = d / "local-only.toml"
            run1_cfg.write_text(toml_text({k: v for k, v in cfgd.items() if k != "s3"}))
            if rng.random() < 0.6:
                extra = ["--chaos", f"kill=local.commit:{rng.randint(1, ref.counts['local.commit'])}:after"]
            what = "no [s3] in the first job" + (", killed after a commit" if extra else "")
        else:
            k = rng.randint(1, ref.counts[point])
            extra = ["--chaos", f"kill={point}:{k}:{when},delay={rng.uniform(0.005, 0.05):.3f}"]
            what = f"{point}:{k}:{when}"
        trial = f"#{i} {what}"
        p = env.spawn("trainer", {"argv": trainer_argv(run1_cfg, d / "run1.jsonl", train_seed, *extra)}, d / "run1.out")
        if (rc := wait_proc(p, 300)) not in (0, 137, -9):
            res.fail(trial, f"first run failed (exit {rc}): {tail(d / 'run1.out')}")
        at = committed(cfg)
        s3_newest = max((s for _c, s in at["s3"]), default=0)
        owed = {c for c, s in at["local"] if s > s3_newest}
        res.note(f"owed {len(owed)} at the kill")
        p = env.spawn(
            "trainer", {"argv": trainer_argv(cfg_path, d / "run2.jsonl", train_seed, "--resume")}, d / "run2.out"
        )
        if (rc2 := wait_proc(p, 300)) != 0:
            res.fail(trial, f"resumed run failed (exit {rc2}): {tail(d / 'run2.out')}")
        after = committed(cfg)
        for cid in sorted(owed - ids(after, "s3")):
            if cid in ids(after):
                res.fail(trial, f"{cid} (committed locally, newer than S3's newest at the kill) never reached S3")
            else:
                res.lose(trial, f"{cid} (owed to S3 at the kill) is gone from every tier")
        for cid in sorted(ids(at, "s3") - ids(after)):
            res.lose(trial, f"{cid} (committed on S3 at the kill) is gone from every tier")
        if owed and owed <= ids(after, "s3"):
            res.note("backlog promoted")
        ev = read_events(d / "run2.jsonl")
        resumed = next((e for e in ev if e.get("event") == "resumed"), None)
        done = next((e for e in ev if e.get("event") == "done"), None)
        if resumed is not None and resumed["digest"] != ref.digest.get(resumed["step"]):
            res.lose(trial, f"resumed from {resumed['checkpoint']} with a WRONG state")
        if rc2 == 0 and (done is None or done["digest"] != ref.final):
            res.fail(trial, "the resumed run did not end bit-identical to the uninterrupted reference run")
        check_tiers(res, trial, cfg, ref, "after the resume")
        res.trials += 1
        env.cleanup(d, cfgd)
    res.seconds = time.perf_counter() - t0
    return res
