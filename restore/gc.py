"""``gc``: apply the retention policy now, per tier, as the writer does after each commit.

Per tier, with :func:`tierckpt.retention.plan_retention`: the newest ``keep`` committed
checkpoints stay (the tier's ``keep`` and ``keep_every`` flags, from its configuration section:
``[local] keep``; ``[s3] keep`` plus every checkpoint whose step is a multiple of
``[s3] keep_every``; 0 keeps all), in commit order (the sequence in each metadata header,
never file times). The newest committed checkpoint of a tier is never deleted, nor one that is
leased (being loaded, fetched, verified, consolidated or saved by any process), nor a local one
that S3 should get and lacks (a job's promoter uploads it). Partial (never committed) checkpoints
go once no live save or fetch holds a lease on them. Every deletion runs the lease protocol
(:mod:`tierckpt.lease`): metadata first, then exactly the objects listed. Leftovers of interrupted
writes older than ``[job] commit_timeout`` go too (``Tier.abort_stale``: S3 multipart uploads; on a
local tier the half-written files of killed processes, such as a peer copy whose receiving node
died mid-transfer: orphan replicas).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from tierckpt.catalog.lease import live_leases
from tierckpt.catalog.listing import committed_in_order, list_checkpoints
from tierckpt.chain.retention import RetentionPlan, apply_retention, plan_retention
from tierckpt.config import TierConfig
from tierckpt.errors import TierckptError
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
        return {
            "dry_run": self.dry_run,
            "actions": [a.to_json() for a in self.actions],
            "kept": self.kept,
            "aborted_uploads": self.aborted_uploads,
        }


def owed_to_next_tier(tiers: list[Tier], keep_every: int = 0) -> set[str]:
    """Checkpoints committed on an earlier tier of ``tiers`` (fastest first) that the last tier
    should get and lacks: newer than its newest, or ``keep_every`` milestones. A job's promoter
    uploads them (its backlog pass); gc must not delete them meanwhile."""
    if len(tiers) < 2:
        return set()
    last = committed_in_order(tiers[-1])
    have = {c.checkpoint_id for c in last}
    newest = last[-1].header.seq if last else 0  # type: ignore[union-attr]
    owed: set[str] = set()
    for t in tiers[:-1]:
        for c in committed_in_order(t):
            assert c.header is not None
            milestone = bool(keep_every) and c.step is not None and c.step % keep_every == 0
            if c.checkpoint_id not in have and (c.header.seq > newest or milestone):
                owed.add(c.checkpoint_id)
    return owed


def gc_checkpoints(
    config: TierConfig | str | os.PathLike | None, *, dry_run: bool = False, tier: str | None = None
) -> GcResult:
    """Apply retention on every configured tier (or only ``tier``); with ``dry_run`` delete nothing.

    Returns what went (or would go) and what stays. See the module docstring for the rules.
    """
    cfg = as_config(config)
    every = open_tiers(cfg)
    tiers = [t for t in every if tier is None or t.name == tier]
    if tier is not None and not tiers:
        open_tiers(cfg, tier)  # raises the usage error naming the missing section
    res = GcResult(dry_run=dry_run)
    try:
        try:
            owed = owed_to_next_tier(every, every[-1].keep_every)
        except TierckptError as e:
            log.warning(
                "cannot tell which checkpoints are not on %s yet (%s): keeping every committed one", every[-1].url, e
            )
            owed = {c.checkpoint_id for t in every[:-1] for c in list_checkpoints(t) if c.committed}
        for t in tiers:
            infos = list_checkpoints(t)
            leased = set(live_leases(t))
            keep, keep_every = t.keep, t.keep_every
            protect = leased | (owed if t is not every[-1] else set())
            plan = plan_retention(infos, keep, keep_every, protect)
            sizes = {c.checkpoint_id: c.size for c in infos}
            res.kept[t.name] = plan.keep
            for cid in sorted(leased & {c.checkpoint_id for c in infos}):
                log.info("%s: %s is in use (leased): kept", t.url, cid)
            for cid in sorted(owed & {c.checkpoint_id for c in infos if c.committed}):
                if t is not every[-1]:
                    log.info("%s: %s is not on %s yet: kept", t.url, cid, every[-1].url)
            for cid, why in plan.delete:
                action = GcAction(t.name, cid, why, sizes.get(cid, 0))
                res.actions.append(action)
                if not dry_run:
                    action.deleted = bool(apply_retention(t, RetentionPlan(delete=[(cid, why)], keep=[]), infos))
            if not dry_run:
                res.aborted_uploads += t.abort_stale(cfg.job.commit_timeout, lambda: set(live_leases(t)))
        if not dry_run:
            for t in tiers:
                t.wait_deletions()  # deletions may finish in the background: gc returns when they are done
        return res
    finally:
        for t in every:
            t.close()
