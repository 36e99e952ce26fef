"""What is where: checkpoints per tier, ``latest`` over all tiers, and which tiers hold a copy.

The restore tools work on the tiers of one :class:`~tierckpt.config.TierConfig`, fastest first
(local, then S3). A checkpoint is *committed* on a tier when ``ID/metadata.json`` exists there;
order and ``latest`` come from :mod:`tierckpt.catalog` (the commit sequence written in each
metadata header, never file times), exactly as :class:`tierckpt.TieredReader` resolves them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierckpt.catalog.listing import (
    CheckpointInfo,
    Latest,
    find_latest,
    list_checkpoints,
    read_checkpoint_doc,
    read_checkpoint_metadata,
)
from tierckpt.catalog.nodes import PeerNode, find_latest_here, node_files, open_node_dirs, open_peer_nodes
from tierckpt.chain.retention import checkpoint_objects
from tierckpt.config import TierConfig, load_config
from tierckpt.config.values import node_name
from tierckpt.errors import CheckpointNotFound, CorruptCheckpoint, TierckptError
from tierckpt.format.layout import PEERS, check_checkpoint_id, is_data_file, metadata_key, rank_of_file
from tierckpt.format.metadata import CheckpointManifest
from tierckpt.tiers import make_tiers
from tierckpt.tiers.base import Tier

from .errors import UsageError

log = logging.getLogger("tierckpt.restore")

__all__ = [
    "Latest",
    "Listing",
    "PeerNode",
    "Survey",
    "find_latest_here",
    "node_files",
    "open_peer_nodes",
    "TierEntry",
    "as_config",
    "checkpoint_objects",
    "find_latest",
    "holding_tiers",
    "is_committed_on",
    "key_path",
    "list_all",
    "open_node_dirs",
    "survey",
    "open_tiers",
    "rank_of_file",
    "read_metadata_any",
    "resolve_id",
]


def as_config(config: TierConfig | str | os.PathLike | None) -> TierConfig:
    """A :class:`TierConfig` from a config object, a TOML path, or ``None`` (``$TIERCKPT_CONFIG``)."""
    return config if isinstance(config, TierConfig) else load_config(config)


def open_tiers(cfg: TierConfig, only: str | None = None) -> list[Tier]:
    """The configured tiers, fastest first; ``only`` (a configuration section name, "local" or
    "s3") keeps the tier of that section."""
    tiers = make_tiers(cfg)
    if only:
        picked = [t for t in tiers if t.name == only]
        for t in tiers:
            if t not in picked:
                t.close()
        if not picked:
            raise UsageError(
                f"--tier {only}: the configuration{(' ' + cfg.source) if cfg.source else ''} has no [{only}] section"
            )
        return picked
    return tiers


def key_path(root: Path, key: str) -> Path:
    """The file of tier key ``key`` under a local tier rooted at ``root``. For tools and tests
    that inspect a local tier's directory from outside; restore itself never uses it (it reads
    and writes through the Tier API)."""
    from tierckpt.tiers.base import check_key

    return Path(root).joinpath(*check_key(key).split("/"))


# -- list --------------------------------------------------------------------------------------


@dataclass
class TierEntry:
    """One checkpoint on one tier."""

    tier: str
    committed: bool
    size: int
    rank_files: int
    mtime: float  # the commit time recorded in the metadata when committed, newest file time otherwise
    order: tuple = ()  # commit order (seq, commit time, step); empty when uncommitted or unreadable
    peer_copies: bool = False  # the peer hop committed its copies here ([peer] replicas: ID/peers.json)
    stored_bytes: int = 0  # bytes of its data files on this tier (encoded where the tier encodes)
    logical_bytes: int | None = None  # bytes of its data files as saved (None: metadata unreadable)
    nodes: dict[str, str] = field(default_factory=dict)  # node-local tier: node -> "committed" / "partial"
    bad: bool = False  # marked bad here (ID/bad.json: tierckpt.catalog.health)

    def to_json(self) -> dict:
        return {
            "state": ("committed" if self.order else "committed (unreadable header)") if self.committed else "partial",
            "size": self.size,
            "rank_files": self.rank_files,
            "mtime": self.mtime,
            "seq": self.order[0] if self.order else None,
            "peer_copies": self.peer_copies,
            "stored_bytes": self.stored_bytes,
            "logical_bytes": self.logical_bytes,
            "nodes": self.nodes,
            "bad": self.bad,
        }


@dataclass
class Listing:
    """One checkpoint id over all tiers."""

    checkpoint_id: str
    step: int | None
    tiers: dict[str, TierEntry] = field(default_factory=dict)

    @property
    def committed_anywhere(self) -> bool:
        return any(e.committed for e in self.tiers.values())

    @property
    def first_seen(self) -> float:
        return min(e.mtime for e in self.tiers.values())

    @property
    def newest(self) -> float:
        return max(e.mtime for e in self.tiers.values())

    def to_json(self, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        best = self.best()
        return {
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "committed": self.committed_anywhere,
            "size": best.size,
            "rank_files": best.rank_files,
            "age_s": round(max(0.0, now - self.newest), 3),
            "tiers": {name: e.to_json() for name, e in self.tiers.items()},
        }

    def best(self) -> TierEntry:
        """The entry that best describes the checkpoint: a committed one, the largest."""
        return max(self.tiers.values(), key=lambda e: (e.committed, e.rank_files, e.size))


def _entry(tier: Tier, c: CheckpointInfo) -> TierEntry:
    stored = sum(o.size for n, o in c.objects.items() if is_data_file(n))
    logical: int | None = stored
    if tier.may_encode and c.committed:  # encoded files: the logical sizes are in this tier's metadata
        try:
            man = read_checkpoint_doc(tier, c.checkpoint_id).manifest
            logical = sum(
                man.files[n] if n in man.stored else o.size
                for n, o in c.objects.items()
                if is_data_file(n) and n in man.files
            )
        except TierckptError as e:
            log.debug("%s/%s: no logical sizes: %s", tier.url, c.checkpoint_id, e)
            logical = None
    return TierEntry(
        tier=tier.name,
        committed=c.committed,
        size=c.size,
        rank_files=sum(1 for n in c.objects if is_data_file(n)),
        mtime=c.header.committed if c.header is not None else c.mtime,
        order=c.header.order_key() if c.header is not None else (),
        peer_copies=PEERS in c.objects,
        stored_bytes=stored,
        logical_bytes=logical,
        bad=c.bad,
    )


def _merged(held: list[tuple[str, Tier, CheckpointInfo]]) -> TierEntry:
    """One node-local tier's entry for a checkpoint over the nodes holding some of it: its data
    files once each (a node's own files and peer copies), committed when a node committed it."""
    committed = [h for h in held if h[2].committed]
    node, tier, first = (committed or held)[0]
    objects: dict = {}
    for _n, _t, c in held:
        for name, o in c.objects.items():
            objects.setdefault(name, o)
    headers = [c.header for _n, _t, c in held if c.header is not None]
    merged = CheckpointInfo(
        first.checkpoint_id,
        bool(committed),
        max(c.mtime for _n, _t, c in held),
        sum(o.size for o in objects.values()),
        len(objects),
        first.step,
        max(headers, key=lambda h: h.order_key()) if headers else None,
        objects,
    )
    entry = _entry(tier, merged)
    entry.nodes = {n: "committed" if c.committed else "partial" for n, _t, c in held}
    return entry


@dataclass
class Survey:
    """What :func:`survey` found: every checkpoint it could list, and what it could not read."""

    listings: list[Listing]
    unreadable: dict[str, BaseException] = field(default_factory=dict)  # tier section -> why it was not listed
    nodes: list[str] = field(default_factory=list)  # the node directories read (node-local first tier)
    urls: dict[str, str] = field(default_factory=dict)  # tier section -> its URL
    unreadable_nodes: dict[str, tuple[str, BaseException]] = field(default_factory=dict)  # node -> (URL, why)


def survey(cfg: TierConfig | None, tiers: list[Tier], *, nodes: bool = True) -> Survey:
    """Every checkpoint on every tier that answers, in :func:`list_all`'s order.

    A tier that cannot be listed (S3 down, no credentials, permission denied) is left out and
    named in :attr:`Survey.unreadable` with its error, never raised: callers decide (``list``
    warns; ``list --strict`` fails). With a node-local first tier (``[local] path`` with
    ``{node}``) and ``nodes``, every node directory readable here is listed too (this node's
    under its :func:`~tierckpt.config.values.node_name`, the others by
    :func:`tierckpt.catalog.nodes.open_node_dirs`): the tier's entry for a checkpoint covers
    them all and :attr:`TierEntry.nodes` says which node holds it. An other node's directory
    that cannot be listed (no permission) is skipped, as ``latest`` does, and named in
    :attr:`Survey.unreadable_nodes` (``list`` warns).
    """
    others = open_node_dirs(cfg, tiers) if nodes and cfg is not None else {}
    out = Survey([], urls={t.name: t.url for t in tiers})
    by_id: dict[str, Listing] = {}
    try:
        for tier in tiers:
            if tier is tiers[0] and tier.node_local and cfg is not None:
                sources: list[tuple[str | None, Tier]] = [(node_name(), tier), *others.items()]
            else:
                sources = [(None, tier)]
            held: dict[str, list[tuple[str, Tier, CheckpointInfo]]] = {}
            for node, t in sources:
                try:
                    infos = list_checkpoints(t)
                except Exception as e:  # noqa: BLE001 - one tier's failure must not hide the others
                    if t is not tier:
                        log.debug("node %s: cannot list %s (%s): skipped", node, t.url, e)
                        out.unreadable_nodes[str(node)] = (t.url, e)
                        continue
                    out.unreadable[tier.name] = e
                    continue
                if node is None:
                    for c in infos:
                        by_id.setdefault(c.checkpoint_id, Listing(c.checkpoint_id, c.step)).tiers[tier.name] = _entry(
                            tier, c
                        )
                    continue
                if infos:
                    out.nodes.append(node)
                for c in infos:
                    held.setdefault(c.checkpoint_id, []).append((node, t, c))
            for cid, h in held.items():
                by_id.setdefault(cid, Listing(cid, h[0][2].step)).tiers[tier.name] = _merged(h)
    finally:
        for t in others.values():
            t.close()

    def order(l: Listing) -> tuple:
        keys = [e.order for e in l.tiers.values() if e.order]
        if keys:
            return (1, max(keys), l.checkpoint_id)
        return (0 if l.committed_anywhere else 2, (0, l.first_seen, -1), l.checkpoint_id)

    out.listings = sorted(by_id.values(), key=order)
    return out


def list_all(tiers: list[Tier]) -> list[Listing]:
    """Every checkpoint on every tier, in commit order (seq, commit time, step: what the commit
    wrote, never a file time); uncommitted ones last, by file time. Only the given tiers (no
    other nodes' directories); raises the error of the first tier that cannot be listed
    (:func:`survey` degrades instead)."""
    s = survey(None, tiers, nodes=False)
    if s.unreadable:
        raise next(iter(s.unreadable.values()))
    return s.listings


# -- latest ------------------------------------------------------------------------------------


def resolve_id(tiers: list[Tier], checkpoint_id: str) -> str:
    """``checkpoint_id`` itself (validated), or the id ``latest`` stands for over ``tiers``."""
    if checkpoint_id == "latest":
        return find_latest(tiers).checkpoint_id
    return check_checkpoint_id(checkpoint_id)


def is_committed_on(tier: Tier, checkpoint_id: str) -> bool:
    """Whether ``tier`` holds ``checkpoint_id`` committed (its ``metadata.json`` exists there)."""
    return tier.exists(metadata_key(checkpoint_id))


def holding_tiers(tiers: list[Tier], checkpoint_id: str) -> list[Tier]:
    """The tiers (fastest first) that hold a committed copy of ``checkpoint_id``.

    Raises :class:`CheckpointNotFound` (naming the tiers) when there is none.
    """
    out = [t for t in tiers if t.exists(metadata_key(checkpoint_id))]
    if not out:
        raise CheckpointNotFound(
            f"checkpoint {checkpoint_id} is not committed on any tier: " + ", ".join(t.url for t in tiers)
        )
    return out


def read_metadata_any(tiers: list[Tier], checkpoint_id: str) -> tuple[Tier, Any, CheckpointManifest]:
    """Metadata of ``checkpoint_id`` from the first tier holding a valid committed copy."""
    errors = []
    for tier in holding_tiers(tiers, checkpoint_id):
        try:
            md, man = read_checkpoint_metadata(tier, checkpoint_id)
            return tier, md, man
        except CorruptCheckpoint as e:
            errors.append(str(e))
    raise CorruptCheckpoint(f"checkpoint {checkpoint_id}: no tier holds valid metadata: " + "; ".join(errors))
