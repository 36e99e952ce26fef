"""Cases ``faults`` (ENOSPC/EROFS injected into local writes) and ``corrupt`` (a flipped byte)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import chaos_tiers
import torch
import torch.distributed.checkpoint as dcp

from chaoslib.core import BUCKET, CaseResult, is_clear, is_not_found, load_state, make_state, mutate, only, short
from chaoslib.env import Env
from tierckpt import TierckptError, TieredWriter
from tierckpt.config import TierConfig, config_from_dict
from tierckpt.format.layout import split_key
from tierckpt.testing import clone_state, raw
from tierckpt.testing import compare as diff

# == case: faults ==================================================================================

FAULT_OPS = ("local.write", "local.open", "local.close", "local.commit")


def save_wait(writer: TieredWriter, sd: dict, cid: str) -> BaseException | None:
    """``dcp.save`` + ``writer.wait()``; the error, if any."""
    try:
        dcp.save(sd, checkpoint_id=cid, storage_writer=writer, no_dist=True)
        writer.wait()
    except BaseException as e:  # noqa: BLE001
        return e
    return None


def expect_loads(res: CaseResult, trial: Any, cfg: TierConfig, expected: dict, cid: str, what: str) -> bool:
    try:
        got, reader = load_state(cfg, expected, cid)
    except BaseException as e:  # noqa: BLE001
        res.lose(trial, f"{what}: {cid} does not load: {short(e)}")
        return False
    bad = diff(expected, got)
    if bad:
        res.lose(trial, f"{what}: {cid} loaded WRONG bytes in {bad[:4]}")
        return False
    return True


def expect_refused(res: CaseResult, trial: Any, cfg: TierConfig, like: dict, cid: str, what: str) -> None:
    try:
        load_state(cfg, like, cid)
    except BaseException as e:  # noqa: BLE001
        if not is_not_found(e):
            res.fail(trial, f"{what}: {cid} refused, but not as CheckpointNotFound: {short(e)}")
        return
    res.lose(trial, f"{what}: uncommitted {cid} was LOADED")


def leftovers(root: Path) -> tuple[int, int]:
    """(data files inside committed checkpoints that their metadata does not name, files of
    uncommitted checkpoints) on a local tier root."""
    by_id: dict[str, list[str]] = {}
    for p in root.rglob("*"):
        if p.is_file():
            sk = split_key(p.relative_to(root).as_posix())
            if sk is not None:
                by_id.setdefault(sk[0], []).append(sk[1])
    orphans = partial = 0
    for cid, names in by_id.items():
        if "metadata.json" not in names:
            partial += len(names)
            continue
        body = (root / cid / "metadata.json").read_bytes().partition(b"\n")[2]
        named = set(json.loads(body)["files"])
        orphans += sum(1 for n in names if n != "metadata.json" and n not in named)
    return orphans, partial


def close_writer(writer: TieredWriter | None) -> None:
    if writer is None:
        return
    with contextlib.suppress(BaseException):
        writer.engine.close()
    for t in writer.engine.chain.built():
        with contextlib.suppress(BaseException):
            (t.real if isinstance(t, chaos_tiers.TierProxy) else t).close()


def case_faults(env: Env, trials: int, seed: int) -> CaseResult:
    res = CaseResult("faults")
    t0 = time.perf_counter()
    for i in range(trials):
        rng = random.Random(f"{seed}-faults-{i}")
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        d = env.fresh("faults")
        cfgd = env.config(d, s3=rng.random() < 0.5, local_keep=0, s3_keep=0, fsync=False)
        cfg = config_from_dict(cfgd)
        op = rng.choice(FAULT_OPS)
        err = rng.choice((errno.ENOSPC, errno.EROFS))
        trial = f"#{i} {op} {errno.errorcode[err]}"
        writer = None
        try:
            writer = TieredWriter(cfg)
            ctl = chaos_tiers.FaultController()
            chaos_tiers.wrap_engine(writer.engine, ctl)
            sd = make_state(rng.randrange(1 << 20))
            good: dict[str, dict] = {}
            for n in range(1, rng.randint(1, 2) + 1):
                cid = f"step-{n:06d}"
                e = save_wait(writer, sd, cid)
                if e is not None:
                    res.fail(trial, f"save {cid} before the fault failed: {short(e)}")
                good[cid] = clone_state(sd)
                writer.wait_captured()
                mutate(sd, g)
            n += 1
            bad_id = f"step-{n:06d}"
            nchunks = -(-sum(raw(v).numel() for v in sd["model"].values()) // (256 << 10))
            k = rng.randint(1, max(1, nchunks)) if op == "local.write" else 1
            ctl.arm(op, k, err)
            e = save_wait(writer, sd, bad_id)
            ctl.disarm()
            if e is None:
                res.fail(trial, f"save {bad_id} with {errno.errorcode[err]} in {op} succeeded (fired: {ctl.fired})")
            else:
                msg = str(e)
                if not isinstance(e, TierckptError):
                    res.fail(trial, f"wait() raised {type(e).__name__}, not a TierckptError: {msg[:200]}")
                elif bad_id not in msg:
                    res.fail(trial, f"the error does not name the checkpoint {bad_id}: {msg[:200]}")
                elif os.strerror(err) not in msg and errno.errorcode[err] not in msg and "disk full" not in msg:
                    res.fail(trial, f"the error does not name the cause ({os.strerror(err)}): {msg[:200]}")
                else:
                    res.note(f"{op} failed clearly")
            with contextlib.suppress(BaseException):
                writer.wait()  # nothing left to raise
            for cid, st in good.items():
                expect_loads(res, trial, cfg, st, cid, "after the fault")
            if e is not None:
                expect_refused(res, trial, cfg, sd, bad_id, "after the fault")
                if cfg.s3 is not None:
                    expect_refused(res, trial, only(cfg, "s3"), sd, bad_id, "after the fault (S3)")
            # training goes on: the next save commits (a retry of the same id, or the next one)
            writer.wait_captured()
            mutate(sd, g)
            next_id = bad_id if (e is not None and rng.random() < 0.5) else f"step-{n + 1:06d}"
            e2 = save_wait(writer, sd, next_id)
            if e2 is not None:
                res.fail(trial, f"the save after the fault ({next_id}) failed: {short(e2)}")
            else:
                expect_loads(res, trial, cfg, sd, next_id, "after the fault")
                expect_loads(res, trial, cfg, sd, "latest", "after the fault (latest)")
                orphans, partial = leftovers(cfg.local.resolved_path())
                if orphans:
                    res.note("unreferenced data file left in a committed checkpoint (retried id)")
                if partial:
                    res.note("files of the failed checkpoint left after the next commit")
                if cfg.s3 is not None:
                    expect_loads(res, trial, only(cfg, "s3"), sd, next_id, "after the fault (S3)")
        except BaseException as ex:  # noqa: BLE001
            res.fail(trial, f"harness error: {type(ex).__name__}: {ex}")
        finally:
            close_writer(writer)
        res.trials += 1
        env.cleanup(d, cfgd)
    res.seconds = time.perf_counter() - t0
    return res


# == case: corrupt =================================================================================


def case_corrupt(env: Env, trials: int, seed: int) -> CaseResult:
    res = CaseResult("corrupt")
    t0 = time.perf_counter()
    rng = random.Random(f"{seed}-corrupt")
    d = env.fresh("corrupt")
    cfgd = env.config(d, local_keep=0, s3_keep=0, fsync=False)
    cfg = config_from_dict(cfgd)
    writer = TieredWriter(cfg)
    states: dict[str, dict] = {}
    try:
        for _n, cid in enumerate(("step-000001", "step-000002")):
            sd = make_state(rng.randrange(1 << 20))
            e = save_wait(writer, sd, cid)
            if e is not None:
                raise RuntimeError(f"corrupt: cannot save {cid}: {e}")
            states[cid] = clone_state(sd)
    finally:
        close_writer(writer)
    # every file of both checkpoints, on each tier
    files: list[tuple[str, str]] = []  # (tier, key)
    root = cfg.local.resolved_path()
    for p in sorted(root.rglob("*")):
        if p.is_file() and split_key(p.relative_to(root).as_posix()) is not None:
            files.append(("local", p.relative_to(root).as_posix()))
    prefix = cfgd.get("s3", {}).get("prefix", "")
    if env.has_s3:
        c = env.client()
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
            for o in page.get("Contents", ()):
                key = o["Key"][len(prefix) + 1 :]
                if split_key(key) is not None:
                    files.append(("s3", key))
    tiers = sorted({t for t, _ in files})

    def read(tier: str, key: str) -> bytes:
        if tier == "local":
            return (root / key).read_bytes()
        return env.client().get_object(Bucket=BUCKET, Key=f"{prefix}/{key}")["Body"].read()

    def write(tier: str, key: str, data: bytes) -> None:
        if tier == "local":
            path = root / key
            st = path.stat()
            path.write_bytes(data)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the commit order is the files' mtime order
        else:
            env.client().put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=data)

    def restore(tier: str, key: str, data: bytes) -> None:
        write(tier, key, data)
        if tier == "s3" and key.endswith("metadata.json"):
            # S3's LastModified is the commit time: re-put the newer commits after it, in order
            # (same bytes), so that the rewrite does not make an older checkpoint 'latest'
            cid = split_key(key)[0]
            for newer in sorted(states):
                if newer > cid:
                    k = f"{newer}/metadata.json"
                    write("s3", k, read("s3", k))

    for i in range(trials):
        tier, key = rng.choice(files)
        cid = split_key(key)[0]
        original = read(tier, key)
        at = rng.randrange(len(original))
        mask = rng.randrange(1, 256)
        flipped = bytearray(original)
        flipped[at] ^= mask
        kind = "metadata" if key.endswith("metadata.json") else "data"
        reader_tiers = rng.choice([tiers, [tier]]) if len(tiers) > 1 else tiers
        rcfg = cfg if len(reader_tiers) > 1 else only(cfg, reader_tiers[0])
        target_id = rng.choice([cid, "latest"])
        trial = f"#{i} {kind} on {tier} [{at}]^{mask:#04x} via {'+'.join(reader_tiers)} load {target_id}"
        write(tier, key, bytes(flipped))
        try:
            try:
                got, reader = load_state(rcfg, states[cid], target_id)
            except BaseException as e:  # noqa: BLE001
                if not is_clear(e):
                    res.fail(trial, f"failed without a tierckpt error: {short(e)}")
                elif len(reader_tiers) > 1:
                    res.fail(trial, f"failed although the other tier holds an intact copy: {short(e)}")
                else:
                    res.note(f"{kind} on {tier}: clear error")
                continue
            resolved = reader.resolved_id
            expected = states.get(resolved or "")
            if expected is None:
                res.lose(trial, f"loaded unknown checkpoint {resolved}")
                continue
            bad = diff(expected, got)
            newest = max(states)
            if bad:
                res.lose(trial, f"SILENTLY WRONG load of {resolved}: {bad[:4]} differ")
            elif (
                target_id == "latest"
                and resolved != newest
                and (len(reader_tiers) > 1 or not (kind == "metadata" and cid == newest))
            ):
                res.fail(trial, f"latest resolved to {resolved}, not to the newest intact {newest}")
            else:
                if resolved != cid and cid == newest:
                    res.note(f"{kind} on {tier}: latest skipped the corrupt newest")
                elif resolved != cid:
                    res.note(f"{kind} on {tier}: latest (intact) loaded")
                elif len(reader_tiers) > 1:
                    res.note(f"{kind} on {tier}: bit-exact from the other tier")
                else:
                    res.note(f"{kind} on {tier}: bit-exact (harmless flip)")
        finally:
            restore(tier, key, original)
            res.trials += 1
    env.cleanup(d, cfgd)
    res.seconds = time.perf_counter() - t0
    return res
