"""What each tier keeps, what it deletes, and how a deletion stays safe.

:func:`plan_retention` is a pure function of what a tier holds (from
:func:`~tierckpt.catalog.list_checkpoints`, in commit order), the policy and what is protected:

* only committed checkpoints with a readable commit header count towards ``keep`` (the newest
  ``keep`` stay; 0 keeps all); one whose header is unreadable is never deleted by retention;
* with ``keep_every = K`` a committed checkpoint whose step is a multiple of K stays forever;
* a checkpoint marked bad (:mod:`tierckpt.catalog.health`) takes no place in ``keep``: the newest
  ``keep`` *healthy* ones stay, and a bad one stays only while it is newer than the oldest of them;
* the newest committed checkpoint is never deleted, nor anything in ``protect`` (in flight in
  this process, leased by a reader or a save anywhere, still owed to a later tier);
* an uncommitted (partial) checkpoint goes when nobody holds a lease on it (a live save or fetch
  always does, from before its first file: see :mod:`tierckpt.lease`).

:func:`apply_retention` deletes under the lease protocol (:func:`tierckpt.lease.guarded_delete`):
metadata first, then exactly the objects that were listed, so a save of the same id that started
after the listing is never touched. Who calls it: the engine after each commit (the rank that
wrote the metadata on that tier), the promoter after each promotion, and ``tierckpt-restore gc``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..catalog.lease import guarded_delete, live_leases
from ..catalog.listing import CheckpointInfo, list_checkpoints
from ..errors import TierckptError
from ..format.layout import METADATA, check_checkpoint_id, checkpoint_prefixes, metadata_key, split_key
from ..tiers.base import ObjectInfo, Tier

__all__ = ["RetentionPlan", "plan_retention", "apply_retention", "enforce", "delete_checkpoint", "checkpoint_objects"]

log = logging.getLogger("tierckpt.retention")


@dataclass
class RetentionPlan:
    """Ids to delete (committed ones past the policy, and stale partials) with the reason, and ids kept."""

    delete: list[tuple[str, str]]  # (checkpoint id, reason)
    keep: list[str]


def plan_retention(
    infos: list[CheckpointInfo],
    keep: int,
    keep_every: int = 0,
    protect: set[str] | frozenset[str] = frozenset(),
    *,
    partials: bool = True,
    now: float | None = None,
    grace: float = 0.0,
) -> RetentionPlan:
    """Decide what goes (pure: no I/O). ``infos`` as from :func:`~tierckpt.catalog.list_checkpoints`.

    ``partials``: also delete uncommitted checkpoints not in ``protect`` (the caller adds every
    leased id to it) whose newest object is older than ``grace`` seconds before ``now``.
    """
    now = time.time() if now is None else now
    committed = [c for c in infos if c.ordered]
    delete: list[tuple[str, str]] = []
    # A checkpoint marked bad (tierckpt.catalog.health) never takes one of the ``keep`` places nor
    # the newest one's protection: those go to healthy ones. It stays while it is newer than the
    # oldest healthy one kept (evidence of what went wrong), and goes once older.
    healthy = [c for c in committed if not c.bad]
    if keep > 0 and len(committed) > keep:
        kept = healthy[-keep:]
        if kept:
            first = committed.index(kept[0])
            spare = {c.checkpoint_id for c in kept} | {c.checkpoint_id for c in committed[first + 1 :] if c.bad}
        else:  # every one is marked bad: the ordinary rule
            spare = {c.checkpoint_id for c in committed[-keep:]}
        for c in committed:
            if c.checkpoint_id in spare or c.checkpoint_id in protect:
                continue
            if keep_every and c.step is not None and c.step % keep_every == 0 and not c.bad:
                continue
            why = (
                "marked bad, older than the healthy ones kept" if c.bad else f"committed, older than the newest {keep}"
            )
            delete.append((c.checkpoint_id, why))
    if partials:
        for c in infos:
            if not c.committed and c.checkpoint_id not in protect and c.mtime < now - grace:
                delete.append((c.checkpoint_id, "partial (never committed, no live save holds it)"))
    gone = {d for d, _ in delete}
    newest = (healthy or committed)[-1:]
    if newest and newest[0].checkpoint_id in gone:  # never: the loop above stops short of it
        raise TierckptError(f"retention: refusing to delete the newest committed checkpoint {newest[0].checkpoint_id}")
    return RetentionPlan(delete=delete, keep=[c.checkpoint_id for c in infos if c.checkpoint_id not in gone])


def checkpoint_objects(tier: Tier, checkpoint_id: str) -> dict[str, ObjectInfo]:
    """The objects of ``checkpoint_id`` on ``tier`` by their name inside the checkpoint, wherever the
    layout puts them (:func:`tierckpt.layout.checkpoint_prefixes`)."""
    out: dict[str, ObjectInfo] = {}
    for prefix in checkpoint_prefixes(checkpoint_id):
        for info in tier.list(prefix):
            sk = split_key(info.key)
            if sk is not None and sk[0] == checkpoint_id:
                out[sk[1]] = info
    return out


def delete_checkpoint(tier: Tier, checkpoint_id: str, objects: dict[str, ObjectInfo] | None = None) -> int:
    """Delete a checkpoint's objects from ``tier``: the metadata first (it stops being committed
    before any data goes), then exactly ``objects`` (default: what is listed now). Not guarded by
    leases: callers that may race readers use :func:`apply_retention`. Returns objects removed."""
    check_checkpoint_id(checkpoint_id)
    if objects is None:
        objects = checkpoint_objects(tier, checkpoint_id)
    tier.delete_many([metadata_key(checkpoint_id)])
    return 1 + tier.delete_many([o.key for name, o in objects.items() if name != METADATA])


def apply_retention(tier: Tier, plan: RetentionPlan, infos: list[CheckpointInfo] | None = None) -> list[str]:
    """Delete what ``plan`` says from ``tier``, each checkpoint under the lease protocol.

    ``infos`` (the listing the plan came from) names the objects to delete; without it each
    checkpoint is listed again. Returns the ids really deleted (a leased one is skipped and logged).
    """
    by_id = {c.checkpoint_id: c for c in infos or []}
    done = []
    for cid, why in plan.delete:
        info = by_id.get(cid)
        objects = info.objects if info is not None else None
        partial = info is not None and not info.committed

        def delete(cid: str = cid, objects: dict | None = objects, partial: bool = partial) -> None:
            if partial:  # listed before its save committed (and released its lease): never a committed one
                if tier.exists(metadata_key(cid)):
                    raise _CommittedMeanwhile
                tier.delete_many([o.key for name, o in (objects or {}).items() if name != METADATA])
            else:
                delete_checkpoint(tier, cid, objects)

        try:
            deleted = guarded_delete(tier, cid, delete, reason=f"retention: {why}")
        except _CommittedMeanwhile:
            log.info("retention on %s: not deleting %s: it was committed after the listing", tier.url, cid)
            continue
        if deleted:
            log.info("retention on %s: deleted %s (%s)", tier.url, cid, why)
            done.append(cid)
    return done


class _CommittedMeanwhile(Exception):
    """A checkpoint listed as partial has its metadata now: its save committed after the listing."""


def enforce(
    tier: Tier,
    keep: int,
    keep_every: int = 0,
    protect: set[str] | frozenset[str] = frozenset(),
    *,
    owed: set[str] | frozenset[str] = frozenset(),
    need_bytes: int = 0,
    partials: bool = True,
) -> list[str]:
    """List ``tier``, plan and apply retention; return the ids deleted.

    Protected: ``protect``, every checkpoint with a live lease, and ``owed`` (committed here but
    not yet on a later tier) — unless the tier reports less than ``need_bytes`` free, in which
    case owed checkpoints past the policy may go, each with a warning naming it.
    """
    infos = list_checkpoints(tier)
    leased = set(live_leases(tier))
    guard = set(protect) | leased
    full = bool(owed) and need_bytes > 0 and tier.free_bytes() is not None and tier.free_bytes() < need_bytes  # type: ignore[operator]
    plan = plan_retention(infos, keep, keep_every, guard if full else guard | set(owed), partials=partials)
    for cid, _why in plan.delete:
        if cid in owed:
            log.warning(
                "retention on %s: deleting %s although it is not on the next tier yet: the disk is "
                "nearly full (less than %d bytes free)",
                tier.url,
                cid,
                need_bytes,
            )
    return apply_retention(tier, plan, infos)
