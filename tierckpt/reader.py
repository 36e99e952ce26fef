"""``TieredReader``: the DCP ``StorageReader`` that loads from the fastest tier holding a committed copy.

DCP calls (``dcp.load``)::

    reset(checkpoint_id)                     every rank (``"latest"`` or an explicit id)
    read_metadata()                          coordinator (broadcast by DCP), or every rank with no_dist
    set_up_storage_reader(metadata, is_coordinator)   every rank: learns the resolved id and
                                             which tiers hold a committed copy *here*
    prepare_local_plan / prepare_global_plan unchanged
    read_data(plan, planner)                 every rank: coalesced, parallel, verified reads

For each data file the reader uses the local tier if this node holds a committed copy of the
checkpoint and the file, else S3. Items of one file are read in offset order, adjacent ones
merged into one scatter read (straight into the destination tensor when it is a contiguous CPU
tensor of the saved dtype and shape), several runs in parallel. Every item's CRC32C pieces are
checked; on a mismatch the item is read again from the next tier holding it, and the reader
logs which tier served what. Non-tensor items are unpickled with ``weights_only=True`` unless
``allow_pickle=True``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from . import lease as leases
from .catalog import find_latest, read_checkpoint_metadata
from .config import TierConfig, load_config
from .errors import CheckpointNotFound, ChecksumMismatch, CorruptCheckpoint, TierckptError
from .layout import DTYPES, ItemRecord, check_checkpoint_id, data_key, item_intact, metadata_key, padded
from .tiers import make_tiers
from .tiers.base import Tier

__all__ = ["TieredReader", "open_tiers", "read_checkpoint_metadata"]

log = logging.getLogger("tierckpt")

MAX_RUN = 16 << 20  # bytes per merged read: small enough to keep every reader thread busy
MAX_GAP = 256 << 10  # merge items separated by at most this many bytes


def open_tiers(cfg: TierConfig) -> list[Tier]:
    """The configured tiers, fastest first (local, then S3)."""
    return make_tiers(cfg)


@dataclass
class _Item:
    index: MetadataIndex
    rec: ItemRecord
    reads: list[ReadItem]
    direct: torch.Tensor | None = None  # destination read into directly
    targets: list[torch.Tensor] = field(default_factory=list)
    scratch: torch.Tensor | None = None
    data: bytes | None = None
    pad: bytearray = field(default_factory=bytearray)


class TieredReader(StorageReader):
    """DCP storage reader for tierckpt.

    Args:
        config: a :class:`~tierckpt.config.TierConfig`, a TOML path, or ``None`` for ``$TIERCKPT_CONFIG``.
        allow_pickle: unpickle non-tensor items without ``weights_only`` (only for checkpoints you trust).
        threads: parallel reads (default: ``[local] flush_threads`` or ``[s3] concurrency``).
    """

    def __init__(self, config: TierConfig | str | None = None, *, allow_pickle: bool = False, threads: int | None = None) -> None:
        super().__init__()
        self.cfg = config if isinstance(config, TierConfig) else load_config(config)
        self.tiers = open_tiers(self.cfg)
        self.allow_pickle = allow_pickle
        default_threads = self.cfg.local.flush_threads if self.cfg.local else (self.cfg.s3.concurrency if self.cfg.s3 else 4)
        self.threads = max(1, threads or default_threads)
        self.checkpoint_id: str = "latest"
        self.resolved_id: str | None = None
        self.metadata: Metadata | None = None
        self.chunk_size = 0
        self._holding: list[Tier] = []
        self._leases: list[leases.Lease] = []
        self.served: dict[str, str] = {}  # file -> tier name that served it (last read)
        self._lock = threading.Lock()

    # -- DCP StorageReader ----------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        cid = "latest" if checkpoint_id is None else str(checkpoint_id)
        if cid != "latest":
            check_checkpoint_id(cid)
        self.checkpoint_id = cid
        self.resolved_id = None
        self.metadata = None
        self.release()

    def release(self) -> None:
        """Give up the leases this reader holds (done at the end of ``read_data``; idempotent)."""
        for lease in self._leases:
            lease.release()
        self._leases = []

    def resolve(self) -> str:
        """The concrete id to load: ``latest`` is the newest committed checkpoint over all tiers,
        in commit order, whose metadata is valid and whose data a tier can serve (anything newer
        that fails is logged and skipped; see :func:`tierckpt.catalog.find_latest`)."""
        if self.checkpoint_id != "latest":
            return self.checkpoint_id
        return find_latest(self.tiers).checkpoint_id

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        cid = self.resolve()
        errors = []
        for tier in self.tiers:
            try:
                md, man = read_checkpoint_metadata(tier, cid)
            except CheckpointNotFound:
                continue
            except CorruptCheckpoint as e:
                errors.append(str(e))
                log.error("%s; trying the next tier", e)
                continue
            md.storage_meta = StorageMeta(checkpoint_id=cid, save_id=man.save_token, load_id=None, modules=[])
            for rec in (md.storage_data or {}).values():
                rec.chunk_size = man.chunk_size  # type: ignore[attr-defined]
            self.resolved_id = cid
            self.metadata = md
            return md
        if errors:
            raise CorruptCheckpoint(f"checkpoint {cid}: no tier holds valid metadata: " + "; ".join(errors))
        raise CheckpointNotFound(f"checkpoint {cid} is not committed on any tier: " + ", ".join(t.url for t in self.tiers))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata
        sm = metadata.storage_meta
        if sm is None or not sm.checkpoint_id:
            raise CorruptCheckpoint("metadata without a checkpoint id: was it read by TieredReader?")
        self.resolved_id = str(sm.checkpoint_id)
        recs = list((metadata.storage_data or {}).values())
        self.chunk_size = getattr(recs[0], "chunk_size", 0) if recs else 0
        self._holding = []
        self._file_tier: dict[str, Tier] = {}  # where each data file is read from (one lookup per file)
        self.release()
        gone = []
        for tier in self.tiers:
            try:
                if not tier.exists(metadata_key(self.resolved_id)):
                    continue
                # A lease keeps retention and gc (in any process) away until read_data is done.
                self._leases.append(leases.acquire(tier, self.resolved_id, purpose="load"))
                self._holding.append(tier)
            except CheckpointNotFound as e:
                gone.append(str(e))
                log.warning("%s", e)
            except TierckptError as e:
                log.warning("tier %s unreachable while loading %s: %s", tier.url, self.resolved_id, e)
        if not self._holding:
            raise CheckpointNotFound(f"checkpoint {self.resolved_id}: no tier reachable from this rank holds a committed copy"
                                     + (f" ({'; '.join(gone)})" if gone else ""))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=self.resolved_id)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: every rank must have resolved the same checkpoint (``latest`` may race a commit)."""
        ids = [p.storage_data for p in plans]
        if len(set(ids)) > 1:
            by_id: dict[str, list[int]] = {}
            for r, i in enumerate(ids):
                by_id.setdefault(str(i), []).append(r)
            raise TierckptError("ranks resolved different checkpoints: "
                                + "; ".join(f"{i} on ranks {rs}" for i, rs in by_id.items())
                                + " (a commit raced the load, or a node's local tier is behind S3): pass an explicit checkpoint_id")
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return str(checkpoint_id) == "latest" or TieredWriterIdCheck(str(checkpoint_id))

    # -- reading --------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "torch.futures.Future[None]":
        assert self.metadata is not None and self.resolved_id is not None
        storage: dict[MetadataIndex, ItemRecord] = self.metadata.storage_data
        groups: dict[MetadataIndex, _Item] = {}
        for ri in plan.items:
            rec = storage.get(ri.storage_index)
            if rec is None:
                raise CorruptCheckpoint(f"checkpoint {self.resolved_id}: no stored item for {ri.storage_index.fqn!r}")
            g = groups.get(ri.storage_index)
            if g is None:
                g = groups[ri.storage_index] = _Item(ri.storage_index, rec, [])
            g.reads.append(ri)
        items = list(groups.values())
        for it in items:  # resolve destinations on the calling thread
            if it.rec.is_tensor:
                it.targets = [planner.resolve_tensor(ri) for ri in it.reads]
                if len(it.reads) == 1 and _is_whole(it.reads[0], it.rec) and _direct_ok(it.targets[0], it.rec):
                    it.direct = it.targets[0]
        runs = _runs([it for it in items if it.rec.length])  # empty items have no bytes to read
        for it in items:
            if not it.rec.length:
                if it.rec.is_tensor:
                    it.scratch = torch.empty(0, dtype=torch.uint8)
                else:
                    it.data = b""
                self._deliver(it)
        try:
            with ThreadPoolExecutor(max_workers=min(self.threads, max(1, len(runs))), thread_name_prefix="tierckpt-read") as ex:
                for f in [ex.submit(self._read_run, run) for run in runs]:
                    f.result()
        finally:
            self.release()
        for it in items:  # deliver on the calling thread
            if it.rec.is_tensor:
                for ri, t in zip(it.reads, it.targets):
                    planner.commit_tensor(ri, t)
            else:
                for ri in it.reads:
                    planner.load_bytes(ri, io.BytesIO(it.data))
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    def _buffer(self, it: _Item) -> memoryview:
        if it.direct is not None:
            return _bytes_view(it.direct)
        if not it.rec.is_tensor:
            it.data = bytearray(it.rec.length)  # type: ignore[assignment]
            return memoryview(it.data)  # type: ignore[arg-type]
        it.scratch = torch.empty(it.rec.length, dtype=torch.uint8)
        return memoryview(it.scratch.numpy())

    def _read_run(self, run: list[_Item]) -> None:
        file = run[0].rec.file
        key = data_key(self.resolved_id, file)
        start = run[0].rec.pos
        bufs: list[memoryview] = []
        at = start
        for it in run:
            if it.rec.pos > at:
                bufs.append(memoryview(bytearray(it.rec.pos - at)))
            bufs.append(self._buffer(it))
            it.pad = bytearray(padded(it.rec.length) - it.rec.length)
            if it.pad:
                bufs.append(memoryview(it.pad))
            at = it.rec.pos + padded(it.rec.length)
        tier = self._tier_for(file)
        read_err: BaseException | None = None
        try:
            tier.read_ranges(key, start, bufs)
            bad = [it for it in run if not self._verify(it)]
        except (CorruptCheckpoint, CheckpointNotFound, OSError) as e:
            log.error("checkpoint %s: reading %s from %s failed: %s", self.resolved_id, file, tier.name, e)
            read_err = e
            bad = list(run)
        else:
            with self._lock:
                self.served[file] = tier.name
        for it in bad:
            self._recover(it, failed=tier, read_err=read_err)
        for it in run:
            self._deliver(it)

    def _tier_for(self, file: str) -> Tier:
        with self._lock:
            tier = self._file_tier.get(file)
        if tier is not None:
            return tier
        for tier in self._holding:
            if tier.exists(data_key(self.resolved_id, file)):
                with self._lock:
                    self._file_tier[file] = tier
                return tier
        raise CheckpointNotFound(f"checkpoint {self.resolved_id}: data file {file} is on no reachable tier "
                                 f"({', '.join(t.url for t in self._holding)})")

    def _verify(self, it: _Item) -> bool:
        """Check every CRC piece of the item's bytes followed by its padding."""
        return item_intact(it.rec, self._bufview(it), memoryview(it.pad), self.chunk_size)

    def _bufview(self, it: _Item) -> memoryview:
        if it.direct is not None:
            return _bytes_view(it.direct)
        if it.scratch is not None:
            return memoryview(it.scratch.numpy())
        return memoryview(it.data)  # type: ignore[arg-type]

    def _recover(self, it: _Item, failed: Tier, read_err: BaseException | None) -> None:
        """Serve one item after its merged read failed (``read_err``) or its checksum did not match.

        Tries the other tiers holding the checkpoint; after a read error also the same tier, item
        by item (a truncated file still serves the items before the cut). Raises naming the
        checkpoint, file, item and writing rank, with the real cause.
        """
        file = it.rec.file
        key = data_key(self.resolved_id, file)
        candidates = [t for t in self._holding if t is not failed] + ([failed] if read_err is not None else [])
        last_err = read_err
        for tier in candidates:
            try:
                tier.read_ranges(key, it.rec.pos, [self._bufview(it)] + ([memoryview(it.pad)] if it.pad else []))
            except (CorruptCheckpoint, CheckpointNotFound, OSError) as e:
                log.error("checkpoint %s: %s from %s also failed: %s", self.resolved_id, file, tier.name, e)
                last_err = e
                continue
            if self._verify(it):
                if tier is not failed:
                    log.warning("checkpoint %s: item %r of %s failed on %s; served from %s",
                                self.resolved_id, it.index.fqn, file, failed.name, tier.name)
                return
            last_err = None
        where = f"item {it.index.fqn!r} (offset {list(it.index.offset or [])}) in {file} (written by rank {_writer_rank(file)})"
        if isinstance(last_err, CheckpointNotFound):
            gone = [t.url for t in self._holding if not _committed(t, self.resolved_id)]
            if gone:
                raise CheckpointNotFound(f"checkpoint {self.resolved_id} was deleted from {', '.join(gone)} while it was "
                                         f"being read (by a process that ignores leases?): cannot read {where}")
        if last_err is not None:
            raise CorruptCheckpoint(f"checkpoint {self.resolved_id}: cannot read {where}: {last_err}")
        raise ChecksumMismatch(
            f"checkpoint {self.resolved_id}: {where} failed its CRC32C check on {failed.url}"
            + ("" if len(self._holding) < 2 else " and on every other tier")
        )

    def _deliver(self, it: _Item) -> None:
        rec = it.rec
        if not rec.is_tensor:
            data = bytes(it.data)  # type: ignore[arg-type]
            if not self.allow_pickle:
                try:
                    torch.load(io.BytesIO(data), weights_only=True)
                except Exception as e:  # noqa: BLE001 - any unpickling failure means: refuse
                    raise CorruptCheckpoint(
                        f"checkpoint {self.resolved_id}: non-tensor item {it.index.fqn!r} cannot be loaded with "
                        f"weights_only=True ({type(e).__name__}); pass TieredReader(..., allow_pickle=True) "
                        "only if you trust this checkpoint"
                    ) from None
            it.data = data
            return
        if it.direct is not None:
            return
        assert it.scratch is not None
        src = it.scratch.view(DTYPES[rec.dtype]).reshape(rec.shape)
        for ri, target in zip(it.reads, it.targets):
            view = src
            for dim, (off, ln) in enumerate(zip(ri.storage_offsets, ri.lengths)):
                view = view.narrow(dim, off, ln)
            if target.shape != view.shape:
                raise CorruptCheckpoint(f"checkpoint {self.resolved_id}: {it.index.fqn!r}: stored shape {list(view.shape)} "
                                        f"does not fit the destination {list(target.shape)}")
            target.copy_(view)
        it.scratch = None


def _committed(tier: Tier, cid: str) -> bool:
    try:
        return tier.exists(metadata_key(cid))
    except TierckptError:
        return True


def TieredWriterIdCheck(cid: str) -> bool:
    try:
        check_checkpoint_id(cid)
        return True
    except CorruptCheckpoint:
        return False


def _writer_rank(file: str) -> str:
    try:
        return str(int(file.split("-")[1].split(".")[0]))
    except (IndexError, ValueError):
        return "?"


def _is_whole(ri: ReadItem, rec: ItemRecord) -> bool:
    return all(o == 0 for o in ri.storage_offsets) and tuple(ri.lengths) == tuple(rec.shape)


def _direct_ok(t: torch.Tensor, rec: ItemRecord) -> bool:
    return (t.device.type == "cpu" and t.is_contiguous() and str(t.dtype).removeprefix("torch.") == rec.dtype
            and tuple(t.shape) == tuple(rec.shape) and t.numel() * t.element_size() == rec.length and rec.length > 0)


def _bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _as_numpy(mv: memoryview):
    import numpy as np

    return np.frombuffer(mv, dtype=np.uint8)


def _runs(items: list[_Item]) -> list[list[_Item]]:
    """Group items into merged reads: same file, offset order, small gaps, bounded size."""
    by_file: dict[str, list[_Item]] = {}
    for it in items:
        by_file.setdefault(it.rec.file, []).append(it)
    runs: list[list[_Item]] = []
    for file_items in by_file.values():
        file_items.sort(key=lambda i: i.rec.pos)
        cur: list[_Item] = []
        for it in file_items:
            if cur:
                end = cur[-1].rec.pos + padded(cur[-1].rec.length)
                if it.rec.pos - end > MAX_GAP or it.rec.pos + it.rec.length - cur[0].rec.pos > MAX_RUN or it.rec.pos < end:
                    runs.append(cur)
                    cur = []
            cur.append(it)
        if cur:
            runs.append(cur)
    runs.sort(key=lambda r: -sum(i.rec.length for i in r))
    return runs


_ = LoadItemType
