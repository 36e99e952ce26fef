"""``gc``: apply the retention policy now, per tier, as the writer does after each commit.

Per tier, with :func:`tierckpt.retention.plan_retention`: the newest ``keep`` committed
checkpoints stay (``[local] keep``; ``[s3] keep`` plus every checkpoint whose step is a multiple
of ``[s3] keep_every``; 0 keeps all), and partial (never committed) checkpoints are removed when
they were last touched before the newest committed checkpoint on that tier *started* (its
``created`` time): such a save can no longer commit. The newest committed checkpoint of a tier is
never deleted. On S3, multipart uploads older than ``[job] commit_timeout`` are aborted too.

A checkpoint being saved right now is safe: it is newer than the newest committed one. A
``fetch`` interrupted into a checkpoint *older* than the newest local one may be removed; it
then starts over.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from tierckpt.commit import list_checkpoints
from tierckpt.config import TierConfig
from tierckpt.errors import CheckpointNotFound, CorruptCheckpoint
from tierckpt.reader import read_checkpoint_metadata
from tierckpt.retention import RetentionPlan, apply_retention, plan_retention
from tierckpt.tiers.local import drain_deletions
from tierckpt.tiers.base import Tier

from .catalog import as_config, open_tiers

__all__ = ["GcAction", "GcResult", "gc_checkpoints"]

log = logging.getLogger("tierckpt.restore")


@dataclass
class GcAction:
    tier: str
    checkpoint_id: str
    reason: str
    size: int
    deleted: bool = False

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class GcResult:
    dry_run: bool
    actions: list[GcAction] = field(default_factory=list)
    kept: dict[str, list[str]] = field(default_factory=dict)  # tier -> ids kept
    aborted_uploads: int = 0

    def to_json(self) -> dict:
        return {"dry_run": self.dry_run, "actions": [a.to_json() for a in self.actions], "kept": self.kept,
                "aborted_uploads": self.aborted_uploads}


def _policy(cfg: TierConfig, tier: Tier) -> tuple[int, int]:
    if tier.name == "s3" and cfg.s3 is not None:
        return cfg.s3.keep, cfg.s3.keep_every
    if cfg.local is not None:
        return cfg.local.keep, 0
    return 0, 0


def gc_checkpoints(config: TierConfig | str | os.PathLike | None, *, dry_run: bool = False,
                   tier: str | None = None) -> GcResult:
    """Apply retention on every configured tier (or only ``tier``); with ``dry_run`` delete nothing.

    Returns what went (or would go) and what stays. See the module docstring for the rules.
    """
    cfg = as_config(config)
    tiers = open_tiers(cfg, tier)
    res = GcResult(dry_run=dry_run)
    try:
        for t in tiers:
            infos = list_checkpoints(t)
            committed = [c for c in infos if c.committed]
            partial_before = None
            if committed:
                newest = committed[-1].checkpoint_id
                try:
                    _md, man = read_checkpoint_metadata(t, newest)
                    partial_before = man.created
                except (CorruptCheckpoint, CheckpointNotFound) as e:
                    log.warning("%s: cannot read the metadata of %s (%s); leaving partial checkpoints alone", t.url, newest, e)
            keep, keep_every = _policy(cfg, t)
            plan = plan_retention(infos, keep, keep_every, frozenset(), partial_before)
            sizes = {c.checkpoint_id: c.size for c in infos}
            res.kept[t.name] = plan.keep
            for cid, why in plan.delete:
                action = GcAction(t.name, cid, why, sizes.get(cid, 0))
                res.actions.append(action)
                if not dry_run:
                    apply_retention(t, RetentionPlan(delete=[(cid, why)], keep=[]))
                    action.deleted = True
            if not dry_run:
                abort = getattr(t, "abort_stale_uploads", None)
                if abort is not None:
                    res.aborted_uploads += abort("", older_than_s=cfg.job.commit_timeout)
        if not dry_run:
            drain_deletions()  # local deletions finish in the background: gc returns when they are done
        return res
    finally:
        for t in tiers:
            t.close()
