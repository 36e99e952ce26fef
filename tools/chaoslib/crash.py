"""Case ``crash``: a trainer SIGKILLed at a random time or at a named point inside the tiers."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from train_gpt import read_events

from chaoslib.core import CaseResult, is_not_found, only, short, toml_text
from chaoslib.env import Env, tail, wait_proc
from tierckpt import TieredReader
from tierckpt.catalog.listing import list_checkpoints
from tierckpt.config import TierConfig, config_from_dict
from tierckpt.format.layout import step_of
from tierckpt.tiers import make_local, make_s3

# == case: crash ===================================================================================

TRAIN = {"steps": 10, "ckpt_every": 2, "d_model": 64, "layers": 2, "batch": 4, "ctx": 32}

# operation -> the WHENs that make sense (see tools/chaos_tiers.py)
KILL_POINTS: dict[str, tuple[str, ...]] = {
    "save.return": ("after",),  # capture pending
    "local.open": ("before",),  # capture starting
    "local.write": ("before", "after"),  # flush
    "local.close": ("before", "after"),  # flush: fsync + rename
    "local.commit": ("before", "after"),  # local commit
    "local.delete": ("before", "after"),  # local retention: metadata first
    "local.delete_prefix": ("before", "mid", "after"),  # local retention: data
    "s3.upload": ("before", "mid", "after"),  # promotion
    "s3.commit": ("before", "after"),  # S3 commit
    "s3.delete": ("before", "after"),  # S3 retention
    "s3.delete_prefix": ("before", "mid", "after"),
}
STAGE_OF = {
    "save.return": "capture",
    "local.open": "capture",
    "local.write": "flush",
    "local.close": "flush",
    "local.commit": "commit",
    "local.delete": "retention",
    "local.delete_prefix": "retention",
    "s3.upload": "promotion",
    "s3.commit": "promotion",
    "s3.delete": "retention",
    "s3.delete_prefix": "retention",
}


def trainer_argv(cfg_path: Path, log_path: Path, seed: int, *extra: str) -> list[str]:
    t = TRAIN
    return [
        "--config",
        str(cfg_path),
        "--steps",
        str(t["steps"]),
        "--ckpt-every",
        str(t["ckpt_every"]),
        "--log",
        str(log_path),
        "--seed",
        str(seed),
        "--d-model",
        str(t["d_model"]),
        "--layers",
        str(t["layers"]),
        "--batch",
        str(t["batch"]),
        "--ctx",
        str(t["ctx"]),
        *extra,
    ]


class Reference:
    """Digests of an uninterrupted run (DCP's FileSystemWriter) and a census of tier calls."""

    def __init__(self, env: Env, seed: int) -> None:
        d = env.fresh("crash-reference")
        self.seed = seed
        cfgd = env.config(d, s3=True, local_keep=2, s3_keep=2)
        cfg_path = d / "tiers.toml"
        cfg_path.write_text(toml_text(cfgd))
        ref_log = d / "reference.jsonl"
        p = env.spawn(
            "trainer",
            {
                "argv": trainer_argv(
                    cfg_path, ref_log, seed, "--writer", "dcp", "--dcp-dir", str(d / "dcp"), "--digests"
                )
            },
            d / "reference.out",
        )
        rc = wait_proc(p, 600)
        if rc != 0:
            raise RuntimeError(f"reference run failed (exit {rc}): {tail(d / 'reference.out')}")
        ev = read_events(ref_log)
        self.digest = {e["step"]: e["digest"] for e in ev if e.get("event") == "save"}
        self.final = next(e["digest"] for e in ev if e.get("event") == "done")
        # census: the same run through the tiers, counting calls per operation (no kill)
        census = d / "census.json"
        run_log = d / "census.jsonl"
        p = env.spawn(
            "trainer",
            {"argv": trainer_argv(cfg_path, run_log, seed, "--digests", "--chaos", f"count={census}")},
            d / "census.out",
        )
        rc = wait_proc(p, 600)
        if rc != 0:
            raise RuntimeError(f"census run failed (exit {rc}): {tail(d / 'census.out')}")
        self.counts: dict[str, int] = json.loads(census.read_text())
        ev = read_events(run_log)
        tiered = {e["step"]: e["digest"] for e in ev if e.get("event") == "save"}
        if tiered != self.digest:
            raise RuntimeError(
                "the tiered run's digests differ from DCP's reference run: the trainer is not deterministic"
            )
        env.cleanup(d, cfgd)


def reference(env: Env, seed: int) -> Reference:
    """One :class:`Reference` per trainer seed and session, shared by the cases (two trainer runs)."""
    refs = env.__dict__.setdefault("_references", {})
    if seed not in refs:
        refs[seed] = Reference(env, seed)
    return refs[seed]


def load_app(cfg: TierConfig, cid: str, seed: int) -> tuple[int, str, str | None]:
    """Load ``cid`` into a fresh, poisoned TinyGPT + AdamW; return (step, digest, resolved id)."""
    from train_gpt import AppState, TinyGPT, digest

    t = TRAIN
    torch.manual_seed(seed)
    model = TinyGPT(256, t["d_model"], t["layers"], 4, t["ctx"])
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    app = AppState(model, optim)
    app.state_dict()  # materializes the optimizer state
    with torch.no_grad():  # poison: a tensor the load skips cannot match the reference
        for p in model.parameters():
            p.fill_(7.0)
        for st in optim.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    v.fill_(7.0)
    app.step = -1
    reader = TieredReader(cfg)
    dcp.load({"app": app}, checkpoint_id=cid, storage_reader=reader, no_dist=True)
    return app.step, digest(model, optim), reader.resolved_id


def check_tiers(res: CaseResult, trial: Any, cfg: TierConfig, ref: Reference, stage: str) -> dict[str, set[str]]:
    """Every committed checkpoint on each tier loads bit-exact (= reference digest of its step);
    uncommitted ones are refused; ``latest`` is the newest committed one. Returns the committed
    ids per tier."""
    committed: dict[str, set[str]] = {}
    partial: dict[str, set[str]] = {}
    for name in ("local", "s3"):
        sub = only(cfg, name)
        if sub is None:
            continue
        tier = make_local(sub) if name == "local" else make_s3(sub)
        try:
            infos = list_checkpoints(tier)
        finally:
            tier.close()
        committed[name] = {c.checkpoint_id for c in infos if c.committed}
        partial[name] = {c.checkpoint_id for c in infos if not c.committed}
        for cid in sorted(committed[name]):
            step = step_of(cid)
            try:
                got_step, dig, _ = load_app(sub, cid, ref.seed)
            except BaseException as e:  # noqa: BLE001
                res.lose(trial, f"{stage}: committed {cid} on {name} does not load: {short(e)}")
                continue
            if got_step != step or dig != ref.digest.get(step):
                res.lose(
                    trial,
                    f"{stage}: committed {cid} on {name} loaded WRONG state (step {got_step}, digest "
                    f"{dig[:12]} vs reference {str(ref.digest.get(step))[:12]})",
                )
        for cid in sorted(partial[name]):
            try:
                load_app(sub, cid, ref.seed)
            except BaseException as e:  # noqa: BLE001
                if not is_not_found(e):
                    res.fail(
                        trial,
                        f"{stage}: uncommitted {cid} on {name} refused, but not as CheckpointNotFound: {short(e)}",
                    )
                continue
            res.lose(trial, f"{stage}: uncommitted {cid} on {name} was LOADED")
    every = set().union(*committed.values()) if committed else set()
    try:
        step, dig, resolved = load_app(cfg, "latest", ref.seed)
    except BaseException as e:  # noqa: BLE001
        if every:
            res.lose(trial, f"{stage}: latest does not load although {sorted(every)} are committed: {short(e)}")
        elif not is_not_found(e):
            res.fail(trial, f"{stage}: latest with nothing committed: expected CheckpointNotFound, got {short(e)}")
        return committed
    if resolved not in every:
        res.lose(trial, f"{stage}: latest resolved to {resolved}, which is not committed anywhere ({sorted(every)})")
    elif dig != ref.digest.get(step) or step != step_of(resolved):
        res.lose(trial, f"{stage}: latest ({resolved}) loaded a WRONG state")
    newest = max(every, key=lambda c: step_of(c) or -1)
    if resolved != newest:
        res.fail(trial, f"{stage}: latest resolved to {resolved}, but {newest} is the newest committed checkpoint")
    return committed


def choose_kill(
    rng: random.Random, ref: Reference, has_s3: bool, point: str | None = None
) -> tuple[str, int, str] | None:
    points = [p for p in KILL_POINTS if ref.counts.get(p, 0) > 0 and (has_s3 or not p.startswith("s3."))]
    if point is not None:
        points = [p for p in points if p == point]
    if not points:
        return None
    point = rng.choice(points)
    return point, rng.randint(1, ref.counts[point]), rng.choice(KILL_POINTS[point])


def case_crash(
    env: Env,
    trials: int,
    seed: int,
    *,
    node_loss_rate: float = 0.25,
    random_kill_rate: float = 0.35,
    plan: tuple[str, ...] = (),
) -> CaseResult:
    """``plan``: kill points to take in turn (``"random"`` for a random-time kill, or a key of
    :data:`KILL_POINTS`); by default each trial draws a random-time kill (``random_kill_rate``) or a
    random point, its call number and its timing."""
    res = CaseResult("crash")
    t0 = time.perf_counter()
    train_seed = seed % 1000
    ref = reference(env, train_seed)
    steps = TRAIN["steps"]
    for i in range(trials):
        rng = random.Random(f"{seed}-crash-{i}")
        d = env.fresh("crash")
        cfgd = env.config(d, local_keep=2, s3_keep=2)
        cfg_path = d / "tiers.toml"
        cfg_path.write_text(toml_text(cfgd))
        cfg = config_from_dict(cfgd)
        run_log = d / "run1.jsonl"
        if plan:
            want = plan[i % len(plan)]
            kill = None if want == "random" else choose_kill(rng, ref, env.has_s3, want)
        else:
            kill = None if rng.random() < random_kill_rate else choose_kill(rng, ref, env.has_s3)
        extra: list[str] = []
        if kill is not None:
            point, k, when = kill
            extra = ["--chaos", f"kill={point}:{k}:{when},delay={rng.uniform(0.0, 0.05):.3f}"]
            what = f"{STAGE_OF[point]}:{point}:{when}"
        p = env.spawn("trainer", {"argv": trainer_argv(cfg_path, run_log, train_seed, *extra)}, d / "run1.out")
        if kill is None:
            kill_step, delay = rng.randint(1, steps - 1), rng.uniform(0.0, 0.6)
            what = "random-time"
            deadline = time.monotonic() + 300
            while p.is_alive() and time.monotonic() < deadline:
                if any(e.get("event") == "step" and e["step"] >= kill_step for e in read_events(run_log)):
                    time.sleep(delay)
                    p.kill()
                    break
                time.sleep(0.02)
        rc = wait_proc(p, 300)
        trial = f"#{i} {what}"
        if rc is None:
            res.fail(trial, f"trainer hung (killed after 300 s): {tail(d / 'run1.out')}")
        elif rc == 0:
            res.note("ran to the end (no kill)")
        elif rc not in (137, -9):
            res.fail(trial, f"trainer failed by itself (exit {rc}): {tail(d / 'run1.out')}")
        else:
            res.note(f"killed {what.split(':')[0]}")
        check_tiers(res, trial, cfg, ref, "after the kill")
        lost_node = env.has_s3 and rng.random() < node_loss_rate
        if lost_node:
            shutil.rmtree(d / "local", ignore_errors=True)
            res.note("node lost before resume")
        # resume: a new process continues from latest and must end bit-identical to the reference
        log2 = d / "run2.jsonl"
        p = env.spawn("trainer", {"argv": trainer_argv(cfg_path, log2, train_seed, "--resume")}, d / "run2.out")
        rc2 = wait_proc(p, 300)
        ev = read_events(log2)
        if rc2 != 0:
            out2 = tail(d / "run2.out", 3000)
            known = (
                "resume-without-checkpoint"
                if ("no committed checkpoint on any tier" in out2 and not any(e.get("event") == "resumed" for e in ev))
                else ""
            )
            last_line = next((ln for ln in reversed(out2.split(" | ")) if ln.strip()), "")
            res.fail(trial, f"resumed run failed (exit {rc2}): {last_line[:300]}", known)
        else:
            resumed = next((e for e in ev if e.get("event") == "resumed"), None)
            done = next((e for e in ev if e.get("event") == "done"), None)
            if resumed is not None:
                s = resumed["step"]
                if resumed["digest"] != ref.digest.get(s) or step_of(resumed["checkpoint"]) != s:
                    res.lose(trial, f"resumed from {resumed['checkpoint']} (step {s}) with a WRONG state")
            if done is None or done["digest"] != ref.final:
                res.fail(trial, "the resumed run did not end bit-identical to the uninterrupted reference run")
        final = check_tiers(res, trial, cfg, ref, "after the resume")
        last = f"step-{steps:06d}"
        if rc2 == 0 and last not in set().union(*final.values()):
            res.fail(trial, f"after the resume {last} is not committed anywhere ({final})")
        if "s3" in final and last in final.get("local", set()) - final["s3"]:
            # committed locally (by the killed run or the resumed one): the backlog pass must promote it
            res.fail(trial, f"after the resume {last} is committed locally but never reached S3")
        res.trials += 1
        env.cleanup(d, cfgd)
    res.seconds = time.perf_counter() - t0
    return res
