"""``TieredReader``: the DCP ``StorageReader`` that loads from the fastest tier holding a committed copy.

DCP calls (``dcp.load``)::

    reset(checkpoint_id)                     every rank (``"latest"`` or an explicit id)
    read_metadata()                          coordinator (broadcast by DCP), or every rank with no_dist
    set_up_storage_reader(metadata, is_coordinator)   every rank: learns the resolved id and
                                             which tiers hold a committed copy *here*
    prepare_local_plan / prepare_global_plan unchanged
    read_data(plan, planner)                 every rank: coalesced, parallel, verified reads

The bytes come through :class:`tierckpt.readback.Readback`, the one verified multi-tier read
engine: per data file the fastest tier holding a committed copy (local when this node has the
file, else the next tier), adjacent items merged into one scatter read (straight into the
destination tensor when it is a contiguous CPU tensor of the saved dtype and shape), runs in
parallel (on the calling thread when every file this rank reads is local and in the page cache:
no reader threads to start for memory copies), every item's CRC32C checked, a failing item read again from the next tier holding it.
This module only turns DCP plans into read requests and delivers them. Non-tensor items are
unpickled with ``weights_only=True`` unless ``allow_pickle=True``.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from .. import loading, telemetry
from ..catalog import lease as leases
from ..catalog.checkpoints import checkpoint_id_of
from ..catalog.listing import find_latest, read_checkpoint_metadata
from ..chain import peers
from ..codec.view import decoding
from ..config import TierConfig, load_config
from ..errors import CheckpointBeingDeleted, CheckpointNotFound, ChecksumMismatch, CorruptCheckpoint, TierckptError
from ..format.layout import check_checkpoint_id, data_key, is_valid_checkpoint_id
from ..format.layout import padded as _padded
from ..format.metadata import ItemRecord, item_intact
from ..tiers import make_tiers
from ..tiers.base import Tier
from ..tiers.local import LocalTier
from . import agreement
from .deliver import Item, buffer_for, deliver, direct_ok, is_whole, unfilled
from .fill import LoadFill
from .optimcheck import warn_missing_optimizer_state
from .readback import Readback, Request, hold
from .resolve import MetadataResolution

__all__ = ["TieredReader", "open_tiers", "read_checkpoint_metadata"]

log = logging.getLogger("tierckpt")


def open_tiers(cfg: TierConfig) -> list[Tier]:
    """The configured tiers, fastest first (local, then S3)."""
    return make_tiers(cfg)


def _distributed() -> bool:
    """Whether a process group of more than one rank is initialized (then ``latest`` is resolved by
    every rank together, in ``read_metadata``)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class TieredReader(MetadataResolution, StorageReader):
    """DCP storage reader for tierckpt.

    Args:
        config: a :class:`~tierckpt.config.TierConfig`, a TOML path, or ``None`` for ``$TIERCKPT_CONFIG``.
        allow_pickle: unpickle non-tensor items without ``weights_only`` (only for checkpoints you trust).
        threads: parallel reads (default: ``[local] flush_threads`` or ``[s3] concurrency``).
    """

    def __init__(
        self, config: TierConfig | str | None = None, *, allow_pickle: bool = False, threads: int | None = None
    ) -> None:
        super().__init__()
        self.cfg = config if isinstance(config, TierConfig) else load_config(config)
        self.tiers = open_tiers(self.cfg)
        self.allow_pickle = allow_pickle
        # the fastest tier's read_concurrency: [local] flush_threads, or [s3] concurrency without a local tier
        self.threads = max(1, threads or (self.tiers[0].read_concurrency if self.tiers else 4))
        self.checkpoint_id: str = "latest"
        self.resolved_id: str | None = None
        self.metadata: Metadata | None = None
        self.chunk_size = 0
        self._holding: list[Tier] = []
        self._leases: list[leases.Lease] = []
        self.served: dict[str, str] = {}  # file -> tier name that served it (last read)
        self.recovered: dict[str, str] = {}  # file -> tier that served an item the first one failed (last read)
        self.from_peers: dict[str, int] = {}  # file -> bytes received from other nodes (last read)
        self.fill: LoadFill | None = None  # the last load's fill of the local tier ([local] fill_on_load)
        self._manifest: Any = None
        self._raw_md: bytes | None = None  # metadata.json of the agreed checkpoint (peers)
        self._peers: peers.PeerGroup | None = None
        self._docs: dict[str, tuple] = {}  # what this rank's node holds: id -> (raw, doc) (agreement phase 1)
        self._shared_doc: tuple[str, Any] | None = None  # (shared tier, its doc) when the metadata came from it
        self._verdict: agreement.Verdict | None = None  # what every rank agreed to load
        self._decision: agreement.Decision | None = None  # the coordinator's: who holds what, the job's leases
        self._roots: list[str] = []  # the coordinator's: each rank's node
        self._failed: BaseException | None = None  # why the last read_metadata failed
        self._passed: set[bytes] = set()  # objects of the last read that passed the weights_only check
        self._latest: str | None = None  # "latest" as resolved by reset() (not distributed)
        self._coordinator = False  # set_up_storage_reader's is_coordinator (warnings once per load)
        self._warm = False  # this rank's reads are all in the local tier's page cache (prepare_local_plan)

    # -- DCP StorageReader ----------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        """Every rank: the checkpoint to load, ``"latest"`` (also for ``None``) or an id; a path
        (``<dir>/step-100``) stands for its last component."""
        cid = "latest" if checkpoint_id is None else checkpoint_id_of(checkpoint_id)
        if cid != "latest":
            check_checkpoint_id(cid)
        self.checkpoint_id = cid
        self.resolved_id = None
        self.metadata = None
        self.release()
        self._failed = None
        self._verdict = None  # agreed again by the next resolve()/read_metadata
        self._decision = None
        self._docs = {}
        self._shared_doc = None
        self._raw_md = None
        self._latest = None
        if cid == "latest" and self.tiers and not _distributed():
            # Resolved here, outside DCP's metadata exchange, so that a first start raises one
            # CheckpointNotFound out of dcp.load (inside it, DCP logs the error twice with its
            # traceback and re-raises its text in a CheckpointException). With a process group the
            # ranks resolve together in read_metadata (a collective), as before.
            try:
                self._latest = find_latest(self.tiers).checkpoint_id
            except CheckpointNotFound as e:
                raise CheckpointNotFound(
                    f"{e} (on a first start tierckpt.latest(cfg) returns None: check it before dcp.load)"
                ) from None

    def release(self) -> None:
        """Give up the leases this reader holds and the local tier's prefetch (done at the end of
        ``read_data``; idempotent)."""
        for lease in self._leases:
            lease.release()
        self._leases = []
        if self._decision is not None:
            self._decision.release()
        for t in self.tiers[:1]:
            if isinstance(t, LocalTier):
                t.end_prefetch()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata
        self._coordinator = bool(is_coordinator)
        sm = metadata.storage_meta
        if sm is None or not sm.checkpoint_id:
            raise CorruptCheckpoint("metadata without a checkpoint id: was it read by TieredReader?")
        self.resolved_id = str(sm.checkpoint_id)
        recs = list((metadata.storage_data or {}).values())
        self.chunk_size = getattr(recs[0], "chunk_size", 0) if recs else 0
        for lease in self._leases:
            lease.release()
        self._leases = []
        v = self._verdict
        if v is not None and v.checkpoint_id == self.resolved_id:
            # Agreed by the job: this rank leases its node's copy; the coordinator holds the job's
            # one lease on each shared tier the load reads from (released once every rank read).
            self._holding = []
            if v.checkpoint_id in self._docs:
                try:
                    self._holding, self._leases = hold(self.tiers[:1], self.resolved_id, "load")
                except CheckpointNotFound as e:
                    log.warning(
                        "checkpoint %s: this node's copy is gone (%s); reading from elsewhere", self.resolved_id, e
                    )
            known = self._shared_doc
            self._holding += [
                decoding(t, self.resolved_id, known[1] if known and known[0] == t.name else None)
                for t in self.tiers[1:]
                if t.name in v.shared
            ]
            return
        # A lease on every tier holding a committed copy keeps retention and gc (in any process)
        # away until read_data is done.
        try:
            self._holding, self._leases = hold(self.tiers, self.resolved_id, "load")
        except CheckpointBeingDeleted:
            raise  # its message names the checkpoint, the tiers and the deletion
        except CheckpointNotFound as e:
            raise CheckpointNotFound(
                f"checkpoint {self.resolved_id}: no tier reachable from this rank holds a committed copy ({e})"
            ) from None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Every rank: tags the plan with the resolved id, and announces this rank's reads to the
        local tier, which starts prefetching a small load while DCP plans (:meth:`LocalTier.prefetch`)."""
        self._prefetch(plan)
        if self._coordinator and self.metadata is not None:
            warn_missing_optimizer_state(self.resolved_id, self.metadata, plan)
        return dataclasses.replace(plan, storage_data=self.resolved_id)

    def _prefetch(self, plan: LoadPlan) -> None:
        self._warm = False
        local = self._holding[0] if self._holding else None
        if not isinstance(local, LocalTier) or self.metadata is None or self.resolved_id is None:
            return
        storage = self.metadata.storage_data or {}
        spans: dict[str, list[tuple[int, int]]] = {}
        for ri in plan.items:
            rec = storage.get(ri.storage_index)
            if rec is not None and rec.length:
                spans.setdefault(data_key(self.resolved_id, rec.file), []).append((rec.pos, rec.pos + rec.length))
        self._warm = local.cached(spans)  # every file local, in the page cache: read_data copies memory
        local.prefetch(spans)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: every rank must have resolved the same checkpoint (``latest`` may race a
        commit); with peers, who serves which items to whom (:func:`tierckpt.peers.schedule`)."""
        ids = [p.storage_data for p in plans]
        if len(set(ids)) > 1:
            by_id: dict[str, list[int]] = {}
            for r, i in enumerate(ids):
                by_id.setdefault(str(i), []).append(r)
            raise TierckptError(
                "ranks resolved different checkpoints: "
                + "; ".join(f"{i} on ranks {rs}" for i, rs in by_id.items())
                + " (a commit raced the load, or a node's local tier is behind S3): pass an explicit checkpoint_id"
            )
        d = self._decision
        if d is None or d.verdict.checkpoint_id != ids[0] or len(plans) != len(self._roots) or self._manifest is None:
            return plans
        assert self.metadata is not None
        storage = self.metadata.storage_data
        wanted = [
            {
                ri.storage_index: (storage[ri.storage_index].file, storage[ri.storage_index].length)
                for ri in p.items
                if ri.storage_index in storage
            }
            for p in plans
        ]
        routes = peers.schedule(
            wanted,
            d.holders_by_file(self._manifest.files),
            bool(d.verdict.shared),
            self._roots,
            d.verdict.checkpoint_id,
        )
        moves = any(route["recv"] for route in routes)  # then every rank takes part in making the transport
        return [
            dataclasses.replace(p, storage_data={"id": p.storage_data, "x": moves, **route})
            for p, route in zip(plans, routes)
        ]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        cid = checkpoint_id_of(checkpoint_id)
        return cid == "latest" or is_valid_checkpoint_id(cid)

    # -- reading --------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        assert self.metadata is not None and self.resolved_id is not None
        t_load = time.perf_counter()
        self._passed = set()  # objects of this load that passed the weights_only check (deliver)
        try:
            storage: dict[MetadataIndex, ItemRecord] = self.metadata.storage_data
            groups: dict[MetadataIndex, Item] = {}
            for ri in plan.items:
                rec = storage.get(ri.storage_index)
                if rec is None:
                    raise CorruptCheckpoint(
                        f"checkpoint {self.resolved_id}: no stored item for {ri.storage_index.fqn!r}"
                    )
                g = groups.get(ri.storage_index)
                if g is None:
                    g = groups[ri.storage_index] = Item(ri.storage_index, rec, [])
                g.reads.append(ri)
            items = list(groups.values())
            route = plan.storage_data if isinstance(plan.storage_data, dict) else {}
            recv_from = {int(p): idx for p, idx in route.get("recv", [])}
            send_to = {int(p): idx for p, idx in route.get("send", [])}
            incoming = {i for idx in recv_from.values() for i in idx}
            outgoing = {i for idx in send_to.values() for i in idx}  # read once, for the peers and for this rank
            requests: list[Request] = []
            for it in items:  # resolve destinations on the calling thread
                if it.rec.is_tensor:
                    it.targets = [planner.resolve_tensor(ri) for ri in it.reads]
                    if len(it.reads) == 1 and is_whole(it.reads[0], it.rec) and direct_ok(it.targets[0], it.rec):
                        it.direct = it.targets[0]
                if it.index in incoming or it.index in outgoing:
                    continue
                what = f"item {it.index.fqn!r} (offset {list(it.index.offset or [])})"
                requests.append(
                    Request(
                        it.rec,
                        buffer_for(it),
                        what,
                        done=functools.partial(_done, it, self.allow_pickle, self.resolved_id, self._passed),
                    )
                )
            # each item served to other nodes is read (and verified) once, whatever the number of peers,
            # in the same read as this rank's own items (one request per run of a file)
            unique = sorted(outgoing, key=lambda i: (storage[i].file, storage[i].pos))
            staged = {i: memoryview(bytearray(storage[i].length)) for i in unique}
            serve = [Request(storage[i], staged[i], f"item {i.fqn!r} for other nodes") for i in unique]
        except BaseException:
            # Check in all the same (as after a failed read): the other ranks then get this error from
            # DCP's gather at once instead of naming this rank after the timeout.
            self._done_reading()
            self.release()
            loading.end(self)
            raise
        self.fill = None
        ok, error = False, None
        try:
            # A load whose files are all in the page cache is read on this thread: memory copies and
            # CRC32C at memory speed, where starting the reader threads took longer (up to 200 ms
            # measured on a loaded 2-core host for a 50 MB resume)
            threads = 1 if self._warm else self.threads
            engine = (
                Readback(self.resolved_id, self._holding, self.chunk_size, threads=threads)
                if requests or serve
                else None
            )
            self.fill = self._plan_fill(engine, requests, [storage[i] for i in incoming | (outgoing & set(groups))])
            if route.get("x") and self._peers is not None:
                self._peers.transport()  # every rank, at the same point (collective the first time)
            failed: TierckptError | None = None
            if engine is not None:
                try:
                    engine.read(requests + serve)
                except TierckptError as e:
                    if not (recv_from or send_to):
                        raise
                    failed = e  # take part in the exchange all the same (receivers see the damage), then raise
                    log.error("checkpoint %s: reading items (some for other nodes) failed: %s", self.resolved_id, e)
                finally:
                    self.served.update(engine.served)
                    self.recovered.update(engine.recovered)
            if recv_from or send_to:
                self._exchange(storage, groups, recv_from, send_to, staged, served_ok=failed is None)
            if failed is not None:
                raise failed
            ok = True
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            try:
                if self.fill is not None:
                    self.fill.finish(ok)
                self._done_reading()
            finally:
                self.release()
                loading.end(self)
                telemetry.loaded(self, t_load, error, items)
        for it in items:  # deliver on the calling thread
            if it.rec.is_tensor:
                for ri, t in zip(it.reads, it.targets):
                    planner.commit_tensor(ri, t)
            else:
                for ri in it.reads:
                    planner.load_bytes(ri, io.BytesIO(it.data))
        self._passed = set()
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    def _plan_fill(
        self, engine: Readback | None, requests: list[Request], received: list[ItemRecord]
    ) -> LoadFill | None:
        """The fill of the local tier for this read (:mod:`tierckpt.fill`), or None: the items read
        from the tiers (``requests``) and those other nodes send (``received``)."""
        local = self.tiers[0] if self.tiers else None
        man = self._manifest
        if (
            local is None
            or self.cfg.local is None
            or not self.cfg.local.fill_on_load
            or man is None
            or man.checkpoint_id != self.resolved_id
            or not isinstance(local, LocalTier)
        ):
            return None
        rank = None
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            rank = torch.distributed.get_rank()

        def lacks(file: str) -> bool:  # this read takes the file from elsewhere than the local tier
            return engine is None or local not in engine.tiers_for(file)

        shared = [t for t in self._holding if t is not local]
        assert self.resolved_id is not None  # read_data runs after read_metadata resolved the id
        return LoadFill.plan(
            local,
            self.resolved_id,
            requests,
            received,
            dict(man.files),
            man.save_token,
            rank,
            lacks,
            shared,
            self._raw_md,
        )

    def _exchange(
        self,
        storage: dict,
        groups: dict,
        recv_from: dict[int, list],
        send_to: dict[int, list],
        staged: dict,
        served_ok: bool,
    ) -> None:
        """Serve and receive items between nodes (see :mod:`tierckpt.peers`): what this rank serves
        was read and verified into ``staged`` (``served_ok``: without an error); every received
        item is verified again; an item that arrives damaged is read from a shared tier when one
        holds it, else the load fails. Items this rank serves and reads too are delivered from
        ``staged``."""
        assert self._peers is not None and self.resolved_id is not None
        cid = self.resolved_id

        def flat(idx: list) -> torch.Tensor:
            return unfilled((sum(storage[i].length for i in idx),), torch.uint8)

        recv_bufs = {p: flat(idx) for p, idx in recv_from.items()}
        send_bufs = {c: flat(idx) for c, idx in send_to.items()}
        unique = list(staged)
        for c, idx in send_to.items():
            mv, at = memoryview(send_bufs[c].numpy()), 0
            for i in idx:
                n = storage[i].length
                mv[at : at + n] = staged[i]
                at += n
        self._peers.exchange(send_bufs, recv_bufs)
        if served_ok:  # else the caller raises the read's error
            incoming = {j for idx in recv_from.values() for j in idx}
            for i in unique:
                if i in groups and i not in incoming:
                    it = groups[i]
                    dst = buffer_for(it)
                    dst[:] = staged[i]
                    if self.fill is not None:
                        self.fill.received(storage[i], dst)
                    deliver(it, self.allow_pickle, self.resolved_id, self._passed)
        damaged: list[Request] = []
        for p, idx in recv_from.items():
            mv, at = memoryview(recv_bufs[p].numpy()), 0
            for i in idx:
                rec, it = storage[i], groups[i]
                data = mv[at : at + rec.length]
                at += rec.length
                dst = buffer_for(it)
                dst[:] = data
                if item_intact(rec, dst, b"\0" * (_padded(rec.length) - rec.length), self.chunk_size):
                    if self.fill is not None:
                        self.fill.received(rec, dst)
                    deliver(it, self.allow_pickle, self.resolved_id, self._passed)
                    self.from_peers[rec.file] = self.from_peers.get(rec.file, 0) + rec.length
                    continue
                log.error(
                    "checkpoint %s: item %r from rank %d (data file %s) failed its checksum", cid, i.fqn, p, rec.file
                )
                damaged.append(
                    Request(
                        rec,
                        dst,
                        f"item {i.fqn!r}",
                        done=functools.partial(_done, it, self.allow_pickle, self.resolved_id, self._passed),
                    )
                )
        if damaged:
            shared = [t for t in self._holding if not t.node_local]
            if not shared:
                raise ChecksumMismatch(
                    f"checkpoint {cid}: {len(damaged)} item(s) received from other nodes failed "
                    f"their checksum (first: {damaged[0].what} of {damaged[0].rec.file}) and no "
                    "shared tier holds a copy"
                )
            Readback(cid, shared, self.chunk_size, threads=self.threads).read(damaged)


def _done(it: Item, allow_pickle: bool, checkpoint_id: str | None, passed: set[bytes], r: Request) -> None:
    """The engine verified the item (on a worker thread): copy it out, free its scratch buffer."""
    deliver(it, allow_pickle, checkpoint_id, passed)
    r.buf = memoryview(b"")
