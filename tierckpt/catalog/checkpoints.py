"""The public catalog: which checkpoints exist, and which one is ``latest``.

For training scripts and framework adapters that must decide what to resume from without a
process group::

    from tierckpt.checkpoints import latest, list_checkpoints
    cid = latest("tiers.toml")                 # e.g. "step-000300", or None when there is none
    for c in list_checkpoints("tiers.toml"):   # oldest commit first
        print(c.id, c.step, c.tiers, c.committed, c.peer_copies)

The answers are those of ``tierckpt-restore latest`` and ``tierckpt-restore list`` (both read
:mod:`tierckpt.catalog`: commit order from the metadata headers, never file times; ``latest``
is the newest committed checkpoint whose metadata is valid and whose data a tier can serve).
Any process may call these, on any rank, at any time; they list the tiers (one listing per tier,
one small read per committed checkpoint) and block for that long. With a node-local ``[local]``
path (``{node}``) they see every node directory readable here, as ``latest`` does. An
unreachable tier is skipped with a warning naming it; its error is raised only when no tier
answers, as the CLI does.

It also holds :func:`checkpoint_id_of`, the mapping from what a framework passes as a checkpoint
id (often a directory path such as ``<dump>/checkpoint/step-100``) to a tierckpt id.

This module imports neither torch nor the tiers at import time (only when called).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["Checkpoint", "checkpoint_id_of", "latest", "list_checkpoints", "mark_bad"]


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint committed on at least one tier.

    ``tiers``: the configuration sections (``"local"``, ``"s3"``, ...) of the tiers holding a
    committed copy, fastest first. ``committed``: the commit time recorded in its metadata (Unix
    seconds), ``None`` when no tier's metadata header is readable (such a checkpoint is never
    ``latest``). ``peer_copies``: the peer hop committed copies of it on other nodes.
    ``deleting``: the tiers (sections) where a deletion of it holds a live tombstone, with who
    deletes it and when the tombstone expires (``{"s3": "gc by host:123, tombstone since ...,
    expires in 588 s"}``): a deletion running, or one that crashed (the tombstone expires after
    10 minutes). Its copies there cannot be loaded and ``latest`` skips them.
    ``nodes``: with a node-local first tier (``[local] path`` with ``{node}``), the nodes whose
    directory (readable here) holds a committed copy; its section is in ``tiers`` when any does.
    ``bad``: marked bad on some tier (``tierckpt-restore mark ID bad``, or a failed resume check:
    :mod:`tierckpt.catalog.health`); ``latest(healthy=True)`` skips it.
    """

    id: str
    step: int | None
    tiers: tuple[str, ...]
    committed: float | None
    peer_copies: bool = False
    order: tuple = field(default=(), repr=False, compare=False)  # commit order (seq, time, step)
    deleting: dict[str, str] = field(default_factory=dict, compare=False)
    nodes: tuple[str, ...] = field(default=(), compare=False)
    bad: bool = field(default=False, compare=False)  # marked bad on some tier (tierckpt.catalog.health)


def checkpoint_id_of(checkpoint_id: str | os.PathLike) -> str:
    """The tierckpt id for what a framework passed as a checkpoint id.

    A path (``os.PathLike``, or a string with a ``/``, such as torchtitan's
    ``<dump>/checkpoint/step-100`` or ``s3://bucket/run/step-100``) stands for its last
    component; a path with a ``.`` or ``..`` component (``../step-5``, ``step-5/../x``) and
    anything else is returned as given. The result is not validated here: the writer and the
    reader validate it as any other id, so those are refused as before.
    """
    cid = os.fspath(checkpoint_id)
    if isinstance(cid, bytes):
        cid = os.fsdecode(cid)
    if "/" in cid or isinstance(checkpoint_id, os.PathLike):
        parts = [p for p in cid.split("/") if p]
        if parts and not any(p in (".", "..") for p in parts):
            return parts[-1]
    return cid


def _config(cfg: Config | str | os.PathLike | None) -> Config:
    from ..config import Config, load_config

    return cfg if isinstance(cfg, Config) else load_config(None if cfg is None else os.fspath(cfg))


def _tiers(cfg: Config | str | os.PathLike | None) -> list[Any]:
    from ..tiers import make_tiers

    return make_tiers(_config(cfg))


def latest(
    cfg: Config | str | os.PathLike | None = None, *, before: str | None = None, healthy: bool = False
) -> str | None:
    """The id ``TieredReader`` loads for ``"latest"`` (what ``tierckpt-restore latest`` prints),
    or ``None`` when no tier holds a committed checkpoint. With a node-local ``[local]`` path, other
    nodes' directories readable here count too (:func:`tierckpt.nodes.find_latest_here`), as in
    a distributed ``dcp.load``.

    A checkpoint whose every copy is under a live tombstone (a deletion running, or a crashed
    ``gc`` whose tombstone has not expired: it cannot be loaded) is skipped: the next older one
    is named (:attr:`Checkpoint.deleting` tells why).

    ``before``: the next candidate after that checkpoint (one that failed to load): the newest
    committed before it, in commit order, by the same rules; ``None`` when there is none. Raises
    :class:`~tierckpt.errors.CheckpointNotFound` when ``before`` itself is committed on no tier
    (there is no order to go below).

    ``healthy``: skip checkpoints unfit to resume from (:func:`tierckpt.catalog.health.unhealthy`:
    marked bad on some tier, NaN/Inf recorded at capture, metadata corrupt on every tier), each
    logged with the reason; what integrations' resume uses.

    ``cfg``: a :class:`~tierckpt.config.Config`, a TOML path, or ``None`` (``$TIERCKPT_CONFIG``).
    """
    from ..errors import CheckpointNotFound
    from .health import unhealthy
    from .listing import order_of
    from .nodes import find_latest_here, open_peer_nodes

    conf = _config(cfg)
    tiers = _tiers(conf)
    peers = []
    try:
        peers = open_peer_nodes(conf, tiers)
        every = tiers + [p.tier for p in peers]
        below = order_of(every, checkpoint_id_of(before)) if before is not None else None
        while True:
            try:
                found = find_latest_here(conf, tiers, peers, below)
            except CheckpointNotFound:
                return None
            why = unhealthy(every, found.checkpoint_id, found.doc) if healthy else None
            if why is None:
                return found.checkpoint_id
            logging.getLogger("tierckpt.catalog").warning(
                "latest(healthy=True): skipping %s: %s", found.checkpoint_id, why
            )
            below = order_of(every, found.checkpoint_id)
    finally:
        for t in tiers + [p.tier for p in peers]:
            t.close()


def list_checkpoints(cfg: Config | str | os.PathLike | None = None) -> list[Checkpoint]:
    """Every checkpoint committed on some tier, oldest commit first (the committed rows of
    ``tierckpt-restore list``, in its order); checkpoints whose headers no tier can read come
    first (by id). Partial (uncommitted) checkpoints are left out. Besides one listing per tier
    (and per node directory readable here, with a node-local ``[local]`` path: ``Checkpoint.nodes``)
    and one small read per checkpoint, one listing of each tier's leases (and a read per tombstone)
    fills :attr:`Checkpoint.deleting`. A tier that cannot be listed is skipped with a warning naming
    it; when no tier can be listed its error is raised."""
    from ..config.values import node_name
    from ..format.layout import PEERS
    from .health import BAD
    from .listing import list_checkpoints as list_tier
    from .nodes import open_node_dirs

    conf = _config(cfg)
    tiers = _tiers(conf)
    others: dict[str, Any] = {}
    failed: list[BaseException] = []
    try:
        others = open_node_dirs(conf, tiers)
        found: dict[str, dict[str, Any]] = {}
        for tier in tiers:
            sources = [(node_name(), tier), *others.items()] if tier is tiers[0] and tier.node_local else [(None, tier)]
            tombs: dict[str, Any] = {}
            for node, t in sources:
                try:
                    listed = list_tier(t)
                except Exception as err:  # noqa: BLE001 - one tier's failure must not hide the others
                    if t is tier:
                        failed.append(err)
                        logging.getLogger("tierckpt.catalog").warning(
                            "tier %s (%s) could not be listed, its checkpoints are left out: %s",
                            tier.name,
                            tier.url,
                            err,
                        )
                    continue
                if t is tier:
                    tombs = _tombs_of(tier)  # only a tier that answered (a dead one would cost its timeout again)
                for c in listed:
                    if not c.committed:
                        continue
                    e = found.setdefault(
                        c.checkpoint_id,
                        {
                            "step": c.step,
                            "tiers": [],
                            "times": [],
                            "orders": [],
                            "peer": False,
                            "deleting": {},
                            "nodes": [],
                        },
                    )
                    if tier.name not in e["tiers"]:
                        e["tiers"].append(tier.name)
                    if node is not None:
                        e["nodes"].append(node)
                    if c.checkpoint_id in tombs and t is tier:
                        e["deleting"][tier.name] = tombs[c.checkpoint_id].deleting()
                    if c.header is not None:
                        e["times"].append(c.header.committed)
                        e["orders"].append(c.header.order_key())
                    e["peer"] = e["peer"] or PEERS in c.objects
                    e["bad"] = e.get("bad", False) or BAD in c.objects
        if failed and len(failed) == len(tiers):
            raise failed[0]
    finally:
        for t in tiers + list(others.values()):
            t.close()
    out = [
        Checkpoint(
            id=cid,
            step=e["step"],
            tiers=tuple(e["tiers"]),
            committed=max(e["times"]) if e["times"] else None,
            peer_copies=e["peer"],
            order=max(e["orders"]) if e["orders"] else (),
            deleting=e["deleting"],
            nodes=tuple(sorted(e["nodes"])),
            bad=e.get("bad", False),
        )
        for cid, e in found.items()
    ]
    # restore.catalog.survey's order: unordered committed first, then by commit order.
    return sorted(out, key=lambda c: (1, c.order, c.id) if c.order else (0, (), c.id))


def _tombs_of(tier: Any) -> dict[str, Any]:
    """The live tombstones on ``tier`` per checkpoint id, or none when its leases cannot be listed
    (logged: a read-only key may not list them)."""
    from ..errors import TierckptError
    from .lease import live_tombs

    try:
        return live_tombs(tier)
    except (TierckptError, OSError) as e:
        logging.getLogger("tierckpt.catalog").warning("cannot list the tombstones on %s: %s", tier.url, e)
        return {}


def mark_bad(cfg: Config | str | os.PathLike | None, checkpoint_id: str, reason: str) -> list[str]:
    """Mark ``checkpoint_id`` bad on every tier that holds it committed (``tierckpt-restore mark ID
    bad``; :mod:`tierckpt.catalog.health`): ``latest(healthy=True)`` and resumes skip it, retention
    never keeps it as the newest. Returns the tiers (sections) marked; raises
    :class:`~tierckpt.errors.CheckpointNotFound` when none holds it."""
    from .health import mark_bad as mark

    tiers = _tiers(cfg)
    try:
        return mark(tiers, checkpoint_id_of(checkpoint_id), reason)
    finally:
        for t in tiers:
            t.close()
