"""Helpers of the "no committed checkpoint is ever lost" cases (``tools/chaos_loss.py``): state
digests, committed ids per tier, saving a series, the restore CLI in-process."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import random
from typing import Any

import torch

from chaoslib.core import CaseResult, mutate, only, short
from chaoslib.faults import close_writer, expect_loads, save_wait
from tierckpt import TieredWriter
from tierckpt.catalog.listing import committed_in_order
from tierckpt.config import TierConfig
from tierckpt.testing import clone_state, raw
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


def save_series(
    cfg: TierConfig,
    sd: dict,
    g: torch.Generator,
    cids: list[str],
    rng: random.Random | None = None,
    new_job: float = 0.0,
) -> dict[str, dict]:
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
