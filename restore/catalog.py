"""What is where: checkpoints per tier, ``latest`` over all tiers, and which tiers hold a copy.

The restore tools work on the tiers of one :class:`~tierckpt.config.TierConfig`, fastest first
(local, then S3). A checkpoint is *committed* on a tier when ``ID/metadata.json`` exists there;
order and ``latest`` come from :mod:`tierckpt.catalog` (the commit sequence written in each
metadata header, never file times), exactly as :class:`tierckpt.TieredReader` resolves them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

from tierckpt.catalog import (CheckpointInfo, Latest, committed_in_order, find_latest, list_checkpoints,
                              read_checkpoint_doc, read_checkpoint_metadata)
from tierckpt.config import TierConfig, load_config
from tierckpt.errors import CheckpointNotFound, CorruptCheckpoint, TierckptError
from tierckpt.layout import (PEERS, CheckpointDoc, CheckpointManifest, check_checkpoint_id, is_data_file, metadata_key,
                             rank_of_file)
from tierckpt.retention import checkpoint_objects
from tierckpt.tiers import is_node_name, make_node_tiers, make_tiers
from tierckpt.tiers.base import Tier

from .errors import UsageError

log = logging.getLogger("tierckpt.restore")

__all__ = [
    "Latest",
    "Listing",
    "PeerNode",
    "find_latest_here",
    "node_files",
    "open_peer_nodes",
    "TierEntry",
    "as_config",
    "checkpoint_objects",
    "find_latest",
    "holding_tiers",
    "key_path",
    "list_all",
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
            raise UsageError(f"--tier {only}: the configuration{(' ' + cfg.source) if cfg.source else ''} has no [{only}] section")
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

    def to_json(self) -> dict:
        return {"state": ("committed" if self.order else "committed (unreadable header)") if self.committed else "partial",
                "size": self.size, "rank_files": self.rank_files, "mtime": self.mtime,
                "seq": self.order[0] if self.order else None, "peer_copies": self.peer_copies}


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
    return TierEntry(tier=tier.name, committed=c.committed, size=c.size,
                     rank_files=sum(1 for n in c.objects if is_data_file(n)),
                     mtime=c.header.committed if c.header is not None else c.mtime,
                     order=c.header.order_key() if c.header is not None else (), peer_copies=PEERS in c.objects)


def list_all(tiers: list[Tier]) -> list[Listing]:
    """Every checkpoint on every tier, in commit order (seq, commit time, step: what the commit
    wrote, never a file time); uncommitted ones last, by file time."""
    by_id: dict[str, Listing] = {}
    for tier in tiers:
        for c in list_checkpoints(tier):
            lst = by_id.setdefault(c.checkpoint_id, Listing(c.checkpoint_id, c.step))
            lst.tiers[tier.name] = _entry(tier, c)

    def order(l: Listing) -> tuple:
        keys = [e.order for e in l.tiers.values() if e.order]
        if keys:
            return (1, max(keys), l.checkpoint_id)
        return (0 if l.committed_anywhere else 2, (0, l.first_seen, -1), l.checkpoint_id)

    return sorted(by_id.values(), key=order)


# -- latest ------------------------------------------------------------------------------------

def resolve_id(tiers: list[Tier], checkpoint_id: str) -> str:
    """``checkpoint_id`` itself (validated), or the id ``latest`` stands for over ``tiers``."""
    if checkpoint_id == "latest":
        return find_latest(tiers).checkpoint_id
    return check_checkpoint_id(checkpoint_id)


def holding_tiers(tiers: list[Tier], checkpoint_id: str) -> list[Tier]:
    """The tiers (fastest first) that hold a committed copy of ``checkpoint_id``.

    Raises :class:`CheckpointNotFound` (naming the tiers) when there is none.
    """
    out = [t for t in tiers if t.exists(metadata_key(checkpoint_id))]
    if not out:
        raise CheckpointNotFound(f"checkpoint {checkpoint_id} is not committed on any tier: "
                                 + ", ".join(t.url for t in tiers))
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




# -- other nodes' tiers ([local] path with {node}) ----------------------------------------------

PEER_CANDIDATES = 5
"""How many of its newest committed checkpoints each node offers for ``latest``."""


@dataclass
class PeerNode:
    """Another node's node-local tier as this process sees it (a shared or NFS-mounted node
    directory), with its committed checkpoints in commit order."""

    node: str
    tier: Tier
    committed: list[CheckpointInfo]

    @property
    def label(self) -> str:
        """How outputs name it as a source: ``node NAME``."""
        return f"node {self.node}"

    def info(self, checkpoint_id: str) -> CheckpointInfo | None:
        return next((c for c in self.committed if c.checkpoint_id == checkpoint_id), None)


def _peer_names(tier: Tier, listed: list[CheckpointInfo]) -> set[str]:
    """Node names in the ``peers.json`` of the newest checkpoints of ``tier`` that have one."""
    names: set[str] = set()
    for c in reversed(listed[-PEER_CANDIDATES:]):
        if PEERS not in c.objects:
            continue
        try:
            doc = json.loads(tier.get(c.objects[PEERS].key))
        except (TierckptError, OSError, ValueError) as e:
            log.debug("cannot read %s/%s: %s", tier.url, c.objects[PEERS].key, e)
            continue
        nodes = doc.get("nodes") if isinstance(doc, dict) else None
        if isinstance(nodes, list):
            names |= {n for n in nodes if is_node_name(n)}
            break
    return names


def open_peer_nodes(cfg: TierConfig, tiers: list[Tier]) -> list[PeerNode]:
    """Other nodes' copies of the first tier that this process can read, by node name.

    Only when the first tier is node-local (``[local] path`` with ``{node}``). Node names come
    from the directories next to this node's and from the ``peers.json`` of readable checkpoints
    (this node's, then the other nodes'). A node whose tier cannot be read (no permission, not
    mounted here, empty) is skipped with a debug log line, never an error. Callers close the
    returned tiers.
    """
    if not tiers or not tiers[0].node_local:
        return []
    try:
        names = _peer_names(tiers[0], committed_in_order(tiers[0]))
    except TierckptError as e:
        log.debug("cannot list %s: %s", tiers[0].url, e)
        names = set()
    out: dict[str, PeerNode] = {}
    seen: set[str] = set()
    for _round in range(2):  # names found in the other nodes' peers.json: one more round
        for node, tier in make_node_tiers(cfg, names).items():
            if node in seen or tier.url == tiers[0].url:
                tier.close()
                continue
            seen.add(node)
            try:
                listed = committed_in_order(tier)
            except (TierckptError, OSError) as e:
                log.debug("node %s: cannot read %s (%s): skipped", node, tier.url, e)
                tier.close()
                continue
            if not listed:
                log.debug("node %s: no committed checkpoint readable in %s: skipped", node, tier.url)
                tier.close()
                continue
            out[node] = PeerNode(node, tier, listed)
            names |= _peer_names(tier, listed)
        if not names - seen:
            break
    return [out[n] for n in sorted(out)]


def node_files(info: CheckpointInfo, manifest: CheckpointManifest) -> dict[str, int]:
    """The data files of a checkpoint a node holds with the size its manifest gives (its own
    ranks' files and the copies the peer hop put there; copies appear whole, renamed after every
    piece was verified, and readers check every byte again)."""
    return {n: o.size for n, o in info.objects.items() if is_data_file(n) and manifest.files.get(n) == o.size}


def _order(latest: Latest) -> tuple:
    return (latest.seq, latest.committed, -1 if latest.step is None else latest.step)


def find_latest_here(cfg: TierConfig, tiers: list[Tier], peers: list[PeerNode] | None = None) -> Latest:
    """``latest`` as this node's ``dcp.load`` would resolve it: with readable peer nodes (a
    node-local first tier), the newest committed checkpoint whose every data file this node, the
    other nodes (their own files and peer copies) or a shared tier holds (the rule of
    :func:`tierckpt.peers.choose`); without, :func:`tierckpt.catalog.find_latest`.

    ``Latest.tiers`` names the holders (tier names, ``node NAME`` for other nodes).
    """
    if peers is None:
        peers = open_peer_nodes(cfg, tiers)
        try:
            return find_latest_here(cfg, tiers, peers)
        finally:
            for p in peers:
                p.tier.close()
    if not peers:
        return find_latest(tiers)
    first, shared = tiers[0], [t for t in tiers[1:] if not t.node_local]
    holders: list[tuple[str, Tier, list[CheckpointInfo]]] = []
    try:
        holders.append((first.name, first, committed_in_order(first)))
    except TierckptError as e:
        log.warning("cannot list %s: %s", first.url, e)
    holders += [(p.label, p.tier, p.committed) for p in peers]
    order: dict[str, tuple] = {}
    for _label, _tier, listed in holders:
        for c in listed[-PEER_CANDIDATES:]:
            order[c.checkpoint_id] = max(order.get(c.checkpoint_id, ()), c.header.order_key())  # type: ignore[union-attr]
    shared_latest: Latest | None = None
    if shared:
        try:
            shared_latest = find_latest(shared)
        except CheckpointNotFound:
            pass
        except TierckptError as e:
            log.warning("a shared tier was unreachable while resolving latest: %s", e)
    for cid in sorted(order, key=lambda c: order[c], reverse=True):
        if shared_latest is not None and _order(shared_latest) > order[cid]:
            break  # a shared tier holds a newer checkpoint in full
        doc: CheckpointDoc | None = None
        have: dict[str, list[str]] = {}
        names: list[str] = []
        for label, tier, listed in holders:
            info = next((c for c in listed if c.checkpoint_id == cid), None)
            if info is None:
                continue
            if doc is None:
                try:
                    doc = read_checkpoint_doc(tier, cid)
                except (CheckpointNotFound, CorruptCheckpoint) as e:
                    log.error("skipping %s on %s for 'latest': %s", cid, tier.url, e)
                    continue
            files = node_files(info, doc.manifest)
            if files:
                names.append(label)
            for f in files:
                have.setdefault(f, []).append(label)
        if doc is None:
            continue
        man = doc.manifest
        missing = sorted(f for f, size in man.files.items() if size and f not in have)
        on_shared = [t for t in shared if shared_latest is not None and shared_latest.checkpoint_id == cid
                     and t.name in shared_latest.tiers]
        if missing and not on_shared:
            log.info("skipping %s for 'latest': data file %s is on no readable node (%d missing)", cid, missing[0],
                     len(missing))
            continue
        return Latest(checkpoint_id=cid, committed=man.committed, step=man.step, seq=man.seq,
                      tiers=names + [t.name for t in on_shared], holding=[first] if first.name in names else [],
                      manifest=man, doc=doc)
    if shared_latest is not None:
        return shared_latest
    raise CheckpointNotFound("no committed checkpoint that this node can read in full on any tier: "
                             + ", ".join([t.url for t in tiers] + [p.tier.url for p in peers]))
