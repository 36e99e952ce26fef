"""Cases ``damagedsource`` and ``missingsource``: the S3 object that ``copy_unchanged`` copies
unchanged frames from is damaged, deleted or cut short behind the job's back (issue #32, items 1
and 2).

Set-up of every trial: ``[local] keep = 1`` and ``[s3] compression = "zstd"``,
``copy_unchanged = true``, ``keep = 0``; a state of one frozen float tensor (6-14 MiB, the same
bytes at every step, so its frames are copied server-side from the previous checkpoint's object)
and a small tensor that changes every step; 3-4 checkpoints saved in turn (each ``wait()``-ed,
sometimes from a new writer engine: a restart, whose previous index comes from S3's listing).
After the checkpoint of a random step ``j`` (not the last) commits, its S3 data object is
damaged. With ``keep = 1`` the local copy of every older checkpoint is deleted by retention, so
S3 holds the only copy of each: a bad copy on S3 is a checkpoint lost.

Checks: every save succeeds (a bad copy source is never a reason to fail a promotion, nor to stop
promoting); every checkpoint after ``j`` is committed on S3 and loads bit-exact from S3 alone; the
damaged checkpoint ``j``, once gone locally, is refused with a clear error (never loaded with
other bytes); a trial that does not end within :data:`TRIAL_TIMEOUT` seconds is ``hung``. A
checkpoint that was saved and is then on no tier, or on no tier it loads bit-exact from, is
``lost``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from chaoslib.core import BUCKET, CaseResult, MiB, is_clear, load_state, only, short
from chaoslib.env import Env
from chaoslib.faults import close_writer, save_wait
from chaoslib.loss import committed, ids, open_tier
from tierckpt import TieredWriter
from tierckpt.catalog.listing import read_checkpoint_doc
from tierckpt.config import TierConfig, config_from_dict
from tierckpt.format.layout import data_key
from tierckpt.testing import clone_state
from tierckpt.testing import compare as diff

TRIAL_TIMEOUT = 240.0
"""Seconds one trial (3-4 saves of at most 14 MiB and the loads) may take before it counts as hung."""

DAMAGES = {
    "damagedsource": ("one byte flipped", "bytes flipped in 2-3 frames", "a frame zeroed"),
    "missingsource": ("deleted", "truncated", "emptied"),
}


def _state(frozen: torch.Tensor, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"frozen": frozen, "head": torch.randn(3000, generator=g)}, "meta": {"step": step}}


def _s3_object(cfg: TierConfig, cid: str) -> tuple[str, Any, tuple[int, int]]:
    """(full S3 key, stored index, byte range of the frozen tensor in the logical file) of
    ``cid``'s only data file on S3."""
    tier = open_tier(cfg, "s3")
    try:
        doc = read_checkpoint_doc(tier, cid)
    finally:
        tier.close()
    ((file, idx),) = doc.manifest.stored.items()
    ((rec,),) = [[r for i, r in doc.items if i.fqn == "model.frozen"]]
    assert cfg.s3 is not None
    return f"{cfg.s3.prefix}/{data_key(cid, file)}", idx, (rec.pos, rec.pos + rec.length)


def _damage(env: Env, rng: random.Random, case: str, cfg: TierConfig, cid: str) -> str:
    """Damage ``cid``'s S3 data object as ``case`` says; returns what was done."""
    full, idx, (lo, hi) = _s3_object(cfg, cid)
    client = env.client()
    kind = rng.choice(DAMAGES[case])
    if kind == "deleted":
        client.delete_object(Bucket=BUCKET, Key=full)
        return kind
    body = bytearray(client.get_object(Bucket=BUCKET, Key=full)["Body"].read())
    if kind == "truncated":
        n = rng.randrange(1, len(body))
        del body[n:]
        what = f"truncated to {n} of {idx.stored} bytes"
    elif kind == "emptied":
        body.clear()
        what = kind
    else:
        inside = [k for k in range(idx.frames) if lo <= idx.span(k)[0] and idx.span(k)[1] <= hi] or list(
            range(idx.frames)
        )
        frames = rng.sample(inside, 1 if kind == "one byte flipped" else min(len(inside), rng.randint(2, 3)))
        for k in frames:
            a, b = idx.offsets[k], idx.offsets[k + 1]
            if kind == "a frame zeroed":
                body[a:b] = bytes(b - a)
            else:
                body[rng.randrange(a, b)] ^= 1 << rng.randrange(8)
        what = f"{kind} (frames {sorted(frames)} of {idx.frames})"
    client.put_object(Bucket=BUCKET, Key=full, Body=bytes(body))
    return what


def _check(res: CaseResult, trial: str, cfg: TierConfig, states: dict[str, dict], damaged: str) -> None:
    """The checks of the module docstring, once every save returned."""
    at = committed(cfg)
    s3cfg = only(cfg, "s3")
    assert s3cfg is not None
    for cid, sd in states.items():
        where = "locally" if cid in ids(at, "local") else ""
        if cid == damaged:
            try:
                got, _reader = load_state(cfg, sd, cid)
            except BaseException as e:  # noqa: BLE001
                if where:
                    res.lose(trial, f"{cid} (damaged on S3, intact locally) does not load: {short(e)}")
                elif not is_clear(e):
                    res.fail(trial, f"{cid} (damaged on S3, gone locally) refused without a clear error: {short(e)}")
                continue
            if diff(sd, got):
                res.lose(trial, f"{cid} (damaged on S3) loaded WRONG bytes without an error")
            continue
        if cid not in ids(at, "s3"):
            if where:
                res.fail(trial, f"{cid} was never promoted to S3 (committed locally only)")
            else:
                res.lose(trial, f"{cid} is committed on no tier")
            continue
        try:
            got, reader = load_state(s3cfg, sd, cid)
        except BaseException as e:  # noqa: BLE001
            (res.fail if where else res.lose)(trial, f"{cid} does not load from S3: {short(e)}")
            continue
        if bad := diff(sd, got):
            res.lose(trial, f"{cid} loaded WRONG bytes from S3 in {bad[:4]}")


def _trial(env: Env, res: CaseResult, case: str, rng: random.Random, trial_no: int) -> None:
    d = env.fresh(case)
    cfgd = env.config(
        d,
        local_keep=1,
        s3_keep=0,
        buffer="16MiB",
        chunk=rng.choice(("256KiB", "1MiB", "4MiB")),
        fsync=False,
        commit_timeout=60.0,
        compression="zstd",
        copy_unchanged=True,
    )
    cfg = config_from_dict(cfgd)
    n = rng.randint(3, 4)
    j = rng.randint(1, n - 1)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    frozen = (torch.randn(rng.randint(6, 14) * MiB // 4, generator=g) * 0.02).to(torch.float32)
    trial = f"#{trial_no}"
    states: dict[str, dict] = {}
    damaged = ""
    writer: TieredWriter | None = None
    try:
        for step in range(1, n + 1):
            if writer is None or rng.random() < 0.3:
                close_writer(writer)
                writer = TieredWriter(cfg)
            cid = f"step-{step}"
            sd = _state(frozen, step)
            states[cid] = clone_state(sd)  # a failed save may still have committed on some tier: checked too
            if (e := save_wait(writer, sd, cid)) is not None:
                res.fail(trial, f"save of {cid} failed: {short(e)}")
                continue
            st = writer.history[-1]
            if step > j and st.copied_bytes:
                res.note("later saves still copied")
            if step == j:
                if rng.random() < 0.5:  # a restart: the next promotion finds its source by listing S3
                    close_writer(writer)
                    writer = None
                what = _damage(env, rng, case, cfg, cid)
                damaged, trial = cid, f"#{trial_no} {cid} {what}"
                res.note(what.split(" (")[0].split(" to ")[0])
    finally:
        close_writer(writer)
    _check(res, trial, cfg, states, damaged)
    env.cleanup(d, cfgd)


def _run_case(env: Env, case: str, trials: int, seed: int) -> CaseResult:
    res = CaseResult(case)
    t0 = time.perf_counter()
    if not env.has_s3:
        res.skipped = "no S3 server (--s3 none)"
        return res
    hung = 0
    for i in range(trials):
        rng = random.Random(f"{seed}-{case}-{i}")
        err: list[BaseException] = []

        def body(rng: random.Random = rng, i: int = i, err: list[BaseException] = err) -> None:
            try:
                _trial(env, res, case, rng, i)
            except BaseException as e:  # noqa: BLE001 - reported as a failure of the trial
                err.append(e)

        t = threading.Thread(target=body, name=f"chaos-{case}-{i}", daemon=True)
        t.start()
        t.join(TRIAL_TIMEOUT)
        if t.is_alive():
            hung += 1
            res.fail(f"#{i}", f"HUNG: the trial did not end within {TRIAL_TIMEOUT:.0f} s")
            break  # its writer may still hold the S3 server; later trials would not be independent
        if err:
            res.fail(f"#{i}", f"trial crashed: {short(err[0])}")
        res.trials += 1
    res.note("hung", hung)
    res.seconds = time.perf_counter() - t0
    return res


def case_damagedsource(env: Env, trials: int, seed: int) -> CaseResult:
    """Bytes flipped (or a frame zeroed) inside the frames of the copy source's S3 object: later
    checkpoints must not copy them (module docstring)."""
    return _run_case(env, "damagedsource", trials, seed)


def case_missingsource(env: Env, trials: int, seed: int) -> CaseResult:
    """The copy source's S3 data object deleted, truncated or emptied (its metadata left): later
    promotions must upload instead of copying, and commit whole objects (module docstring)."""
    return _run_case(env, "missingsource", trials, seed)


CASE_FUNCS: dict[str, Callable[..., CaseResult]] = {
    "damagedsource": case_damagedsource,
    "missingsource": case_missingsource,
}
