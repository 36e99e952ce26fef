"""Other nodes' node-local tiers, as this process sees them (``[local] path`` with ``{node}``).

With a node-local first tier each node holds its own ranks' files and the peer copies the peer hop
put there (:mod:`tierckpt.peercopy`). Inside a job, ranks serve each other's files during
``dcp.load`` (:mod:`tierckpt.peers`); outside one, a process that can read other nodes'
directories (shared or NFS-mounted, simulated nodes) uses them here: :func:`find_latest_here`
(``latest`` as this node's ``dcp.load`` would resolve it; :func:`tierckpt.checkpoints.latest` and
``tierckpt-restore latest``) and the sources of ``tierckpt-restore fetch``.
A node directory this process cannot read is skipped (debug log), never an error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from ..config import Config
from ..errors import CheckpointNotFound, CorruptCheckpoint, TierckptError
from ..format.layout import PEERS, is_data_file
from ..format.metadata import CheckpointDoc, CheckpointManifest
from ..tiers import is_node_name, make_node_tiers
from ..tiers.base import Tier
from .listing import (
    CheckpointInfo,
    Latest,
    committed_in_order,
    deletion_under_way,
    find_latest,
    read_checkpoint_doc,
)

__all__ = ["PEER_CANDIDATES", "PeerNode", "find_latest_here", "node_files", "open_node_dirs", "open_peer_nodes"]

log = logging.getLogger("tierckpt")


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


def open_peer_nodes(cfg: Config, tiers: list[Tier]) -> list[PeerNode]:
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


def open_node_dirs(cfg: Config, tiers: list[Tier], peers: list[PeerNode] | None = None) -> dict[str, Tier]:
    """Every other node's copy of the node-local first tier that this process can see, by node
    name (sorted): the nodes of :func:`open_peer_nodes` (or ``peers``, whose tiers are reused) and
    the node directories found next to this node's even when they hold no committed checkpoint
    (a node that crashed in its first save: ``tierckpt-restore list`` shows its partial copy).
    Empty when the first tier is not node-local. Whether a directory can be listed is for the
    caller to find out (an unreadable one is skipped, never an error). Callers close the tiers."""
    if not tiers or not tiers[0].node_local:
        return {}
    if peers is None:
        peers = open_peer_nodes(cfg, tiers)
    out = {p.node: p.tier for p in peers}
    for node, tier in make_node_tiers(cfg).items():
        if node in out or tier.url == tiers[0].url:
            tier.close()
            continue
        out[node] = tier
    return dict(sorted(out.items()))


def node_files(info: CheckpointInfo, manifest: CheckpointManifest) -> dict[str, int]:
    """The data files of a checkpoint a node holds with the size its manifest gives (its own
    ranks' files and the copies the peer hop put there; copies appear whole, renamed after every
    piece was verified, and readers check every byte again)."""
    return {n: o.size for n, o in info.objects.items() if is_data_file(n) and manifest.files.get(n) == o.size}


def _order(latest: Latest) -> tuple:
    return (latest.seq, latest.committed, -1 if latest.step is None else latest.step)


def find_latest_here(
    cfg: Config, tiers: list[Tier], peers: list[PeerNode] | None = None, below: tuple | None = None
) -> Latest:
    """``latest`` as this node's ``dcp.load`` would resolve it: with readable peer nodes (a
    node-local first tier), the newest committed checkpoint whose every data file this node, the
    other nodes (their own files and peer copies) or a shared tier holds (the rule of
    :func:`tierckpt.peers.choose`); without, :func:`tierckpt.catalog.find_latest`. ``below``:
    only checkpoints committed before that order key.

    ``Latest.tiers`` names the holders (tier names, ``node NAME`` for other nodes).
    """
    if peers is None:
        peers = open_peer_nodes(cfg, tiers)
        try:
            return find_latest_here(cfg, tiers, peers, below)
        finally:
            for p in peers:
                p.tier.close()
    if not peers:
        return find_latest(tiers, below)
    first, shared = tiers[0], [t for t in tiers[1:] if not t.node_local]
    holders: list[tuple[str, Tier, list[CheckpointInfo]]] = []
    try:
        holders.append((first.name, first, committed_in_order(first)))
    except TierckptError as e:
        log.warning("cannot list %s: %s", first.url, e)
    holders += [(p.label, p.tier, p.committed) for p in peers]
    order: dict[str, tuple] = {}
    for _label, _tier, listed in holders:
        older = [c for c in listed if below is None or c.header.order_key() < below]  # type: ignore[union-attr]
        for c in older[-PEER_CANDIDATES:]:
            order[c.checkpoint_id] = max(order.get(c.checkpoint_id, ()), c.header.order_key())  # type: ignore[union-attr]
    shared_latest: Latest | None = None
    if shared:
        try:
            shared_latest = find_latest(shared, below)
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
            gone = deletion_under_way(tier, cid)
            if gone is not None:
                log.error("skipping %s on %s for 'latest': %s", cid, tier.url, gone)
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
        on_shared = [
            t
            for t in shared
            if shared_latest is not None and shared_latest.checkpoint_id == cid and t.name in shared_latest.tiers
        ]
        if missing and not on_shared:
            log.info(
                "skipping %s for 'latest': data file %s is on no readable node (%d missing)",
                cid,
                missing[0],
                len(missing),
            )
            continue
        return Latest(
            checkpoint_id=cid,
            committed=man.committed,
            step=man.step,
            seq=man.seq,
            tiers=names + [t.name for t in on_shared],
            holding=[first] if first.name in names else [],
            manifest=man,
            doc=doc,
        )
    if shared_latest is not None:
        return shared_latest
    raise CheckpointNotFound(
        "no committed checkpoint that this node can read in full on any tier: "
        + ", ".join([t.url for t in tiers] + [p.tier.url for p in peers])
    )
