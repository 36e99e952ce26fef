"""``TieredWriter``: the DCP ``StorageWriter`` that checkpoints lazily through the tiers.

DCP calls, on every rank of the process group (``dcp.save``)::

    reset(checkpoint_id)            only when dcp.save got a checkpoint_id
    set_up_storage_writer(is_coordinator, rank=...)
    prepare_local_plan(plan)        every rank: adds its local root and requested id
    prepare_global_plan(plans)      coordinator: picks the id and save token, assigns files
                                    and one metadata writer per distinct local root
    write_data(plan, planner)       every rank: lays out its file, enqueues the capture, returns
                                    at once with the planned WriteResults (a done future)
    finish(metadata, results)       coordinator: hands DCP's metadata to the commit thread

So ``dcp.save`` returns once the copies are enqueued. ``wait_captured()`` (or the optimizer
pre-step hook installed by :meth:`TieredWriter.attach`) blocks until the state has been copied
to host memory; ``wait()`` until it is committed on every configured tier.

Without ``checkpoint_id`` DCP does not call ``reset``: the coordinator then generates an id
(``ckpt-<UTC time>-<n>``) and logs it; a previous save's id is never reused.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from .capture.copier import Source
from .catalog import is_committed
from .config import TierConfig, load_config
from .errors import CommitConflict, CorruptCheckpoint, TierckptError
from .layout import ALIGN, ItemRecord, check_checkpoint_id, rank_file, step_of
from .pipeline import Engine, RankAssign, RankSave, SaveStats, get_engine

__all__ = ["TieredWriter"]

log = logging.getLogger("tierckpt")

_gen_lock = threading.Lock()
_gen_count = 0


@dataclass
class _LocalInfo:
    """Rank -> coordinator, inside the local SavePlan."""

    root: str
    requested_id: str | None
    committed_here: bool


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _generate_id() -> str:
    global _gen_count
    with _gen_lock:
        _gen_count += 1
        n = _gen_count
    return time.strftime("ckpt-%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{n:04d}"


class TieredWriter(StorageWriter):
    """DCP storage writer for tierckpt. See the module docstring for the call sequence.

    Args:
        config: a :class:`~tierckpt.config.TierConfig`, a path to a TOML file, or ``None`` to
            read ``$TIERCKPT_CONFIG``.
    """

    def __init__(self, config: TierConfig | str | None = None) -> None:
        super().__init__()
        self.cfg = config if isinstance(config, TierConfig) else load_config(config)
        self.engine: Engine = get_engine(self.cfg)
        self.checkpoint_id: str | None = None
        self._is_coordinator = False
        self._rank = 0
        self._distributed = False
        # Per DCP call sequence: dcp.async_save runs each save on its own thread, and two may
        # overlap on one writer, so the save in progress is tracked per thread.
        self._tls = threading.local()
        self._last: RankSave | None = None
        self._async_tickets: list[Future] = []

    # -- DCP StorageWriter ----------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        """DCP passes the id of the save about to start (only when ``dcp.save`` got one)."""
        cid = None if checkpoint_id is None else check_checkpoint_id(str(checkpoint_id))
        self._tls.requested = cid
        self.checkpoint_id = cid

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._tls.t0 = time.perf_counter()
        if kwargs.get("use_collectives") is False:
            raise TierckptError("TieredWriter needs dcp.save(..., use_collectives=True) (the default)")
        self._is_coordinator = is_coordinator
        self._distributed = dist.is_available() and dist.is_initialized()
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if self._distributed else 0
        self._rank = int(rank)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=None)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # The id given to reset() is used by this save only: a later save without checkpoint_id
        # must get a fresh id, never the previous one.
        requested = getattr(self._tls, "requested", None)
        self._tls.requested = None
        root = ""
        committed = False
        if self.engine.local is not None:
            root = str(self.engine.local.root.resolve())
            if requested is not None:
                committed = is_committed(self.engine.local, requested)
        return dataclasses.replace(plan, storage_data=_LocalInfo(root, requested, committed))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        infos: list[_LocalInfo] = [p.storage_data for p in plans]
        ids = {i.requested_id for i in infos}
        if len(ids) != 1:
            raise TierckptError(f"ranks passed different checkpoint ids to dcp.save: {sorted(map(str, ids))}")
        cid = ids.pop()
        if cid is None:
            cid = _generate_id()
            log.warning("dcp.save was called without checkpoint_id: saving as %r", cid)
        for r, i in enumerate(infos):
            if i.committed_here:
                raise CommitConflict(f"checkpoint {cid} is already committed at {i.root} (rank {r}); "
                                     "use a new checkpoint_id (ids are never overwritten)")
        if self.engine.local is None and self.engine.cfg.s3 is not None and is_committed(self.engine.s3_tier(), cid):
            raise CommitConflict(f"checkpoint {cid} is already committed at {self.engine.s3_tier().url}")
        token = uuid.uuid4().hex
        first_rank_of_root: dict[str, int] = {}
        for r, i in enumerate(infos):
            first_rank_of_root.setdefault(i.root, r)
        created = time.time()
        out = []
        for r, (p, i) in enumerate(zip(plans, infos)):
            assign = RankAssign(
                checkpoint_id=cid, token=token, rank=r, world=len(plans), file=rank_file(r, token),
                meta_writer_rank=first_rank_of_root[i.root], distributed=self._distributed,
                created=created, step=step_of(cid),
            )
            out.append(dataclasses.replace(p, storage_data=assign))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "torch.futures.Future[list[WriteResult]]":
        assign: RankAssign = plan.storage_data
        if self._distributed and assign.rank != self._rank:
            raise TierckptError(f"rank mismatch: plan for rank {assign.rank} arrived on rank {self._rank}")
        self.checkpoint_id = assign.checkpoint_id
        sources: list[Source] = []
        results: list[WriteResult] = []
        pos = 0
        file = assign.file
        for i, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                raw = bytes(data.getbuffer() if isinstance(data, io.BytesIO) else data)
                n = len(raw)
                if n:
                    sources.append(Source(item=i, fqn=fqn, pos=pos, length=n, data=memoryview(raw)))
                rec = ItemRecord(file=file, pos=pos, length=n)
            else:
                t = data if isinstance(data, torch.Tensor) else torch.as_tensor(data)
                guard: torch.Tensor | None = t
                if not t.is_contiguous():
                    t = t.contiguous()  # a private snapshot: nothing can tear it
                    guard = None
                n = t.numel() * t.element_size()
                if n:
                    sources.append(Source(item=i, fqn=fqn, pos=pos, length=n, tensor=t, guard=guard,
                                          version=guard._version if guard is not None else 0))
                rec = ItemRecord(file=file, pos=pos, length=n, dtype=_dtype_name(t.dtype), shape=tuple(t.shape))
            pos += n + (-n) % ALIGN
            results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=rec))
        size = pos
        job = RankSave(assign, sources, size, results, self.engine.chunk_size)
        self._tls.job = job
        self._last = job
        job.owner = weakref.ref(self)
        self.engine.submit(job)
        job.stats.save_blocked_s = time.perf_counter() - self._tls.t0
        for t in self._async_tickets:
            if not t.done():
                t.set_result(job)
        self._async_tickets.clear()
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        job = getattr(self._tls, "job", None)
        if job is None:
            raise TierckptError("finish() called before write_data() on this thread")
        self._tls.job = None
        job.global_md.set_result((metadata, results))
        job.stats.save_blocked_s = time.perf_counter() - self._tls.t0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            check_checkpoint_id(str(checkpoint_id))
            return True
        except CorruptCheckpoint:
            return False

    # -- async_save support (AsyncStager protocol) -----------------------------------------
    _synchronize_after_execute: bool = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict) -> dict:
        """``dcp.async_save`` hook: no copy here; the capture happens lazily in ``write_data``.

        The returned state dict is the live one, so the same memory bound holds as for
        ``dcp.save``. Until DCP's save thread reaches ``write_data``, ``wait_captured()`` waits
        for it too (a ticket), so the pre-step hook stays safe.
        """
        ticket: Future = Future()
        self._async_tickets.append(ticket)
        self._ticket_watch(ticket)
        return state_dict

    def synchronize_staging(self) -> None:
        self.wait_captured()

    def close(self) -> None:
        """AsyncStager protocol: nothing to release per writer (pool and threads are shared)."""

    def _ticket_watch(self, ticket: Future) -> None:
        def watch() -> None:
            # DCP runs the save in a thread named AsyncCheckpointExecutor*; if it ends before
            # write_data, the save failed in planning and DCP's future holds the error.
            while not ticket.done():
                time.sleep(0.01)
                alive = any(t.name.startswith("AsyncCheckpointExecutor") for t in threading.enumerate())
                if not alive and not ticket.done():
                    time.sleep(0.05)
                    if not ticket.done():
                        ticket.set_result(None)
        threading.Thread(target=watch, name="tierckpt-async-ticket", daemon=True).start()

    # -- the user's side ------------------------------------------------------------------
    def wait_captured(self) -> float:
        """Block until every checkpoint in flight has landed in host memory; raise background errors.

        Returns the seconds spent blocked. After it returns, the state may be mutated.
        """
        t0 = time.perf_counter()
        for t in list(self._async_tickets):
            t.result()
        return self.engine.wait_captured(owner=self) + (time.perf_counter() - t0)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every checkpoint in flight is committed on every configured tier.

        Raises the first background error (capture, flush, commit or promotion) not yet raised
        of this writer's saves, or of saves whose writer no longer exists.
        """
        self.wait_captured()
        self.engine.wait(timeout, owner=self)

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Register a step pre-hook on ``optimizer`` that waits for the capture in flight.

        The hook never waits for flush, commit or promotion, and never raises: a background
        error is logged at once and raised by the next :meth:`wait`. Returns the hook handle.
        """
        engine = self.engine
        tickets = self._async_tickets

        def _pre_step(opt: Any, args: Any, kwargs: Any) -> None:
            for t in list(tickets):
                t.result()
            engine.wait_captured(raise_errors=False)

        return optimizer.register_step_pre_hook(_pre_step)

    @property
    def last(self) -> RankSave | None:
        """The last save through this writer on this rank: its futures ``captured``, ``durable``,
        ``committed``, ``promoted`` and its ``stats``."""
        return self._last

    @property
    def stats(self) -> SaveStats | None:
        """Figures of the last checkpoint this writer saved (this rank)."""
        return self._last.stats if self._last is not None else None

    @property
    def history(self) -> list[SaveStats]:
        """Figures of every checkpoint saved through this process's engine for this config."""
        return list(self.engine.history)
