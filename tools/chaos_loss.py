"""Chaos cases for "no committed checkpoint is ever lost" (registered in ``tools/chaos.py``).

    python tools/chaos.py --trials 50 --cases filetimes,backlog,gcload,killloop

Each case is ``case_<name>(env, trials, seed) -> CaseResult`` built on chaos.py's helpers; a
committed checkpoint that cannot be loaded bit-exact, or loads that return wrong bytes, count
as ``lost``.

filetimes
    Saves 3-5 checkpoints (local + S3; some by a "new job", some with ids out of step order),
    then changes file times: older checkpoints touched into the future, the newest set into the
    past, an older one restored from a copy (fresh times, new files; re-put on S3), and sometimes
    a new job saves after that. ``latest`` (TieredReader per tier and over both,
    ``restore.find_latest``, ``tierckpt-restore latest``), the ``list`` order and gc with keep=1
    (library or CLI) must all follow the commit order; the newest loads bit-exact before and
    after gc, and gc removes exactly the older ones. Deleting the newest is ``lost``.
backlog
    The trainer dies right after a local commit, before or during an S3 upload or before the S3
    commit (or ran without ``[s3]``); then a ``--resume`` run. Every checkpoint committed locally
    at the kill and newer than S3's newest then must be committed on S3 (``[s3] keep = 0``);
    everything committed loads bit-exact (``check_tiers``); the resumed run ends bit-identical to
    an uninterrupted one. A checkpoint that was on S3 or owed to it and is gone everywhere is lost.
gcload
    A child process loads an older checkpoint in a loop (TieredReader, bit-exact check) while
    the parent runs ``restore.gc.gc_checkpoints`` with keep=1 and/or saves a newer checkpoint
    with keep=1; sometimes the loader is SIGKILLed mid-load. Every load succeeds bit-exact or
    fails saying the checkpoint is being deleted / not committed: never CorruptCheckpoint or
    ChecksumMismatch, never wrong bytes (lost). A dead loader's lease must not block a later gc;
    the newest checkpoint survives and loads bit-exact.
killloop
    The issue's repro: a trainer checkpointing every step (``[local] keep = 3``; half of the
    trials with S3 too) is SIGKILLed at a random time after each start and restarted with
    ``--resume`` (latest + 1); one kill + restart is one trial. After every kill ``latest`` must
    resolve to the newest committed checkpoint and load bit-exact, never older than the previous
    ``latest``; each restart must resume from it; at the end every committed checkpoint loads
    bit-exact. Digests come from a replay of the training (checked against the trainer's own
    logged digests). The notes count where the kills landed.
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

# -- helpers ------------------------------------------------------------------------------------


def state_digest(x: Any) -> str:
    """SHA-256 over every leaf of a (nested) state dict: tensors by dtype, shape and raw bytes."""
    h = hashlib.sha256()

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            h.update(f"{prefix}:{v.dtype}:{tuple(v.shape)}".encode())
            h.update(raw(v).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(f"{prefix}.{k}", v[k])
        else:
            h.update(f"{prefix}={v!r}".encode())

    walk("", x)
    return h.hexdigest()


def open_tier(cfg: TierConfig, name: str) -> Any:
    sub = only(cfg, name)
    return None if sub is None else (make_local(sub) if name == "local" else make_s3(sub))


def committed(cfg: TierConfig) -> dict[str, list[tuple[str, int]]]:
    """(id, seq) of the committed checkpoints with a readable header, per tier, oldest commit first."""
    out: dict[str, list[tuple[str, int]]] = {}
    for name in ("local", "s3"):
        tier = open_tier(cfg, name)
        if tier is not None:
            try:
                out[name] = [(c.checkpoint_id, c.seq or 0) for c in committed_in_order(tier)]
            finally:
                tier.close()
    return out


def ids(com: dict[str, list[tuple[str, int]]], tier: str | None = None) -> set[str]:
    return {c for name, lst in com.items() if tier in (None, name) for c, _ in lst}


def with_keep(cfgd: dict, local_keep: int, s3_keep: int) -> dict:
    """``cfgd`` with other retention counts (same tiers, same paths)."""
    out = {sec: dict(kv) for sec, kv in cfgd.items()}
    if "local" in out:
        out["local"]["keep"] = local_keep
    if "s3" in out:
        out["s3"]["keep"] = s3_keep
    return out


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

def perturb(env: Env, rng: random.Random, cfg: TierConfig, order: list[str]) -> list[str]:
    """Change file times (never contents) of committed checkpoints, 1-3 ways; returns what was done."""
    kinds = rng.sample(["older touched into the future", "newest set into the past", "older restored from a copy"],
                       rng.randint(1, 3))
    now = time.time()
    newest, older = order[-1], order[:-1]
    restored = rng.choice(older)
    local = open_tier(cfg, "local")
    s3 = open_tier(cfg, "s3")
    try:
        lobj = {c.checkpoint_id: c.objects for c in list_checkpoints(local)}
        sobj = {c.checkpoint_id: c.objects for c in list_checkpoints(s3)} if s3 is not None else {}
        root = cfg.local.resolved_path()
        prefix = cfg.s3.prefix if cfg.s3 is not None else ""
        s3c = env.client() if s3 is not None else None

        def files(cid: str) -> list[Path]:
            return [key_path(root, o.key) for o in lobj[cid].values()]

        def s3_keys(cid: str) -> list[str]:  # data first, metadata last (as a careful operator would)
            return sorted((f"{prefix}/{o.key}" for o in sobj.get(cid, {}).values()), key=lambda k: k.endswith("metadata.json"))

        for kind in kinds:
            if kind == "older touched into the future":
                for cid in older:
                    t = now + rng.uniform(3600, 365 * 86400)
                    for p in files(cid):
                        os.utime(p, (t, t))
                    for k in s3_keys(cid):  # S3 cannot set times: a re-put makes them the newest objects
                        s3c.put_object(Bucket=BUCKET, Key=k, Body=s3c.get_object(Bucket=BUCKET, Key=k)["Body"].read())
            elif kind == "newest set into the past":
                t = now - rng.uniform(86400, 10 * 365 * 86400)
                for p in files(newest):
                    os.utime(p, (t, t))
            else:
                for p in sorted(files(restored), key=lambda p: p.name == "metadata.json"):
                    data = p.read_bytes()
                    p.unlink()
                    p.write_bytes(data)  # a new file with fresh times, as a restore from a backup
                keys = s3_keys(restored)
                blobs = {k: s3c.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys}
                for k in reversed(keys):
                    s3c.delete_object(Bucket=BUCKET, Key=k)
                for k in keys:
                    s3c.put_object(Bucket=BUCKET, Key=k, Body=blobs[k])
    finally:
        local.close()
        if s3 is not None:
            s3.close()
    return kinds


def check_newest(res: CaseResult, trial: str, cfg: TierConfig, cfg_path: Path, order: list[str], states: dict) -> None:
    """``latest`` (TieredReader, restore.find_latest per tier and over both, the CLI) and ``list``
    (library and CLI) follow the commit order; ``latest`` loads bit-exact."""
    newest = order[-1]
    tiers = open_tiers(cfg)
    try:
        found = {"both tiers": find_latest(tiers).checkpoint_id} | {t.name: find_latest([t]).checkpoint_id for t in tiers}
        listed = {"restore.list_all": [lst.checkpoint_id for lst in list_all(tiers) if lst.committed_anywhere]}
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
            res.fail(trial, f"latest by restore.find_latest ({what}) is {got}, the newest commit is {newest}")
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
        res.fail(trial, f"TieredReader latest is {cid}, the newest commit is {newest}")


def case_filetimes(env: Env, trials: int, seed: int) -> CaseResult:
    """Touching, back-dating and restoring files changes neither ``latest``, ``list`` nor gc."""
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
        if rng.random() < 0.25:  # ids out of step order: commit order is still the truth
            rng.shuffle(steps)
            res.note("ids out of step order")
        sd = make_state(rng.randrange(1 << 20), big=256 << 10)
        states: dict[str, dict] = {}
        order: list[str] = []
        writer: TieredWriter | None = None
        trial = f"#{i}"

        def save(cid: str, new_job: bool) -> None:
            nonlocal writer
            if writer is None or new_job:  # a new job: a fresh engine numbers commits from the tiers
                close_writer(writer)
                writer = TieredWriter(cfg)
            e = save_wait(writer, sd, cid)
            if e is not None:
                raise RuntimeError(f"save {cid}: {short(e)}")
            states[cid] = clone_state(sd)
            order.append(cid)
            writer.wait_captured()
            mutate(sd, g)

        try:
            for k in range(n):
                save(f"step-{steps[k]:06d}", rng.random() < 0.3)
            close_writer(writer)
            writer = None
            did = perturb(env, rng, cfg, order)
            trial = f"#{i} {' + '.join(did)}"
            for x in did:
                res.note(x)
            if rng.random() < 0.4:
                save(f"step-{steps[n]:06d}", True)
                close_writer(writer)
                writer = None
                res.note("a new job saved after the changes")
                trial += " + new save"
            check_newest(res, trial, cfg, cfg_path, order, states)
            # gc with keep=1, through the library or the CLI: only the newest stays, on each tier
            keep1 = with_keep(cfgd, 1, 1)
            if rng.random() < 0.5:
                gc_checkpoints(config_from_dict(keep1))
            else:
                (d / "keep1.toml").write_text(toml_text(keep1))
                rc, _out = run_cli(["--config", str(d / "keep1.toml"), "gc"])
                if rc != 0:
                    res.fail(trial, f"tierckpt-restore gc exited {rc}")
            after = committed(cfg)
            for name in after:
                left = ids(after, name)
                if order[-1] not in left:
                    res.lose(trial, f"gc keep=1 deleted the newest commit {order[-1]} on {name} (left: {sorted(left)})")
                elif left != {order[-1]}:
                    res.fail(trial, f"gc keep=1 left {sorted(left)} on {name}, expected only {order[-1]}")
                else:
                    expect_loads(res, trial, only(cfg, name), states[order[-1]], order[-1], f"after gc ({name})")
        except BaseException as ex:  # noqa: BLE001
            res.fail(trial, f"harness error: {type(ex).__name__}: {ex}")
        finally:
            close_writer(writer)
        res.trials += 1
        env.cleanup(d, cfgd)
    res.seconds = time.perf_counter() - t0
    return res


# == case: backlog ==================================================================================

BACKLOG_KILLS = (("local.commit", "after"), ("s3.upload", "before"), ("s3.upload", "mid"), ("s3.commit", "before"),
                 ("no-s3", ""))


def case_backlog(env: Env, trials: int, seed: int, *, plan: tuple[str, ...] = ()) -> CaseResult:
    """``plan``: kill kinds to take in turn (``"local.commit"``, ``"s3.upload"``, ``"s3.commit"``,
    ``"no-s3"``); by default each trial draws one of :data:`BACKLOG_KILLS`."""
    res = CaseResult("backlog")
    t0 = time.perf_counter()
    if not env.has_s3:
        res.skipped = "no S3 server (--s3 none)"
        return res
    train_seed = seed % 1000
    ref = chaos.reference(env, train_seed)
    for i in range(trials):
        rng = random.Random(f"{seed}-backlog-{i}")
        kinds = [k for k in BACKLOG_KILLS if not plan or k[0] == plan[i % len(plan)]]
        point, when = rng.choice(kinds)
        d = env.fresh("backlog")
        cfgd = env.config(d, local_keep=rng.choice((2, 3)), s3_keep=0)  # S3 keeps everything
        cfg = config_from_dict(cfgd)
        cfg_path = d / "tiers.toml"
        cfg_path.write_text(toml_text(cfgd))
        run1_cfg = cfg_path
        extra: list[str] = []
        if point == "no-s3":  # the first job ran without [s3] (killed after a commit, or to the end)
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
        rc = wait_proc(p, 300)
        if rc is None or rc not in (0, 137, -9):
            res.fail(trial, f"first run failed (exit {rc}): {tail(d / 'run1.out')}")
        at = committed(cfg)
        s3_newest = max((s for _c, s in at.get("s3", [])), default=0)
        owed = {c for c, s in at["local"] if s > s3_newest}
        must = owed | ids(at, "s3")
        res.note(f"owed {len(owed)} at the kill")
        p = env.spawn("trainer", {"argv": trainer_argv(cfg_path, d / "run2.jsonl", train_seed, "--resume")}, d / "run2.out")
        rc2 = wait_proc(p, 300)
        if rc2 != 0:
            res.fail(trial, f"resumed run failed (exit {rc2}): {tail(d / 'run2.out')}")
        after = committed(cfg)
        for cid in sorted(owed - ids(after, "s3")):
            if cid in ids(after):
                res.fail(trial, f"{cid} (committed locally, newer than S3's newest at the kill) never reached S3")
            else:
                res.lose(trial, f"{cid} (owed to S3 at the kill) is gone from every tier")
        for cid in sorted(must - owed - ids(after)):
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
    """``corrupt`` (a CorruptCheckpoint/ChecksumMismatch), ``deleted under the reader`` (after it took
    its lease: a deletion ignored it), ``gone`` (being deleted / not committed) or ``unclear``."""
    if find_error(exc, CorruptCheckpoint) is not None:
        return "corrupt"
    texts = [str(e) for e in chaos.errors_in(exc)]
    if any(re.search(r"was deleted from .* while it was being read", t) for t in texts):
        return "deleted under the reader"
    if any(chaos._TIERCKPT_TEXT.search(t) for t in texts) and not any(GONE.search(t) for t in texts):
        return "corrupt"
    return "gone" if is_not_found(exc) or any(GONE.search(t) for t in texts) else "unclear"


def _loader_child(payload: dict) -> int:
    """Zygote child: load ``target`` until ``stop`` exists; one JSON line per load to ``results``."""
    cfg = config_from_dict(payload["config"])
    like = make_state(payload["state_seed"], big=payload["big"])
    stop = Path(payload["stop"])
    reader = TieredReader(cfg)
    deadline = time.monotonic() + payload.get("max_s", 120)
    with open(payload["results"], "a") as out:
        out.write(json.dumps({"event": "start"}) + "\n")
        out.flush()
        n = 0
        while not stop.exists() and time.monotonic() < deadline:
            n += 1
            target = placeholder(like)
            try:
                dcp.load(target, checkpoint_id=payload["target"], storage_reader=reader, no_dist=True)
            except BaseException as e:  # noqa: BLE001
                rec = {"n": n, "ok": False, "kind": classify(e), "err": short(e)}
            else:
                rec = {"n": n, "ok": True, "match": state_digest(target) == payload["digest"]}
            out.write(json.dumps(rec) + "\n")
            out.flush()
    return 0


def _results(path: Path) -> list[dict]:
    return [e for e in read_events(path) if "n" in e]


def case_gcload(env: Env, trials: int, seed: int) -> CaseResult:
    """gc and keep=1 saves racing a loader of an older checkpoint: bit-exact or 'being deleted'."""
    res = CaseResult("gcload")
    t0 = time.perf_counter()
    for i in range(trials):
        rng = random.Random(f"{seed}-gcload-{i}")
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        d = env.fresh("gcload")
        use_s3 = env.has_s3 and rng.random() < 0.6
        cfgd = env.config(d, s3=use_s3, local_keep=0, s3_keep=0, fsync=False, buffer="4MiB", chunk="1MiB")
        cfg = config_from_dict(cfgd)
        big = rng.choice((1, 2, 4)) << 20
        state_seed = rng.randrange(1 << 20)
        sd = make_state(state_seed, big=big)
        states: dict[str, dict] = {}
        action = rng.choice(("gc", "save", "gc+save"))
        kill_loader = rng.random() < 0.3
        trial = f"#{i} {action}{' +S3' if use_s3 else ''}{', loader killed' if kill_loader else ''}"
        writer: TieredWriter | None = None
        child = None
        try:
            writer = TieredWriter(cfg)
            n = rng.randint(2, 4)
            for k in range(1, n + 1):
                if (e := save_wait(writer, sd, f"step-{k:06d}")) is not None:
                    raise RuntimeError(f"save step-{k:06d}: {short(e)}")
                states[f"step-{k:06d}"] = clone_state(sd)
                writer.wait_captured()
                mutate(sd, g)
            close_writer(writer)
            writer = None
            target = f"step-{rng.randint(1, n - 1):06d}"
            results, stop = d / "loads.jsonl", d / "stop"
            child = env.spawn("loss-loader", {"config": cfgd, "target": target, "state_seed": state_seed, "big": big,
                                              "digest": state_digest(states[target]), "results": str(results),
                                              "stop": str(stop)}, d / "loader.out")
            deadline = time.monotonic() + 60
            while not read_events(results) and child.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            keep1 = config_from_dict(with_keep(cfgd, 1, 1))
            newest = f"step-{n:06d}"
            if "gc" in action:
                gres = gc_checkpoints(keep1)
                hit = [a for a in gres.actions if a.checkpoint_id == target]
                res.note("gc deleted the target" if any(a.deleted for a in hit) else "gc spared the leased target")
            if "save" in action:
                newest = f"step-{n + 1:06d}"
                writer = TieredWriter(keep1)
                if (e := save_wait(writer, sd, newest)) is not None:
                    raise RuntimeError(f"keep=1 save {newest}: {short(e)}")
                states[newest] = clone_state(sd)
                close_writer(writer)
                writer = None
            seen = len(_results(results))
            want = seen + rng.randint(1, 3)
            deadline = time.monotonic() + 60
            while len(_results(results)) < want and child.is_alive() and time.monotonic() < deadline:
                time.sleep(0.005 if kill_loader else 0.02)
                if kill_loader and len(_results(results)) > seen:
                    time.sleep(rng.uniform(0.0, 0.05))  # most likely inside the next load
                    child.kill()
            stop.touch()
            rc = wait_proc(child, 60)
            if rc not in (0, -9, 137) or (rc != 0 and not kill_loader):
                res.fail(trial, f"loader exited {rc}: {tail(d / 'loader.out')}")
            loads = _results(results)
            for r in loads:
                if r["ok"]:
                    res.note("load ok" if r["match"] else "load WRONG")
                    if not r["match"]:
                        res.lose(trial, f"load #{r['n']} of {target} returned WRONG bytes without an error")
                elif r["kind"] == "gone":
                    res.note("load refused: deleted")
                else:
                    res.fail(trial, f"load #{r['n']} of {target} failed with a {r['kind']} error: {r['err']}")
            # the loader is gone: its leases must not keep gc from deleting the target now
            gc_checkpoints(keep1)
            after = committed(cfg)
            for name in after:
                left = ids(after, name)
                if newest not in left:
                    res.lose(trial, f"the newest commit {newest} is gone from {name} (left: {sorted(left)})")
                elif left != {newest}:
                    res.fail(trial, f"gc keep=1 after the loader ended left {sorted(left)} on {name}")
                else:
                    expect_loads(res, trial, only(cfg, name), states[newest], newest, f"after gc ({name})")
        except BaseException as ex:  # noqa: BLE001
            res.fail(trial, f"harness error: {type(ex).__name__}: {ex}")
        finally:
            close_writer(writer)
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
    each step of ``steps`` (the reference for any step, however many restarts it took)."""
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
        loss = loss_fn(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step + 1 in want:
            out[step + 1] = digest(model, optim)
    Path(payload["out"]).write_text(json.dumps(out))
    return 0


def kill_stage(ev: list[dict], newest_step: int) -> str:
    """Where a kill landed, from the killed run's log and what is committed."""
    kinds = [e.get("event") for e in ev]
    if "start" not in kinds:
        return "startup"
    if "resumed" not in kinds and "fresh" not in kinds:
        return "resume load"
    last_step = max((e["step"] for e in ev if e.get("event") == "step"), default=0)
    last_save = max((e["step"] for e in ev if e.get("event") == "save"), default=0)
    if last_step > last_save:
        return "training step or dcp.save"
    return "save in flight (capture/flush/commit)" if last_save > newest_step else "after a commit"


def _chain(env: Env, res: CaseResult, rng: random.Random, train_seed: int, with_s3: bool, n: int, first: int,
           checks: list[tuple[str, int, str]]) -> tuple[dict, Path]:
    """``n`` kill+restart trials on one tier setup; appends (trial, step, digest) of each load to ``checks``."""
    d = env.fresh("killloop")
    cfgd = env.config(d, s3=with_s3, local_keep=3, s3_keep=2)
    cfg = config_from_dict(cfgd)
    cfg_path = d / "tiers.toml"
    cfg_path.write_text(toml_text(cfgd))
    t = TRAIN
    prev: str | None = None  # latest after the previous kill
    for j in range(n):
        trial = f"#{first + j} {'local+s3' if with_s3 else 'local'}"
        log, out = d / f"run{j:03d}.jsonl", d / f"run{j:03d}.out"
        argv = ["--config", str(cfg_path), "--steps", "1000000", "--ckpt-every", "1", "--log", str(log), "--seed",
                str(train_seed), "--d-model", str(t["d_model"]), "--layers", str(t["layers"]), "--batch", str(t["batch"]),
                "--ctx", str(t["ctx"]), "--digests", "--resume"]
        p = env.spawn("trainer", {"argv": argv}, out)
        until = time.monotonic() + (rng.uniform(0.0, 0.5) if rng.random() < 0.25 else rng.uniform(0.3, 2.5))
        while time.monotonic() < until and p.is_alive():
            time.sleep(0.02)
        alive = p.is_alive()
        p.kill()
        rc = wait_proc(p, 30)
        res.trials += 1
        if not alive:
            res.fail(trial, f"the trainer exited by itself (exit {rc}) before the kill: {tail(out)}")
        com = committed(cfg)
        every = ids(com)
        newest = max(every, key=lambda c: step_of(c) or -1) if every else None
        ev = read_events(log)
        res.note(f"killed: {kill_stage(ev, (step_of(newest) or 0) if newest else 0)}")
        resumed = next((e for e in ev if e.get("event") == "resumed"), None)
        if resumed is not None:
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
    """SIGKILL at random times, each restart resuming from latest + 1: latest always loads bit-exact."""
    res = CaseResult("killloop")
    t0 = time.perf_counter()
    rng = random.Random(f"{seed}-killloop")
    train_seed = seed % 1000
    n_s3 = round(trials * s3_share) if env.has_s3 else 0
    checks: list[tuple[str, int, str]] = []
    chains = [_chain(env, res, rng, train_seed, s3, n, first, checks)
              for s3, n, first in ((False, trials - n_s3, 0), (True, n_s3, trials - n_s3)) if n]
    # every committed checkpoint, then the reference digests for every step looked at
    finals = []
    for cfgd, d in chains:
        com = committed(config_from_dict(cfgd))
        finals.append(com)
    logged: dict[int, set[str]] = {}
    for _cfgd, d in chains:
        for f in sorted(d.glob("run*.jsonl")):
            for e in read_events(f):
                if e.get("event") == "save" and "digest" in e:
                    logged.setdefault(e["step"], set()).add(e["digest"])
    needed = {s for _t, s, _d in checks} | {step_of(c) or 0 for com in finals for c in ids(com)}
    needed |= set(rng.sample(sorted(logged), min(30, len(logged))))
    refd = env.fresh("killloop-ref")
    p = env.spawn("loss-digests", {"seed": train_seed, "steps": sorted(needed - {0}), "out": str(refd / "ref.json")},
                  refd / "ref.out")
    if wait_proc(p, 600) != 0:
        res.fail("reference", f"the reference replay failed: {tail(refd / 'ref.out')}")
        res.seconds = time.perf_counter() - t0
        return res
    ref_digest = {int(k): v for k, v in json.loads((refd / "ref.json").read_text()).items()}
    for s, digs in logged.items():
        if s in ref_digest and digs != {ref_digest[s]}:
            res.fail("reference", f"step {s}: the trainer logged digest(s) {sorted(x[:12] for x in digs)}, the "
                                  f"replay {ref_digest[s][:12]} (replay or trainer not deterministic)")
    for trial, s, dig in checks:
        if dig != ref_digest.get(s):
            res.lose(trial, f"the state loaded for step {s} differs from the reference")
    ref = Reference.__new__(Reference)
    ref.seed, ref.digest = train_seed, ref_digest
    for cfgd, d in chains:
        check_tiers(res, "end", config_from_dict(cfgd), ref, "at the end of the kill loop")
        env.cleanup(d, cfgd)
    env.cleanup(refd)
    res.seconds = time.perf_counter() - t0
    return res


CASE_FUNCS = {"filetimes": case_filetimes, "backlog": case_backlog, "gcload": case_gcload, "killloop": case_killloop}
chaos.register_cases(CASE_FUNCS, {"loss-loader": _loader_child, "loss-digests": _digests_child})
