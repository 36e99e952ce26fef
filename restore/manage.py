"""``push`` and ``delete``: move a backlog up the tier chain by hand, remove checkpoints from every tier.

:func:`push_checkpoints` copies to each later tier the committed checkpoints of the first tier
that it lacks (what an S3 outage or a job that exited early left behind) with the job's own
backlog pass (:func:`tierckpt.chain.push.push_backlog`: same plan, leases and commit protocol),
then applies retention on every tier (:func:`restore.gc.gc_checkpoints`).

:func:`delete_checkpoints` removes checkpoints (committed or partial) from every tier, or one,
and with a node-local first tier (``[local] path`` with ``{node}``) from every node directory
this process can read (one it cannot read is named, and the result is not ok), each under the
lease protocol of :mod:`tierckpt.catalog.lease` (a tombstone, the metadata first,
then the objects listed): a checkpoint some process is loading, fetching or still writing (a live
lease) is left alone and reported, and a writer that arrives meanwhile waits for the deletion to
finish before its first object. Deleting every checkpoint of a run (``--all``) lets a job start
again from step 0 with the same ids (otherwise its first commit meets the old one:
:class:`~tierckpt.errors.CommitConflict`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierckpt.catalog.listing import list_checkpoints
from tierckpt.catalog.nodes import open_node_dirs
from tierckpt.chain.retention import RetentionPlan, apply_retention
from tierckpt.config import TierConfig
from tierckpt.config.values import node_name
from tierckpt.format.layout import check_checkpoint_id
from tierckpt.tiers.base import Tier

from .catalog import as_config, find_latest_here, open_tiers
from .errors import NotFound, UsageError
from .gc import GcResult, gc_checkpoints

if TYPE_CHECKING:
    from tierckpt.chain.push import HopPush

__all__ = [
    "DeletePlan",
    "DeleteResult",
    "PushResult",
    "delete_checkpoints",
    "plan_delete",
    "push_checkpoints",
]

log = logging.getLogger("tierckpt.restore")

DELETE_REASON = "tierckpt-restore delete"


@dataclass
class PushResult:
    """What :func:`push_checkpoints` did: per later tier, what was owed and promoted; then retention."""

    hops: list[HopPush]
    gc: GcResult | None = None

    @property
    def ok(self) -> bool:
        """Every owed checkpoint was promoted (nothing failed, every tier could be listed)."""
        return all(not h.error and not h.failed for h in self.hops)

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "tiers": [h.to_json() for h in self.hops],
            "gc": self.gc.to_json() if self.gc is not None else None,
        }


def push_checkpoints(
    config: TierConfig | str | os.PathLike | None, *, tier: str | None = None, gc: bool = True
) -> PushResult:
    """Promote what each later tier (or only ``tier``, a section name) lacks from the first tier,
    then (``gc``) apply retention on every tier. Failures per tier are in the result, not raised;
    a configuration with a single tier raises :class:`UsageError` (there is nowhere to push)."""
    from tierckpt.chain.push import push_backlog  # imports torch (the backlog's metadata checks): push only

    cfg = as_config(config)
    tiers = open_tiers(cfg)
    try:
        if len(tiers) < 2:
            raise UsageError(
                f"push: the configuration{(' ' + cfg.source) if cfg.source else ''} has one tier "
                f"({tiers[0].name}): nothing to push to"
            )
        if tier is not None and tier not in [t.name for t in tiers[1:]]:
            raise UsageError(
                f"push --tier {tier}: not a later tier of the configuration{(' ' + cfg.source) if cfg.source else ''} "
                f"(later tiers: {', '.join(t.name for t in tiers[1:])}; checkpoints are pushed from {tiers[0].name})"
            )
        res = PushResult(push_backlog(cfg, tiers, tier))
    finally:
        for t in tiers:
            t.close()
    if gc:
        res.gc = gc_checkpoints(cfg)
    return res


@dataclass
class DeletePlan:
    """What :func:`delete_checkpoints` would remove: target -> (id, size in bytes, committed).

    A target is a tier's section name, or ``SECTION (node NAME)`` for each node directory of a
    node-local first tier when other node directories are seen here. ``unreadable`` names the
    node directories that could not be read (target -> why): nothing there is planned."""

    targets: dict[str, list[tuple[str, int, bool]]] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.targets.values())

    @property
    def ids(self) -> list[str]:
        return sorted({cid for v in self.targets.values() for cid, _s, _c in v})


@dataclass
class DeleteResult:
    """What :func:`delete_checkpoints` removed, what it left because a process uses it, and the
    node directories it could not read (target -> why)."""

    deleted: dict[str, list[str]] = field(default_factory=dict)  # target -> ids
    in_use: dict[str, list[str]] = field(default_factory=dict)  # target -> ids left (a live lease)
    unreadable: dict[str, str] = field(default_factory=dict)  # target -> why it was not read

    @property
    def ok(self) -> bool:
        return not any(self.in_use.values()) and not self.unreadable

    def to_json(self) -> dict:
        return {"ok": self.ok, "deleted": self.deleted, "in_use": self.in_use, "unreadable": self.unreadable}


@dataclass
class _Targets:
    """The tiers a deletion works on, by target name (see :class:`DeletePlan`)."""

    tiers: list[Tier]  # the configured tiers (``latest`` is resolved over them)
    targets: dict[str, Tier]
    unreadable: dict[str, str]
    opened: list[Tier]

    def close(self) -> None:
        for t in [*self.tiers, *self.opened]:
            t.close()


def _targets(cfg: TierConfig, tier: str | None) -> _Targets:
    """The configured tiers (or ``tier``) and, with a node-local first tier, every other node
    directory seen here that can be listed; one that cannot is named in ``unreadable``."""
    tiers = open_tiers(cfg, tier)
    out = _Targets(tiers, {}, {}, [])
    try:
        for t in tiers:
            if not t.node_local:
                out.targets[t.name] = t
                continue
            others = open_node_dirs(cfg, [t])
            out.opened += others.values()
            if not others:
                out.targets[t.name] = t
                continue
            out.targets[f"{t.name} (node {node_name()})"] = t
            for node, nt in others.items():
                name = f"{t.name} (node {node})"
                try:
                    list_checkpoints(nt)
                except Exception as e:  # noqa: BLE001 - named, the other directories still deleted
                    out.unreadable[name] = str(e) if nt.url in str(e) else f"{nt.url}: {e}"
                    continue
                out.targets[name] = nt
    except BaseException:
        out.close()
        raise
    return out


def plan_delete(
    config: TierConfig | str | os.PathLike | None,
    ids: list[str] | None = None,
    *,
    every: bool = False,
    tier: str | None = None,
) -> DeletePlan:
    """What would be deleted: the checkpoints ``ids`` (``latest`` resolved over the tiers) or,
    with ``every``, every checkpoint, on every tier (or only ``tier``) and node directory that
    holds any object of them. Raises :class:`NotFound` when nothing matches (naming the node
    directories that could not be read)."""
    cfg = as_config(config)
    if bool(ids) == every:
        raise UsageError("delete: name checkpoint ids, or --all (not both)")
    tg = _targets(cfg, tier)
    try:
        want: set[str] | None = None
        if ids:
            want = {
                find_latest_here(cfg, tg.tiers).checkpoint_id if i == "latest" else check_checkpoint_id(i) for i in ids
            }
        plan = DeletePlan(unreadable=dict(tg.unreadable))
        for name, t in tg.targets.items():
            rows = [(c.checkpoint_id, c.size, c.committed) for c in list_checkpoints(t)]
            rows = [r for r in rows if want is None or r[0] in want]
            if rows:
                plan.targets[name] = rows
        if not plan.count:
            where = ", ".join(t.url for t in tg.targets.values())
            unread = "".join(f"; {n} could not be read ({why})" for n, why in tg.unreadable.items())
            raise NotFound(
                (f"no checkpoint {', '.join(sorted(want))} on {where}" if want else f"no checkpoints on {where}")
                + unread
            )
        return plan
    finally:
        tg.close()


def delete_checkpoints(
    config: TierConfig | str | os.PathLike | None,
    ids: list[str] | None = None,
    *,
    every: bool = False,
    tier: str | None = None,
) -> DeleteResult:
    """Delete the checkpoints ``ids`` (or, with ``every``, all) from every tier (or ``tier``) and
    every node directory readable here, each under the lease protocol (see the module
    docstring). A checkpoint with a live lease on a tier is left there and listed in
    :attr:`DeleteResult.in_use`; a node directory that cannot be read is listed in
    :attr:`DeleteResult.unreadable` (both make the result not ok). Returns once the deletions
    are done. Raises :class:`NotFound` when nothing matches."""
    cfg = as_config(config)
    plan = plan_delete(cfg, ids, every=every, tier=tier)
    tg = _targets(cfg, tier)
    res = DeleteResult(unreadable=dict(tg.unreadable))
    try:
        for name, t in tg.targets.items():
            todo = {cid for cid, _s, _c in plan.targets.get(name, [])}
            if not todo:
                continue
            infos = [c for c in list_checkpoints(t) if c.checkpoint_id in todo]  # listed again: what is there now
            done = apply_retention(
                t, RetentionPlan(delete=[(c.checkpoint_id, DELETE_REASON) for c in infos], keep=[]), infos
            )
            res.deleted[name] = done
            left = sorted({c.checkpoint_id for c in infos} - set(done))
            if left:
                res.in_use[name] = left
                log.warning(
                    "%s: not deleted, in use by a running process (a load, fetch or save holds a lease): %s; "
                    "run delete again once it is done",
                    t.url,
                    ", ".join(left),
                )
        for t in tg.targets.values():
            t.wait_deletions()
        return res
    finally:
        tg.close()
