"""What is where, in commit order: listing checkpoints per tier and resolving ``latest``.

Order comes from what the commit wrote, never from a clock on a file: every ``metadata.json``
starts with a header line holding the checkpoint's commit sequence number (``seq``: one more
than the highest the job had seen when it committed), its step and its commit time. Checkpoints
are ordered by ``(seq, commit time, step)`` on every tier, so copying, touching or restoring
files from a backup changes nothing. Reading a header costs one small ranged read per committed
checkpoint; headers of committed checkpoints never change (``metadata.json`` is created once),
so they are cached per process by (tier, key, size, mtime).

A committed checkpoint whose header cannot be read is *unordered*: it is never ``latest`` and
retention never deletes it (it is logged); ``tierckpt-restore list`` shows it.

``latest`` over several tiers (:func:`find_latest`) is the newest checkpoint whose metadata is
valid on some tier and that the tier can serve (its data files are there, and no deletion of it
holds a live tombstone there: :func:`tierckpt.catalog.lease.live_tomb`); anything newer that
fails these checks is skipped with a log line naming it and why.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointNotFound, CorruptCheckpoint, InvalidCheckpointId, TierckptError
from ..format.layout import MAX_METADATA_BYTES, METADATA, check_checkpoint_id, metadata_key, split_key, step_of
from ..format.metadata import HEADER_MAX, CheckpointDoc, CheckpointManifest, CommitHeader, parse_metadata, read_header
from ..tiers.base import ObjectInfo, Tier
from .lease import live_tomb

__all__ = [
    "CheckpointInfo",
    "Latest",
    "list_checkpoints",
    "committed_in_order",
    "resolve_latest",
    "find_latest",
    "is_committed",
    "read_checkpoint_metadata",
    "read_checkpoint_doc",
    "read_checkpoint_raw",
    "parse_checkpoint_doc",
    "committed_headers",
    "commit_header",
    "max_seq",
    "servable",
    "deletion_under_way",
]

log = logging.getLogger("tierckpt.catalog")


@dataclass
class CheckpointInfo:
    """One checkpoint on one tier.

    ``mtime`` is the newest file time of its objects (shown to people, used for nothing else);
    ``header`` is the commit header (None when uncommitted or unreadable); ``objects`` maps each
    object's name inside the checkpoint (``metadata.json``, ``rank-00000-ab12cd34.data``, leftovers
    such as ``*.partial``) to its tier key and info.
    """

    checkpoint_id: str
    committed: bool
    mtime: float
    size: int
    files: int
    step: int | None
    header: CommitHeader | None = None
    objects: dict[str, ObjectInfo] = field(default_factory=dict, repr=False)

    @property
    def ordered(self) -> bool:
        """Committed, with a readable commit header (takes part in ``latest`` and retention)."""
        return self.committed and self.header is not None

    @property
    def seq(self) -> int | None:
        return None if self.header is None else self.header.seq

    @property
    def bad(self) -> bool:
        """Marked bad on this tier (``bad.json`` beside its metadata: :mod:`tierckpt.catalog.health`)."""
        return "bad.json" in self.objects

    @property
    def committed_at(self) -> float | None:
        return None if self.header is None else self.header.committed

    def to_json(self) -> dict:
        return {
            "checkpoint_id": self.checkpoint_id,
            "committed": self.committed,
            "mtime": self.mtime,
            "size": self.size,
            "files": self.files,
            "step": self.step,
            "seq": self.seq,
            "committed_at": self.committed_at,
            "bad": self.bad,
        }


_headers: dict[tuple, CommitHeader | None] = {}
_headers_lock = threading.Lock()


def commit_header(tier: Tier, checkpoint_id: str, info: ObjectInfo | None = None) -> CommitHeader | None:
    """The commit header of ``checkpoint_id`` on ``tier`` (None if unreadable); ``info`` is the
    metadata object's listing entry when the caller has it (saves a lookup)."""
    key = metadata_key(checkpoint_id)
    size = info.size if info is not None else tier.size(key)
    cache_key = (tier.url, key, size, info.mtime if info is not None else None)
    if info is not None:
        with _headers_lock:
            if cache_key in _headers:
                return _headers[cache_key]
    try:
        header = read_header(tier.get(key, 0, min(size, HEADER_MAX)))
    except CheckpointNotFound:
        return None
    except (CorruptCheckpoint, OSError) as e:
        log.warning("cannot read the commit header of %s on %s: %s", checkpoint_id, tier.url, e)
        return None
    if info is not None:
        with _headers_lock:
            if len(_headers) > 20000:
                _headers.clear()
            _headers[cache_key] = header
    return header


def list_checkpoints(tier: Tier) -> list[CheckpointInfo]:
    """Every checkpoint on ``tier``: unordered committed ones first, then committed ones oldest
    commit first, then partial (uncommitted) ones by file time."""
    by_id: dict[str, CheckpointInfo] = {}
    for info in tier.list(""):
        split = split_key(info.key)
        if split is None:
            continue
        cid, rest = split
        try:
            check_checkpoint_id(cid)
        except InvalidCheckpointId:
            continue
        c = by_id.get(cid)
        if c is None:
            c = by_id[cid] = CheckpointInfo(cid, False, 0.0, 0, 0, step_of(cid))
        c.size += info.size
        c.files += 1
        c.mtime = max(c.mtime, info.mtime)
        c.objects[rest] = info
        if rest == METADATA:
            c.committed = True
    for c in by_id.values():
        if c.committed:
            c.header = commit_header(tier, c.checkpoint_id, c.objects[METADATA])
            if c.header is None:
                log.warning(
                    "checkpoint %s on %s: its metadata header is unreadable; it is never 'latest' "
                    "and retention leaves it alone",
                    c.checkpoint_id,
                    tier.url,
                )
    return sorted(by_id.values(), key=_list_order)


def _list_order(c: CheckpointInfo) -> tuple:
    if c.ordered:
        assert c.header is not None
        return (1, c.header.order_key(), c.checkpoint_id)
    if c.committed:
        return (0, (0, c.mtime, -1), c.checkpoint_id)
    return (2, (0, c.mtime, -1), c.checkpoint_id)


def committed_in_order(tier: Tier) -> list[CheckpointInfo]:
    """Committed checkpoints with a readable header, oldest commit first."""
    return [c for c in list_checkpoints(tier) if c.ordered]


def max_seq(tier: Tier) -> int:
    """The highest commit sequence number on ``tier`` (0 when none)."""
    done = committed_in_order(tier)
    return done[-1].header.seq if done else 0  # type: ignore[union-attr]


def resolve_latest(tier: Tier) -> str:
    """The id of the newest committed checkpoint on ``tier`` (by commit order; no validation)."""
    done = committed_in_order(tier)
    if not done:
        raise CheckpointNotFound(f"{tier.url}: no committed checkpoint")
    return done[-1].checkpoint_id


def is_committed(tier: Tier, checkpoint_id: str) -> bool:
    return tier.exists(f"{check_checkpoint_id(checkpoint_id)}/{METADATA}")


def read_checkpoint_metadata(tier: Tier, checkpoint_id: str) -> tuple[Any, CheckpointManifest]:
    """Read and validate ``ID/metadata.json`` from ``tier``: DCP ``Metadata`` and the manifest.

    :func:`read_checkpoint_doc`, then DCP's ``Metadata`` built from it (this imports torch).
    """
    doc = read_checkpoint_doc(tier, checkpoint_id)
    return doc.to_metadata(), doc.manifest


def committed_headers(tier: Tier) -> dict[str, tuple[CommitHeader, int]]:
    """Every committed checkpoint of ``tier`` with a readable header: id -> (header, metadata size).

    A tier with cheap listings is listed whole (:func:`committed_in_order`). Any other (an object
    store) costs one listing of the top-level names (:meth:`Tier.list_tops`) and one small ranged
    read per checkpoint id (:meth:`Tier.read_head`), whatever the number of data files: the
    ``metadata.json`` of checkpoint ``ID`` is the only object under ``ID/``.
    """
    if tier.cheap_listing:
        return {
            c.checkpoint_id: (c.header, c.objects[METADATA].size)  # type: ignore[misc]
            for c in committed_in_order(tier)
        }
    out: dict[str, tuple[CommitHeader, int]] = {}
    for name in tier.list_tops():
        try:
            check_checkpoint_id(name)
        except InvalidCheckpointId:
            continue
        try:
            head, size, mtime = tier.read_head(metadata_key(name), HEADER_MAX)
        except CheckpointNotFound:
            continue
        except (CorruptCheckpoint, OSError) as e:
            log.warning("cannot read the commit header of %s on %s: %s", name, tier.url, e)
            continue
        header = read_header(head)
        if header is None:
            log.warning("checkpoint %s on %s: its metadata header is unreadable; it is never 'latest'", name, tier.url)
            continue
        out[name] = (header, size)
    return out


def read_checkpoint_raw(tier: Tier, checkpoint_id: str) -> tuple[bytes, CheckpointDoc]:
    """:func:`read_checkpoint_doc` that also returns the raw ``metadata.json`` bytes."""
    key = metadata_key(check_checkpoint_id(checkpoint_id))
    size = tier.size(key)
    if size > MAX_METADATA_BYTES:
        raise CorruptCheckpoint(f"{tier.url}/{key}: metadata of {size} bytes is larger than {MAX_METADATA_BYTES} bytes")
    raw = tier.get(key, 0, size)
    return raw, parse_checkpoint_doc(raw, f"{tier.url}/{key}", checkpoint_id)


_docs: OrderedDict[bytes, CheckpointDoc] = OrderedDict()
_docs_lock = threading.Lock()
DOC_CACHE_ENTRIES = 8
"""Parsed metadata documents :func:`parse_checkpoint_doc` keeps, the most recently used."""
DOC_CACHE_MAX_BYTES = 4 << 20
"""The largest ``metadata.json`` whose parse it keeps."""


def parse_checkpoint_doc(raw: bytes, where: str, checkpoint_id: str) -> CheckpointDoc:
    """Parse ``metadata.json`` bytes read from ``where`` and check they name ``checkpoint_id``.

    The parse of the very same bytes (up to :data:`DOC_CACHE_MAX_BYTES`) is reused from the last
    :data:`DOC_CACHE_ENTRIES` documents that parsed, the bytes being the key: a resume reads one
    checkpoint's metadata for its health check and again for the load, moments apart. The same
    bytes parse to the same document, so nothing is skipped (the CRC32C in the header covered
    them the first time); bytes that fail are never kept. Callers do not modify the document
    (the load sets each record's ``chunk_size`` to the manifest's, the value it has)."""
    raw = bytes(raw)
    if len(raw) <= DOC_CACHE_MAX_BYTES:
        with _docs_lock:
            doc = _docs.get(raw)
            if doc is not None:
                _docs.move_to_end(raw)
    else:
        doc = None
    if doc is None:
        doc = parse_metadata(raw, where)
        if len(raw) <= DOC_CACHE_MAX_BYTES:
            with _docs_lock:
                _docs[raw] = doc
                while len(_docs) > DOC_CACHE_ENTRIES:
                    _docs.popitem(last=False)
    if doc.manifest.checkpoint_id != checkpoint_id:
        raise CorruptCheckpoint(f"{where}: metadata names checkpoint {doc.manifest.checkpoint_id!r}")
    return doc


def read_checkpoint_doc(tier: Tier, checkpoint_id: str) -> CheckpointDoc:
    """Read and validate ``ID/metadata.json`` from ``tier`` without torch (:func:`~tierckpt.layout.parse_metadata`).

    Whatever the file holds, the result is the parsed document, :class:`CorruptCheckpoint`
    (naming the file) or :class:`CheckpointNotFound`; tier failures raise the tier's errors.
    A file larger than :data:`~tierckpt.layout.MAX_METADATA_BYTES` is refused before it is read.
    """
    return read_checkpoint_raw(tier, checkpoint_id)[1]


def servable(tier: Tier, info: CheckpointInfo, manifest: CheckpointManifest) -> str | None:
    """Why ``tier`` cannot serve the checkpoint (None when it can, as far as a listing tells).

    Only tiers with cheap listings are checked (an object store's commit follows every upload).
    On a shared tier every data file must be there with its recorded size; on a node-local tier
    (each node holds its own ranks' files) at least one, and none of a wrong size.
    """
    if not tier.cheap_listing:
        return None
    need = {f: s for f, s in manifest.files.items() if s > 0}
    if not need:
        return None
    have = {name: o.size for name, o in info.objects.items() if name in need}
    wrong = [f for f, s in have.items() if s != need[f]]
    if wrong:
        return f"data file {wrong[0]} has {have[wrong[0]]} bytes, the metadata says {need[wrong[0]]}"
    if tier.node_local:
        return None if have else f"none of its {len(need)} data files is on this node"
    missing = sorted(set(need) - set(have))
    return f"data file {missing[0]} is missing ({len(missing)} of {len(need)})" if missing else None


@dataclass
class Latest:
    """The newest loadable committed checkpoint over some tiers, and which of them hold it."""

    checkpoint_id: str
    committed: float
    step: int | None
    seq: int
    tiers: list[str]
    holding: list[Tier] = field(default_factory=list, repr=False)
    manifest: CheckpointManifest | None = field(default=None, repr=False)
    doc: CheckpointDoc | None = field(default=None, repr=False)

    @property
    def metadata(self) -> Any:
        """DCP ``Metadata`` of the checkpoint (built on first use: this imports torch)."""
        if self.doc is None:
            return None
        if not hasattr(self, "_metadata"):
            self._metadata = self.doc.to_metadata()
        return self._metadata

    def to_json(self) -> dict:
        return {
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "seq": self.seq,
            "committed": self.committed,
            "tiers": self.tiers,
        }


def find_latest(tiers: list[Tier], below: tuple | None = None) -> Latest:
    """The newest committed checkpoint over ``tiers`` that is valid and servable.

    Ordered by commit header (seq, commit time, step); the first candidate whose metadata parses
    on some tier, whose files that tier can serve and that is under no live tombstone there (a
    deletion running, or a crashed one whose tombstone has not expired: one listing of its
    leases per tier holding the winner) wins. ``below``: only candidates committed
    before that order key (:func:`order_of`: the next candidate after a checkpoint that failed).
    Unreachable tiers are logged and skipped; when nothing qualifies, the first unreachable
    tier's error is raised, else :class:`CheckpointNotFound` naming the tiers.
    """
    listed: dict[str, list[tuple[Tier, CheckpointInfo]]] = {}
    unreachable: list[TierckptError] = []
    for tier in tiers:
        try:
            done = committed_in_order(tier)
        except TierckptError as e:
            unreachable.append(e)
            continue
        for c in done:
            listed.setdefault(c.checkpoint_id, []).append((tier, c))
    key = {cid: max(c.header.order_key() for _t, c in found) for cid, found in listed.items()}  # type: ignore[union-attr]
    order = sorted((cid for cid in listed if below is None or key[cid] < below), key=key.__getitem__, reverse=True)
    for cid in order:
        holding: list[tuple[Tier, CheckpointInfo]] = listed[cid]
        for tier, info in holding:
            try:
                doc = read_checkpoint_doc(tier, cid)
            except (CheckpointNotFound, CorruptCheckpoint) as e:
                log.error("skipping %s on %s for 'latest': %s", cid, tier.url, e)
                continue
            man = doc.manifest
            why = servable(tier, info, man) or deletion_under_way(tier, cid)
            if why is not None:
                log.error("skipping %s on %s for 'latest': %s", cid, tier.url, why)
                continue
            ok = [
                t
                for t, i in holding
                if t is tier or (servable(t, i, man) is None and deletion_under_way(t, cid) is None)
            ]
            for err in unreachable:
                log.warning("a tier was unreachable while resolving latest: %s", err)
            return Latest(
                checkpoint_id=cid,
                committed=man.committed,
                step=man.step,
                seq=man.seq,
                tiers=[t.name for t in ok],
                holding=ok,
                manifest=man,
                doc=doc,
            )
    if unreachable:
        raise unreachable[0]  # nothing found where we could look: the outage is the answer
    older = " older than the one given" if below is not None else ""
    raise CheckpointNotFound(f"no committed checkpoint{older} on any tier: " + ", ".join(t.url for t in tiers))


def deletion_under_way(tier: Tier, checkpoint_id: str) -> str | None:
    """Why ``tier``'s copy of ``checkpoint_id`` cannot be loaded now: a live tombstone (a deletion
    runs, or one crashed and its tombstone has not expired); None when there is none, or when the
    tier cannot list its leases (the load's own lease then looks again)."""
    try:
        tomb = live_tomb(tier, checkpoint_id)
    except (TierckptError, OSError) as e:
        log.debug("cannot look for tombstones of %s on %s: %s", checkpoint_id, tier.url, e)
        return None
    return None if tomb is None else f"it is being deleted there ({tomb.deleting()})"


def order_of(tiers: list[Tier], checkpoint_id: str) -> tuple:
    """The commit order key of ``checkpoint_id`` (its newest readable commit header over
    ``tiers``); :class:`CheckpointNotFound` when no tier holds it committed with a readable header."""
    check_checkpoint_id(checkpoint_id)  # InvalidCheckpointId before any tier is read
    keys = []
    for tier in tiers:
        try:
            header = commit_header(tier, checkpoint_id)  # one size and one small read
        except CheckpointNotFound:
            continue
        except TierckptError as e:
            log.warning("cannot read the commit header of %s on %s: %s", checkpoint_id, tier.url, e)
            continue
        if header is not None:
            keys.append(header.order_key())
    if not keys:
        raise CheckpointNotFound(
            f"checkpoint {checkpoint_id} is not committed (with a readable header) on any tier: "
            + ", ".join(t.url for t in tiers)
        )
    return max(keys)
