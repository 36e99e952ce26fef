"""How the ranks of a distributed load agree on what to read, at a cost per rank that does not grow with the job.

With a node-local first tier (``[local] path = ".../{node}"``) each node holds its own ranks'
files (and the peer copies it received), while a restarted job may read any item from any file.
The ranks of a ``dcp.load`` therefore agree, inside ``read_metadata``, on one checkpoint and on
who holds what. The agreement runs in phases, each a plain function, so that the reader runs them
between its collectives and the many-rank simulator (:mod:`tierckpt.testing.scale`) runs the very
same functions for thousands of simulated ranks:

1. :func:`local_view`, every rank: what its node holds: the newest committed checkpoints of its
   first tier (the requested one only, unless ``latest``), each as its commit ``seq``, the number
   of data files its metadata names and which of them the node holds whole, as *ranges* of
   indices into the metadata's sorted file list. Only the node's own tier is read: no shared
   tier (S3) is touched. The raw metadata read here stays with the rank.
2. The views go to the coordinator only (``gather_object``): O(N) bytes for the job, never N².
3. :func:`decide`, the coordinator alone: lists each shared tier once (one delimited listing and
   one small ranged read per committed checkpoint: :func:`tierckpt.catalog.committed_headers`),
   picks the newest checkpoint whose every data file some node or a shared tier holds, and
   takes the job's one lease on each shared tier the load will read from (:attr:`Decision.leases`).
   The lease's committed check on the first such tier reads the whole ``metadata.json`` (one GET
   where a HEAD proved no more) when the copy is of use: the coordinator then holds that tier's
   metadata (:attr:`Decision.metadata`) for its own rank and for the few ranks it sends it to.
   It keeps who holds which file (:attr:`Decision.holders`, for the read schedule) and returns a
   :class:`Verdict` of constant size (plus ranges of ranks).
4. The verdict is broadcast (one ``broadcast_object_list``). Every rank then has the metadata
   (:func:`metadata_source`): from its own node when it holds the checkpoint (read in phase 1),
   on the coordinator from its lease's read, from the rank that holds it (point to point: the
   coordinator's shared copy, else a node's) when no shared tier has it or at most
   :data:`PEER_METADATA_MAX` ranks lack it, else with one GET from the shared tier.
5. When every rank has read (the reader's "done reading" check-in, :mod:`tierckpt.chain.checkin`;
   outside ``dcp.load`` a store counter, :func:`done_key`), the coordinator releases the job's
   leases.

So a restart whose files are all on local disks sends the bucket one LIST plus one small GET
per committed checkpoint there, for the whole job; a load from S3 sends the ranged GETs of the
data it reads, the coordinator's listing, headers and lease (PUT, LIST, the metadata GET,
DELETE), and one metadata GET per other rank once more than :data:`PEER_METADATA_MAX` ranks
lack it.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from ..catalog import lease as leases
from ..catalog.listing import committed_headers, committed_in_order, read_checkpoint_raw
from ..errors import CheckpointNotFound, CorruptCheckpoint, TierckptError
from ..format.layout import MAX_METADATA_BYTES, metadata_key
from ..format.metadata import CheckpointDoc, read_header
from ..tiers.base import Tier

__all__ = [
    "view_to_wire",
    "view_from_wire",
    "verdict_to_wire",
    "verdict_from_wire",
    "CANDIDATES",
    "Held",
    "NodeView",
    "Verdict",
    "Decision",
    "local_view",
    "decide",
    "metadata_source",
    "read_shared_metadata",
    "ranges_of",
    "in_ranges",
    "done_key",
    "data_files",
]

log = logging.getLogger("tierckpt.peers")

CANDIDATES = 3
"""How many of its newest committed checkpoints each node reports for ``latest``."""

PEER_METADATA_MAX = 32
"""At most this many ranks lacking the metadata get it from another node rather than a shared tier."""

PEER_METADATA_BYTES = 64 << 20
"""At most this many bytes of metadata in all go from the coordinator to the ranks lacking it
(a copy it read from a shared tier); beyond, each of them reads it from that tier."""

Ranges = tuple[tuple[int, int], ...]


def ranges_of(indices: list[int] | set[int]) -> Ranges:
    """Sorted integers as half-open ``(lo, hi)`` ranges: ``[0, 1, 2, 5]`` -> ``((0, 3), (5, 6))``."""
    out: list[tuple[int, int]] = []
    for i in sorted(indices):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return tuple(out)


def in_ranges(i: int, ranges: Ranges) -> bool:
    return any(lo <= i < hi for lo, hi in ranges)


def expand(ranges: Ranges) -> list[int]:
    return [i for lo, hi in ranges for i in range(lo, hi)]


def data_files(files: dict[str, int]) -> list[str]:
    """The data files a checkpoint's metadata names with bytes, sorted: what the indices of
    :attr:`Held.ranges` point into (the same list on every node holding the same metadata)."""
    return sorted(f for f, s in files.items() if s > 0)


def file_index(files: dict[str, int]) -> dict[str, int]:
    """Each data file's index into :func:`data_files`."""
    return {f: i for i, f in enumerate(data_files(files))}


@dataclass(frozen=True)
class Held:
    """One checkpoint as a node holds it: its commit ``seq``, how many data files its metadata
    names, which of them (indices into :func:`data_files`) the node holds whole, and the
    metadata's size in bytes."""

    seq: int
    nfiles: int
    ranges: Ranges
    md_size: int


@dataclass
class NodeView:
    """What one rank's node holds (phase 1); ``error`` when its tier could not be read."""

    root: str
    have: dict[str, Held] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class Verdict:
    """What the coordinator tells every rank (phase 4): constant size plus ranges of ranks.

    ``md_rank``: a rank holding the metadata (-1: none): the coordinator when it read it from
    shared tier ``md_from`` taking the job's lease there, else a rank whose node holds it
    (``md_from`` empty); ``md_send``: the ranks that get it from ``md_rank`` point to point (their
    node lacks it, and no shared tier holds it or at most :data:`PEER_METADATA_MAX` ranks lack it);
    ``shared``: names of the shared tiers holding it committed, ``leased`` those the coordinator
    holds a lease on for the job; ``load``: this load's token (store keys); ``error``: why no
    checkpoint can be loaded (every rank raises it).
    """

    checkpoint_id: str
    seq: int = 0
    md_rank: int = -1
    md_size: int = 0
    md_send: Ranges = ()
    shared: tuple[str, ...] = ()
    leased: tuple[str, ...] = ()
    load: str = ""
    error: str = ""
    md_from: str = ""


@dataclass
class Decision:
    """The coordinator's whole answer: the verdict, and (kept on the coordinator only) which
    ranks' nodes hold each data file, by index into :func:`data_files`, the job's leases, and
    the ``metadata.json`` its first lease read: ``(shared tier name, bytes)``, or None."""

    verdict: Verdict
    holders: dict[int, list[int]] = field(default_factory=dict)
    leases: list[leases.Lease] = field(default_factory=list)
    metadata: tuple[str, bytes] | None = None

    def holders_by_file(self, files: dict[str, int]) -> dict[str, list[int]]:
        names = data_files(files)
        return {names[i]: rs for i, rs in self.holders.items() if i < len(names)}

    def release(self) -> None:
        for lease in self.leases:
            lease.release()
        self.leases = []


def view_to_wire(v: NodeView) -> tuple:
    """A view as plain tuples for the gather (no class names or field names on the wire)."""
    return (v.root, v.error, {cid: (h.seq, h.nfiles, h.ranges, h.md_size) for cid, h in v.have.items()})


def view_from_wire(w: tuple) -> NodeView:
    root, error, have = w
    return NodeView(root, {cid: Held(*h) for cid, h in have.items()}, error)


def verdict_to_wire(v: Verdict) -> tuple:
    """A verdict as a plain tuple (``md_from`` only when set: a restart's verdict stays as small)."""
    w = (v.checkpoint_id, v.seq, v.md_rank, v.md_size, v.md_send, v.shared, v.leased, v.load, v.error)
    return (*w, v.md_from) if v.md_from else w


def verdict_from_wire(w: tuple) -> Verdict:
    return Verdict(*w)


def local_view(first: Tier, checkpoint_id: str) -> tuple[NodeView, dict[str, tuple[bytes, CheckpointDoc]]]:
    """Phase 1, every rank: what its node's first tier holds (see the module docstring), and the
    raw and parsed metadata of each reported checkpoint (kept by the rank: phase 4 reuses it).

    Never raises for the tier's failures: they travel in :attr:`NodeView.error`."""
    view = NodeView(first.root_id())
    docs: dict[str, tuple[bytes, CheckpointDoc]] = {}
    try:
        done = committed_in_order(first)
    except TierckptError as e:
        log.warning("cannot list %s: %s", first.url, e)
        view.error = f"{first.url}: {e}"
        return view, docs
    if checkpoint_id != "latest":
        done = [c for c in done if c.checkpoint_id == checkpoint_id]
    for c in reversed(done[-CANDIDATES:] if checkpoint_id == "latest" else done):
        try:
            raw, doc = read_checkpoint_raw(first, c.checkpoint_id)
        except TierckptError as e:
            log.error("skipping %s on %s: %s", c.checkpoint_id, first.url, e)
            continue
        need = doc.manifest.files
        index = file_index(need)
        held = [index[f] for f, o in c.objects.items() if f in index and o.size == need[f]]
        view.have[c.checkpoint_id] = Held(doc.manifest.seq, len(index), ranges_of(held), len(raw))
        docs[c.checkpoint_id] = (raw, doc)
    return view, docs


def decide(
    views: list[NodeView],
    shared_tiers: list[Tier],
    checkpoint_id: str,
    *,
    take_leases: bool = True,
    names: dict[str, list[str]] | None = None,
) -> Decision:
    """Phase 3, the coordinator only: the checkpoint to load and who holds what.

    ``views[r]`` is rank ``r``'s :class:`NodeView`. Each shared tier is listed once here (and
    only here). The newest checkpoint (by commit seq) wins whose data files are all held whole by
    some node, or that a shared tier holds committed. When the load needs a shared tier (a file
    no node holds, or no node holding the metadata), the coordinator takes the job's lease on
    it (``take_leases``); a deletion under way there makes it fall back to the next candidate.
    Taking the first lease reads the metadata there whole (:attr:`Decision.metadata`) when the
    coordinator's node lacks it or few ranks do; the verdict then names that copy as the one to
    share with those ranks (``md_rank`` 0, ``md_from``).
    Never raises for a missing checkpoint: the verdict's ``error`` says why, for every rank
    (naming the first missing file when ``names`` has the checkpoint's :func:`data_files`)."""
    for r, v in enumerate(views):
        if v.error:
            log.warning("rank %d could not read its node's tier: %s", r, v.error)
    shared: dict[str, dict[str, tuple[int, int]]] = {}  # tier name -> cid -> (seq, metadata size)
    for tier in shared_tiers:
        try:
            shared[tier.name] = {cid: (h.seq, size) for cid, (h, size) in committed_headers(tier).items()}
        except TierckptError as e:
            log.warning("cannot list %s: %s", tier.url, e)
    seqs: dict[str, int] = {}
    for v in views:
        for cid, h in v.have.items():
            seqs[cid] = max(seqs.get(cid, 0), h.seq)
    for listed in shared.values():
        for cid, (seq, _size) in listed.items():
            seqs[cid] = max(seqs.get(cid, 0), seq)
    if checkpoint_id != "latest":
        seqs = {c: s for c, s in seqs.items() if c == checkpoint_id}
    why: list[str] = []
    for cid in sorted(seqs, key=lambda c: (seqs[c], c), reverse=True):
        seq = seqs[cid]
        holders: dict[int, list[int]] = {}
        nfiles, md_rank, md_size = 0, -1, 0
        lacking: list[int] = []
        for r, v in enumerate(views):
            got = v.have.get(cid)
            if got is None or got.seq != seq:
                lacking.append(r)
                continue
            if md_rank < 0:
                md_rank, nfiles, md_size = r, got.nfiles, got.md_size
            for i in expand(got.ranges):
                holders.setdefault(i, []).append(r)
        on = [name for name, listed in shared.items() if listed.get(cid, (None,))[0] == seq]
        missing = [i for i in range(nfiles) if i not in holders]
        covered = md_rank >= 0 and not missing
        if not on and not covered:
            known = (names or {}).get(cid)
            what = (
                (known[missing[0]] if known and missing[0] < len(known) else f"number {missing[0]}")
                if missing
                else "metadata"
            )
            why.append(
                f"{cid}: data file {what} is on no node of this job ({len(missing)} missing) and on no shared tier"
            )
            continue
        # The metadata goes point to point from a node holding it when no shared tier has it, or
        # when few ranks lack it (one rank serving thousands would be the bottleneck).
        send = ranges_of(lacking) if md_rank >= 0 and (not on or len(lacking) <= PEER_METADATA_MAX) else ()
        held: list[leases.Lease] = []
        leased: list[str] = []
        raw: bytes | None = None
        raw_from = md_from = ""
        needs_shared = not covered or (bool(lacking) and not send)
        others = [r for r in lacking if r != 0]
        # The coordinator's lease reads the metadata (a GET instead of a HEAD) when the copy is
        # of use: the coordinator's own node lacks it, or it goes point to point to a few ranks.
        wanted = 0 in lacking or 0 < len(others) <= PEER_METADATA_MAX
        if needs_shared and take_leases:
            for tier in shared_tiers:
                if tier.name not in on:
                    continue
                size = shared[tier.name][cid][1]
                read = wanted and raw is None and 0 < size <= MAX_METADATA_BYTES
                try:
                    lease = leases.acquire(tier, cid, purpose="load", read_metadata=size if read else 0)
                except CheckpointNotFound as e:  # deleted meanwhile, or a deletion under way
                    log.warning("%s", e)
                    continue
                body = lease.metadata
                header = read_header(body) if body is not None else None
                if body is not None and (header is None or header.seq != seq):
                    log.warning("checkpoint %s on %s: its metadata changed since it was listed", cid, tier.url)
                    lease.release()
                    continue
                held.append(lease)
                leased.append(tier.name)
                if body is not None:
                    raw, raw_from = body, tier.name
            if not leased:
                why.append(f"{cid}: being deleted from {', '.join(on)}")
                continue
        if raw is not None and 0 < len(others) <= PEER_METADATA_MAX and len(others) * len(raw) <= PEER_METADATA_BYTES:
            # The coordinator holds the shared tier's own copy (with its index of encoded files):
            # it goes to the few ranks lacking one, point to point.
            md_rank, md_size, md_from, send = 0, len(raw), raw_from, ranges_of(others)
        elif md_rank < 0:
            md_size = shared[(leased or on)[0]][cid][1]
        verdict = Verdict(
            cid, seq, md_rank, md_size, send, tuple(on), tuple(leased), uuid.uuid4().hex[:16], md_from=md_from
        )
        return Decision(verdict, holders, held, (raw_from, raw) if raw is not None else None)
    nodes = sorted({v.root for v in views})
    return Decision(
        Verdict(
            checkpoint_id,
            error=(
                f"checkpoint {checkpoint_id}: no committed checkpoint this job can read in full (nodes: {', '.join(nodes)})"
                + (": " + "; ".join(why[:3]) if why else "")
            ),
        )
    )


def metadata_source(verdict: Verdict, rank: int, mine: bool, held: bool = False) -> str:
    """Phase 4, every rank: where its metadata comes from: ``"local"`` (its node holds the
    checkpoint: ``mine``), ``"lease"`` (the coordinator read it taking the job's lease:
    ``held``, :attr:`Decision.metadata`), ``"peer"`` (sent by ``verdict.md_rank``) or
    ``"shared"`` (one GET)."""
    if mine:
        return "local"
    if held:
        return "lease"
    if in_ranges(rank, verdict.md_send):
        return "peer"
    return "shared"


def read_shared_metadata(tiers: list[Tier], verdict: Verdict) -> tuple[str, bytes]:
    """Phase 4 on a rank whose node lacks the checkpoint: its ``metadata.json`` with one bounded
    GET from the first shared tier holding it (the size comes with the verdict); that tier's
    name and the bytes."""
    if verdict.md_size > MAX_METADATA_BYTES:
        raise CorruptCheckpoint(
            f"checkpoint {verdict.checkpoint_id}: metadata of {verdict.md_size} bytes is larger "
            f"than {MAX_METADATA_BYTES} bytes"
        )
    errors: list[str] = []
    for tier in tiers:
        if tier.name not in verdict.shared:
            continue
        try:
            return tier.name, tier.get(metadata_key(verdict.checkpoint_id), 0, verdict.md_size)
        except TierckptError as e:
            errors.append(f"{tier.url}: {e}")
    raise CheckpointNotFound(
        f"checkpoint {verdict.checkpoint_id}: cannot read its metadata from a shared tier: "
        + ("; ".join(errors) or "none reachable from this rank")
    )


def done_key(verdict: Verdict) -> str:
    """The store counter every rank increments once its reads are over (phase 5)."""
    return f"tierckpt/load/{verdict.load}/done"
