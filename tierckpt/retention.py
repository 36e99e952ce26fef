"""What to keep on each tier, what to delete, and when it is safe.

Rules (per tier):

* only *committed* checkpoints count towards ``keep`` (the newest ``keep`` stay; 0 keeps all);
* with ``keep_every = K`` a committed checkpoint whose step is a multiple of K stays forever;
* the newest committed checkpoint is never deleted, nor anything still in flight in this process
  (being flushed, committed or promoted);
* an uncommitted (partial) checkpoint is deleted only when it is older than the start of a
  checkpoint that committed since: it can no longer become committed.

Retention runs after a commit on that tier, by the rank that wrote the metadata there, and on
demand (``tierckpt-restore gc``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .commit import CheckpointInfo, delete_checkpoint, list_checkpoints
from .tiers.base import Tier

if TYPE_CHECKING:
    from .pipeline import Engine, RankSave

__all__ = ["RetentionPlan", "plan_retention", "apply_retention", "apply_local_retention", "apply_s3_retention",
           "best_effort_retention"]

log = logging.getLogger("tierckpt.retention")


@dataclass
class RetentionPlan:
    """Ids to delete (committed ones past the policy, and stale partials) and why."""

    delete: list[tuple[str, str]]  # (checkpoint id, reason)
    keep: list[str]


def plan_retention(infos: list[CheckpointInfo], keep: int, keep_every: int = 0,
                   protect: set[str] | frozenset[str] = frozenset(), partial_before: float | None = None) -> RetentionPlan:
    """Decide what goes. ``infos`` as from :func:`~tierckpt.commit.list_checkpoints`.

    ``partial_before``: delete uncommitted checkpoints last touched before this time (None: keep them).
    """
    committed = [c for c in infos if c.committed]
    delete: list[tuple[str, str]] = []
    if keep > 0 and len(committed) > keep:
        for c in committed[:-keep]:
            if c.checkpoint_id in protect:
                continue
            if keep_every and c.step is not None and c.step % keep_every == 0:
                continue
            delete.append((c.checkpoint_id, f"committed, older than the newest {keep}"))
    if partial_before is not None and committed:
        for c in infos:
            if not c.committed and c.checkpoint_id not in protect and c.mtime < partial_before:
                delete.append((c.checkpoint_id, "partial (never committed)"))
    gone = {d for d, _ in delete}
    if committed:
        assert committed[-1].checkpoint_id not in gone
    return RetentionPlan(delete=delete, keep=[c.checkpoint_id for c in infos if c.checkpoint_id not in gone])


def apply_retention(tier: Tier, plan: RetentionPlan) -> int:
    """Delete what ``plan`` says from ``tier``; return the number of checkpoints removed."""
    n = 0
    for cid, why in plan.delete:
        log.info("retention on %s: deleting %s (%s)", tier.url, cid, why)
        delete_checkpoint(tier, cid)
        n += 1
    return n


def apply_local_retention(engine: "Engine", job: "RankSave") -> int:
    """After ``job`` committed on the local tier: apply ``[local] keep`` there."""
    assert engine.local is not None and engine.cfg.local is not None
    protect = engine.in_flight_ids() | {job.id}
    if engine.promoter is not None:
        protect |= engine.promoter.pending_ids()
    plan = plan_retention(list_checkpoints(engine.local), engine.cfg.local.keep, 0, protect, job.assign.created)
    return apply_retention(engine.local, plan)


def apply_s3_retention(engine: "Engine", job: "RankSave") -> int:
    """After ``job`` committed on S3 (rank 0): apply ``[s3] keep``/``keep_every``, abort stale uploads."""
    s3 = engine.s3_tier()
    cfg = engine.cfg.s3
    assert cfg is not None
    protect = engine.in_flight_ids() | {job.id}
    plan = plan_retention(list_checkpoints(s3), cfg.keep, cfg.keep_every, protect, job.assign.created)
    n = apply_retention(s3, plan)
    abort = getattr(s3, "abort_stale_uploads", None)
    if abort is not None:
        aborted = abort("", older_than_s=engine.cfg.job.commit_timeout)
        if aborted:
            log.info("aborted %d stale multipart uploads on %s", aborted, s3.url)
    return n


def best_effort_retention(fn, engine: "Engine", job: "RankSave") -> None:
    """Run a retention pass after ``job`` committed; a failure is logged, never fails the checkpoint
    (it is committed already; the next commit retries retention)."""
    try:
        fn(engine, job)
    except Exception as e:  # noqa: BLE001 - see docstring
        log.warning("retention after committing %s failed (will retry after the next commit): %s", job.id, e)
