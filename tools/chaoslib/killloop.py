"""Case ``killloop``: SIGKILL and restart from latest + 1, over and over."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from chaoslib.core import CaseResult, is_not_found, short, toml_text
from chaoslib.crash import TRAIN, Reference, check_tiers, load_app, read_events, trainer_argv
from chaoslib.env import Env, tail, wait_proc
from chaoslib.loss import committed, ids
from tierckpt.config import config_from_dict
from tierckpt.format.layout import step_of

# == case: killloop =================================================================================


def _digests_child(payload: dict) -> int:
    """Zygote child: replay the trainer's training (no checkpoints) and write the state digest at
    each step of ``steps``: the reference for any step, however many restarts it took."""
    import torch.nn as nn
    from train_gpt import TinyGPT, batch, digest

    t, seed, want = TRAIN, payload["seed"], set(payload["steps"])
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = TinyGPT(256, t["d_model"], t["layers"], 4, t["ctx"])
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()
    out: dict[int, str] = {}
    for step in range(max(want, default=0)):
        x = batch(seed, step, 0, t["batch"], t["ctx"], 256)
        loss_fn(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step + 1 in want:
            out[step + 1] = digest(model, optim)
    Path(payload["out"]).write_text(json.dumps(out))
    return 0


def kill_stage(ev: list[dict], newest_step: int) -> str:
    """Where a kill landed, from the killed run's log and the newest committed step."""
    kinds = {e.get("event") for e in ev}
    if "start" not in kinds:
        return "startup"
    if not kinds & {"resumed", "fresh"}:
        return "resume load"
    last_step = max((e["step"] for e in ev if e.get("event") == "step"), default=0)
    last_save = max((e["step"] for e in ev if e.get("event") == "save"), default=0)
    if last_step > last_save:
        return "training step or dcp.save"
    return "save in flight (capture/flush/commit)" if last_save > newest_step else "after a commit"


def _chain(
    env: Env,
    res: CaseResult,
    rng: random.Random,
    train_seed: int,
    with_s3: bool,
    n: int,
    first: int,
    checks: list[tuple[str, int, str]],
) -> tuple[dict, Path]:
    """``n`` kill + restart trials on one tier setup; (trial, step, digest) of each load go to ``checks``."""
    d = env.fresh("killloop")
    cfgd = env.config(d, s3=with_s3, local_keep=3, s3_keep=2)
    cfg = config_from_dict(cfgd)
    (d / "tiers.toml").write_text(toml_text(cfgd))
    prev: str | None = None  # latest after the previous kill
    for j in range(n):
        trial = f"#{first + j} {'local+s3' if with_s3 else 'local'}"
        log, out = d / f"run{j:03d}.jsonl", d / f"run{j:03d}.out"
        argv = trainer_argv(
            d / "tiers.toml", log, train_seed, "--steps", "1000000", "--ckpt-every", "1", "--resume", "--digests"
        )
        p = env.spawn("trainer", {"argv": argv}, out)
        until = time.monotonic() + (rng.uniform(0.0, 0.5) if rng.random() < 0.25 else rng.uniform(0.3, 2.5))
        while time.monotonic() < until and p.is_alive():
            time.sleep(0.02)
        if not p.is_alive():
            res.fail(trial, f"the trainer exited by itself (exit {p.exitcode}) before the kill: {tail(out)}")
        p.kill()
        wait_proc(p, 30)
        res.trials += 1
        every = ids(committed(cfg))
        newest = max(every, key=lambda c: step_of(c) or -1) if every else None
        ev = read_events(log)
        res.note(f"killed: {kill_stage(ev, (step_of(newest) or 0) if newest else 0)}")
        if (resumed := next((e for e in ev if e.get("event") == "resumed"), None)) is not None:
            checks.append((trial + " (resumed)", resumed["step"], resumed["digest"]))
            if resumed["checkpoint"] != prev:
                res.fail(trial, f"the restart resumed from {resumed['checkpoint']}, latest was {prev}")
        try:
            step, dig, resolved = load_app(cfg, "latest", train_seed)
        except BaseException as e:  # noqa: BLE001
            if newest is not None:
                res.lose(trial, f"latest does not load although {sorted(every)} are committed: {short(e)}")
            elif not is_not_found(e):
                res.fail(trial, f"latest with nothing committed: expected CheckpointNotFound, got {short(e)}")
            continue
        checks.append((trial, step, dig))
        if resolved != newest:
            res.fail(trial, f"latest is {resolved}, the newest commit is {newest}")
        if step != step_of(resolved):
            res.lose(trial, f"latest ({resolved}) loaded the state of step {step}")
        if prev is not None and (step_of(resolved) or 0) < (step_of(prev) or 0):
            res.lose(trial, f"latest went back from {prev} to {resolved}: {prev} vanished")
        prev = resolved
    return cfgd, d


def case_killloop(env: Env, trials: int, seed: int, *, s3_share: float = 0.5) -> CaseResult:
    """The issue's repro: a trainer checkpointing every step (``[local] keep = 3``; in ``s3_share``
    of the trials S3 too, keep 2) is SIGKILLed at a random time after each start and restarted with
    ``--resume`` (latest + 1); a kill + restart is a trial. After each kill ``latest`` loads, is the
    newest commit and not older than the previous one (else lost), and the restart resumes from it.
    Every state loaded (``latest``, each resume, every commit at the end) equals a replay of the
    training, itself checked against the trainer's logged digests. Notes: where the kills landed."""
    res = CaseResult("killloop")
    t0 = time.perf_counter()
    rng = random.Random(f"{seed}-killloop")
    train_seed = seed % 1000
    n_s3 = round(trials * s3_share) if env.has_s3 else 0
    checks: list[tuple[str, int, str]] = []
    chains = [
        _chain(env, res, rng, train_seed, s3, n, first, checks)
        for s3, n, first in ((False, trials - n_s3, 0), (True, n_s3, trials - n_s3))
        if n
    ]
    logged: dict[int, set[str]] = {}  # step -> digests the trainers logged when saving it
    for _cfgd, d in chains:
        for f in sorted(d.glob("run*.jsonl")):
            for e in read_events(f):
                if e.get("event") == "save" and "digest" in e:
                    logged.setdefault(e["step"], set()).add(e["digest"])
    needed = {s for _t, s, _d in checks} | {
        step_of(c) or 0 for cfgd, _d in chains for c in ids(committed(config_from_dict(cfgd)))
    }
    needed |= set(rng.sample(sorted(logged), min(30, len(logged))))
    refd = env.fresh("killloop-ref")
    p = env.spawn(
        "loss-digests",
        {"seed": train_seed, "steps": sorted(needed - {0}), "out": str(refd / "ref.json")},
        refd / "ref.out",
    )
    if wait_proc(p, 600) != 0:
        res.fail("reference", f"the replay failed: {tail(refd / 'ref.out')}")
        ref_digest: dict[int, str] = {}
    else:
        ref_digest = {int(k): v for k, v in json.loads((refd / "ref.json").read_text()).items()}
    for s, digs in logged.items():
        if s in ref_digest and digs != {ref_digest[s]}:
            res.fail(
                "reference",
                f"step {s}: the trainer logged digest(s) {sorted(x[:12] for x in digs)}, the "
                f"replay {ref_digest[s][:12]} (replay or trainer not deterministic)",
            )
    for trial, s, dig in checks:
        if dig != ref_digest.get(s):
            res.lose(trial, f"the state loaded for step {s} differs from the reference")
    res.note("states checked against the replay", len(checks))
    ref = Reference.__new__(Reference)  # check_tiers needs only .seed and .digest
    ref.seed, ref.digest = train_seed, ref_digest
    for cfgd, d in chains:
        check_tiers(res, "end", config_from_dict(cfgd), ref, "at the end of the kill loop")
        env.cleanup(d, cfgd)
    env.cleanup(refd)
    res.seconds = time.perf_counter() - t0
    return res
