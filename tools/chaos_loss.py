"""Chaos cases for "no committed checkpoint is ever lost", registered in ``tools/chaos.py``:

    python tools/chaos.py --trials 50 --cases filetimes,backlog,gcload,killloop

``filetimes`` (file times changed under committed checkpoints), ``backlog`` (a restart with
checkpoints committed locally but never promoted), ``gcload`` (gc and keep=1 retention racing
loads in another process) and ``killloop`` (the issue's repro: SIGKILL and restart from latest + 1,
over and over). Each is ``case_<name>(env, trials, seed) -> CaseResult`` on chaos.py's helpers;
its docstring says what it checks. A committed checkpoint that cannot be loaded bit-exact, or a
load that returns wrong bytes, is ``lost``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import chaos
from chaos import (BUCKET, TRAIN, CaseResult, Env, Reference, check_tiers, clone_state, close_writer, expect_loads,
                   find_error, is_not_found, load_app, make_state, mutate, only, placeholder, raw, read_events,
                   save_wait, short, tail, toml_text, trainer_argv, wait_proc)
from restore import find_latest, gc_checkpoints, list_all, open_tiers
from restore.catalog import key_path
from tierckpt import CorruptCheckpoint, TieredReader, TieredWriter
from tierckpt.catalog import committed_in_order, list_checkpoints
from tierckpt.config import TierConfig, config_from_dict
from tierckpt.layout import step_of
from tierckpt.tiers import make_local, make_s3

Committed = dict[str, list[tuple[str, int]]]  # tier -> (id, seq), oldest commit first


# -- helpers ------------------------------------------------------------------------------------

def state_digest(x: Any) -> str:
    """SHA-256 over every leaf of a (nested) state dict: tensors by dtype, shape and raw bytes."""
    h = hashlib.sha256()

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            h.update(f"{prefix}:{v.dtype}:{tuple(v.shape)}".encode() + raw(v).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(f"{prefix}.{k}", v[k])
        else:
            h.update(f"{prefix}={v!r}".encode())

    walk("", x)
    return h.hexdigest()


def open_tier(cfg: TierConfig, name: str) -> Any:
    return None if (sub := only(cfg, name)) is None else (make_local(sub) if name == "local" else make_s3(sub))


def committed(cfg: TierConfig) -> Committed:
    """The committed checkpoints (with a readable commit header) of each tier, oldest commit first."""
    out: Committed = {}
    for name in ("local", "s3"):
        if (tier := open_tier(cfg, name)) is not None:
            try:
                out[name] = [(c.checkpoint_id, c.seq or 0) for c in committed_in_order(tier)]
            finally:
                tier.close()
    return out


def ids(com: Committed, tier: str | None = None) -> set[str]:
    return {c for name, lst in com.items() if tier in (None, name) for c, _ in lst}


def with_keep(cfgd: dict, keep: int) -> dict:
    """``cfgd`` with ``keep`` on every tier (same tiers, same paths)."""
    return {sec: kv | ({"keep": keep} if sec in ("local", "s3") else {}) for sec, kv in cfgd.items()}


def save_series(cfg: TierConfig, sd: dict, g: torch.Generator, cids: list[str], rng: random.Random | None = None,
                new_job: float = 0.0) -> dict[str, dict]:
    """Save ``cids`` in turn (each waited for), a training step between saves; before a save, with
    probability ``new_job``, a new writer engine (a new job). Returns the saved states, in order."""
    states: dict[str, dict] = {}
    writer: TieredWriter | None = None
    try:
        for cid in cids:
            if writer is None or (rng is not None and rng.random() < new_job):
                close_writer(writer)
                writer = TieredWriter(cfg)
            if (e := save_wait(writer, sd, cid)) is not None:
                raise RuntimeError(f"save {cid}: {short(e)}")
            states[cid] = clone_state(sd)
            writer.wait_captured()
            mutate(sd, g)
    finally:
        close_writer(writer)
    return states


def expect_only(res: CaseResult, trial: str, cfg: TierConfig, newest: str, state: dict, what: str) -> None:
    """After retention with keep=1: each tier holds exactly ``newest`` (gone = lost), bit-exact."""
    for name, lst in committed(cfg).items():
        left = {c for c, _ in lst}
        if newest not in left:
            res.lose(trial, f"{what}: the newest commit {newest} is gone from {name} (left: {sorted(left)})")
        elif left != {newest}:
            res.fail(trial, f"{what}: {sorted(left)} left on {name}, keep=1 should leave only {newest}")
        else:
            expect_loads(res, trial, only(cfg, name), state, newest, f"{what} ({name})")


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``tierckpt-restore ARGV`` in this process: (exit status, stdout); chaos's log setup is put back."""
    from restore.cli import main as cli_main

    lg = logging.getLogger("tierckpt")
    saved = (list(lg.handlers), lg.propagate, lg.level)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = cli_main(argv)
    finally:
        lg.handlers, lg.propagate = saved[0], saved[1]
        lg.setLevel(saved[2])
    return rc, out.getvalue()


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
        return sorted((key_path(cfg.local.resolved_path(), o.key) for o in objs["local"][cid].values()),
                      key=lambda p: p.name == "metadata.json")

    def keys(cid: str) -> list[str]:
        return sorted((f"{cfg.s3.prefix}/{o.key}" for o in objs.get("s3", {}).get(cid, {}).values()),
                      key=lambda k: k.endswith("metadata.json"))

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
        found = {"both tiers": find_latest(tiers).checkpoint_id} | {t.name: find_latest([t]).checkpoint_id for t in tiers}
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
        got_sd, reader = chaos.load_state(cfg, states[newest], "latest")
    except BaseException as e:  # noqa: BLE001
        res.lose(trial, f"latest does not load: {short(e)}")
        return
    cid = reader.resolved_id
    if cid not in states or chaos.diff(states[cid], got_sd):
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


# == case: backlog ==================================================================================

BACKLOG_KILLS = (("local.commit", "after"), ("s3.upload", "before"), ("s3.upload", "mid"), ("s3.commit", "before"),
                 ("no-s3", ""))


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
    ref = chaos.reference(env, train_seed)
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
        p = env.spawn("trainer", {"argv": trainer_argv(cfg_path, d / "run2.jsonl", train_seed, "--resume")}, d / "run2.out")
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


# == case: gcload ===================================================================================

GONE = re.compile(r"being deleted|was deleted|is not committed|not committed on|holds a committed copy|no committed checkpoint")


def classify(exc: BaseException) -> str:
    """A failed load: ``corrupt`` (CorruptCheckpoint, ChecksumMismatch or their texts), ``deleted
    under the reader`` (after it took its lease: a deletion ignored it), ``gone`` (being deleted,
    not committed) or ``unclear``."""
    texts = [str(e) for e in chaos.errors_in(exc)]
    if any(re.search(r"was deleted from .* while it was being read", t) for t in texts):
        return "deleted under the reader"
    if find_error(exc, CorruptCheckpoint) is not None or (
            any(chaos._TIERCKPT_TEXT.search(t) for t in texts) and not any(GONE.search(t) for t in texts)):
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
            child = env.spawn("loss-loader", {"config": cfgd, "target": target, "state_seed": state_seed, "big": big,
                                              "digest": state_digest(states[target]), "results": str(results),
                                              "stop": str(stop)}, d / "loader.out")
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


def _chain(env: Env, res: CaseResult, rng: random.Random, train_seed: int, with_s3: bool, n: int, first: int,
           checks: list[tuple[str, int, str]]) -> tuple[dict, Path]:
    """``n`` kill + restart trials on one tier setup; (trial, step, digest) of each load go to ``checks``."""
    d = env.fresh("killloop")
    cfgd = env.config(d, s3=with_s3, local_keep=3, s3_keep=2)
    cfg = config_from_dict(cfgd)
    (d / "tiers.toml").write_text(toml_text(cfgd))
    prev: str | None = None  # latest after the previous kill
    for j in range(n):
        trial = f"#{first + j} {'local+s3' if with_s3 else 'local'}"
        log, out = d / f"run{j:03d}.jsonl", d / f"run{j:03d}.out"
        argv = trainer_argv(d / "tiers.toml", log, train_seed, "--steps", "1000000", "--ckpt-every", "1", "--resume",
                            "--digests")
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
    chains = [_chain(env, res, rng, train_seed, s3, n, first, checks)
              for s3, n, first in ((False, trials - n_s3, 0), (True, n_s3, trials - n_s3)) if n]
    logged: dict[int, set[str]] = {}  # step -> digests the trainers logged when saving it
    for _cfgd, d in chains:
        for f in sorted(d.glob("run*.jsonl")):
            for e in read_events(f):
                if e.get("event") == "save" and "digest" in e:
                    logged.setdefault(e["step"], set()).add(e["digest"])
    needed = {s for _t, s, _d in checks} | {step_of(c) or 0 for cfgd, _d in chains for c in ids(committed(config_from_dict(cfgd)))}
    needed |= set(rng.sample(sorted(logged), min(30, len(logged))))
    refd = env.fresh("killloop-ref")
    p = env.spawn("loss-digests", {"seed": train_seed, "steps": sorted(needed - {0}), "out": str(refd / "ref.json")},
                  refd / "ref.out")
    if wait_proc(p, 600) != 0:
        res.fail("reference", f"the replay failed: {tail(refd / 'ref.out')}")
        ref_digest: dict[int, str] = {}
    else:
        ref_digest = {int(k): v for k, v in json.loads((refd / "ref.json").read_text()).items()}
    for s, digs in logged.items():
        if s in ref_digest and digs != {ref_digest[s]}:
            res.fail("reference", f"step {s}: the trainer logged digest(s) {sorted(x[:12] for x in digs)}, the "
                                  f"replay {ref_digest[s][:12]} (replay or trainer not deterministic)")
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


CASE_FUNCS = {"filetimes": case_filetimes, "backlog": case_backlog, "gcload": case_gcload, "killloop": case_killloop}
chaos.register_cases(CASE_FUNCS, {"loss-loader": _loader_child, "loss-digests": _digests_child})
