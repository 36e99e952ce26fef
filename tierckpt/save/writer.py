"""``TieredWriter``: the DCP ``StorageWriter`` that checkpoints lazily through the tiers.

DCP calls, on every rank of the process group (``dcp.save``)::

    reset(checkpoint_id)            only when dcp.save got a checkpoint_id
    set_up_storage_writer(is_coordinator, rank=...)
    prepare_local_plan(plan)        every rank: adds its local root and requested id
    prepare_global_plan(plans)      coordinator: picks the id and save token, assigns files
                                    and one metadata writer per distinct local root
    write_data(plan, planner)       every rank: lays out its file, enqueues the capture, returns
                                    at once with the write results (a done future)
    finish(metadata, results)       coordinator: hands DCP's metadata to the commit thread

So ``dcp.save`` returns once the copies are enqueued. ``wait_captured()`` (or the optimizer
pre-step hook installed by :meth:`TieredWriter.attach`) blocks until the state has been copied
to host memory; ``wait()`` until it is committed on every configured tier.

Without ``checkpoint_id`` DCP does not call ``reset``: the coordinator then generates an id
(``ckpt-<UTC time>-<n>``) and logs it; a previous save's id is never reused.

**Plan caching.** With ``DefaultSavePlanner(enable_plan_caching=True)``, what DCP's cached plans
leave out (rank info, the coordinator's decision) goes over the plan channel
(:mod:`tierckpt.planchannel`); each save still gets its own id, token and file names. Layouts,
chunk and checksum plans and write results come from :mod:`tierckpt.planning`'s cache while the
tensors match them. One process group per process saves through tierckpt with plan caching.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from ..capture.planning import SaveInputs, layout_cache
from ..capture.ranksave import RankSave, SaveStats
from ..catalog.checkpoints import checkpoint_id_of
from ..chain.commit import default_channel
from ..chain.engine import Engine, get_engine
from ..chain.peers import PeerGroup
from ..config import TierConfig, load_config
from ..errors import InvalidCheckpointId, TierckptError
from ..format.layout import check_checkpoint_id
from ..tiers.base import Tier
from . import plancache, preempt
from .assign import SaveCtx, SavePlanning, global_rank
from .asyncsave import AsyncTickets, LiveState
from .hold import HOLD_TIMEOUT, Release, hold, release, release_all
from .planchannel import LocalInfo, PlanAssign, session
from .preflight import check_tiers
from .results import results_worker

__all__ = ["TieredWriter"]

log = logging.getLogger("tierckpt")

# The plan-channel state and types under their former names here (tests/plan_scenarios.py reads them).
_session, _PlanAssign, _LocalInfo = session, PlanAssign, LocalInfo

_warned_stale: weakref.WeakSet = weakref.WeakSet()  # layouts whose stale plan dtypes were reported


_persisters: dict[str, plancache.Persister] = {}
_persisters_lock = threading.Lock()


def _persister(tier: Any) -> plancache.Persister:
    with _persisters_lock:
        p = _persisters.get(tier.url)
        if p is None:
            p = _persisters[tier.url] = plancache.Persister(tier)
        return p


class TieredWriter(SavePlanning, StorageWriter):
    """DCP storage writer for tierckpt. See the module docstring for the call sequence.

    Args:
        config: a :class:`~tierckpt.config.TierConfig`, a path to a TOML file, or ``None`` to
            read ``$TIERCKPT_CONFIG``.
        no_dist: every save through this writer is a one-process save (pass
            ``dcp.save(..., no_dist=True)`` too), also while a process group exists: the state
            one rank holds whole, saved by that rank alone (Lightning's DDP checkpoints, rank 0).
            Such saves coordinate with no other rank (DCP gives the writer no way to tell).

    **Checkpoint ids** may be paths, as frameworks pass them (``<dump>/checkpoint/step-100``,
    ``os.PathLike``): the last component is the id (:func:`tierckpt.checkpoints.checkpoint_id_of`).

    **Checks and failures.** Creating a writer checks every tier once per configuration and
    process (:mod:`tierckpt.save.preflight`): an unwritable ``[local] path``, a missing bucket or
    refused credentials raise here; an S3 that does not answer is a WARNING. A checkpoint that
    could not be committed on the first tier (committed nowhere) is raised by the next
    ``dcp.save`` through this configuration (and by ``wait_captured()``/``wait()``); a copy to a
    later tier that failed is logged at WARNING once per checkpoint, stays owed, and is reported by
    :meth:`wait` (``wait(tiers="first")`` ends a job without it).

    **Preemption.** Created on the main thread, the first writer installs tierckpt's SIGTERM
    handler (``[job] on_sigterm``): a SIGTERM commits what is in flight before the process goes
    (see :mod:`tierckpt.preempt`).

    **Other processes.** A writer pickles as its configuration (DCP's
    ``AsyncCheckpointerType.PROCESS`` sends it to its checkpoint process). The copy is *detached*:
    nobody will call its ``wait()``, so each of its saves starts the capture at once and
    ``dcp.save`` returns (on the coordinator, ``finish`` blocks) only once the checkpoint is
    committed on every configured tier, raising its failure otherwise: the future DCP hands the
    training process completes only then.
    """

    def __init__(self, config: TierConfig | str | None = None, *, no_dist: bool = False) -> None:
        super().__init__()
        self.cfg = config if isinstance(config, TierConfig) else load_config(config)
        self.no_dist = no_dist
        self._detached = False  # an unpickled copy, saving in another process (see the class docstring)
        self._closed = False
        self.engine: Engine = get_engine(self.cfg)
        check_tiers(self.engine)  # a tier that cannot work fails here, not hours later (see preflight)
        self.checkpoint_id: str | None = None
        self._rank = 0
        self._distributed = False
        first = self.engine.first_tier
        # A first tier listed cheaply (a local disk) is checked by every rank and holds the plan cache.
        self._local: Tier | None = first if first.cheap_listing else None
        self._root = self._local.root_id() if self._local is not None else ""
        self._layouts = layout_cache(self.engine.chunk_size)
        self._persister: plancache.Persister | None = None
        if self._local is not None and plancache.dcp_caches() is not None:
            self._persister = _persister(self._local)
            if not plancache.status().attempted:  # a restarted job: read the plans this rank persisted
                plancache.preload(self._local, global_rank())
        # Per DCP call sequence: dcp.async_save runs each save on its own thread, and two may
        # overlap on one writer, so the save in progress is tracked per thread.
        self._tls = threading.local()
        self._last: RankSave | None = None
        self._tickets = AsyncTickets()  # dcp.async_save saves not planned yet (see asyncsave)
        preempt.install(self.cfg, self)  # SIGTERM drains what is in flight ([job] on_sigterm; main thread only)

    def __reduce__(self) -> tuple:
        """Pickled as its configuration; the copy is detached (see the class docstring)."""
        return (_detached_writer, (self.cfg, self.no_dist))

    # -- DCP StorageWriter ----------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        """DCP passes the id of the save about to start (only when ``dcp.save`` got one)."""
        ctx = self._tls.ctx = SaveCtx()
        self._tickets.bind(ctx)
        cid = None if checkpoint_id is None else check_checkpoint_id(checkpoint_id_of(checkpoint_id))
        ctx.requested = cid
        ctx.from_reset = True
        self.checkpoint_id = cid

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        ctx = self._ctx()
        if not ctx.from_reset:  # no reset() before this save: a fresh context (no requested id)
            ctx = self._tls.ctx = SaveCtx()
        self._tickets.bind(ctx)
        ctx.from_reset = False
        ctx.t0 = time.perf_counter()
        if kwargs.get("use_collectives") is False:
            raise TierckptError("TieredWriter needs dcp.save(..., use_collectives=True) (the default)")
        ctx.is_coordinator = is_coordinator
        # A checkpoint committed nowhere since the last save: raised here, on every rank through
        # DCP's plan exchange, so training does not go on for hours saving nothing. Failed copies
        # to later tiers are not raised (see the class docstring).
        self.engine.raise_errors(owner=self, tiers=())
        self._distributed = not self.no_dist and dist.is_available() and dist.is_initialized()
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if self._distributed else 0
        ctx.rank = self._rank = int(rank)
        if self._distributed and self.cfg.peer.replicas:  # the peer hop's group, made by every rank here
            PeerGroup.for_saves(self.cfg, self.cfg.job.commit_timeout)
        if not plancache.status().attempted:
            self._seed_plans(is_coordinator)

    def _seed_plans(self, is_coordinator: bool) -> None:
        """First save of the process: put the plans persisted by the previous run of the job into
        DCP's plan cache if every rank agrees (see :mod:`tierckpt.plancache`)."""
        st = plancache.seed(
            self._local if self._persister is not None else None,
            default_channel(True) if self._distributed else None,
            distributed=self._distributed,
            is_coordinator=is_coordinator,
            global_rank=global_rank(),
            world=dist.get_world_size() if self._distributed else 1,
            timeout=min(plancache.AGREE_TIMEOUT, self.cfg.job.commit_timeout),
        )
        if st.seeded:
            log.info("reusing the plans persisted by the previous run (%s)", st.reason)
            if st.channel is not None:
                with session.lock:
                    session.channel = st.channel
        elif st.reason:
            log.debug("not reusing persisted plans: %s", st.reason)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=None)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        """Every rank: lay out this rank's file, enqueue the capture, and return at once with the
        write results (a completed future).

        Per item, this thread only resolves the item and reads its tensor's shape, dtype,
        contiguity and version counter; the layout, the chunk and checksum plans and the write
        results come from the cache when the plan and the tensors match an earlier save's
        (:mod:`tierckpt.planning`). Sources and pieces are built on the capture thread.
        """
        ctx = self._ctx()
        assign = self._assignment(plan, ctx)
        if self._distributed and assign.rank != ctx.rank:
            raise TierckptError(
                f"checkpoint {assign.checkpoint_id}: rank mismatch: plan for rank {assign.rank} "
                f"arrived on rank {ctx.rank}"
            )
        self.checkpoint_id = assign.checkpoint_id
        items = plan.items
        resolve = planner.resolve_data
        datas = [resolve(it) for it in items]
        inputs = SaveInputs.prepare(items, datas, self._layouts)
        if inputs.layout.props_stale and inputs.layout not in _warned_stale:
            # DCP's plan cache compares shapes, not dtypes: its cached plan and metadata outlived a
            # dtype change. The file and its records follow the tensors; the coordinator corrects
            # the dtypes in the metadata of every such save.
            _warned_stale.add(inputs.layout)
            log.warning(
                "checkpoint %s: rank %d: DCP's cached plan names other dtypes than the tensors have "
                "(a dtype changed under plan caching); the checkpoint records the tensors' dtypes",
                assign.checkpoint_id,
                ctx.rank,
            )
        results = inputs.results()
        job = RankSave(assign, inputs, self.engine.chunk_size)
        release_all(urgent=False)  # an earlier save still held: this process is past its dcp.save
        # A save on a thread of its own whose state this writer did not stage (dcp.async_save with
        # another stager, e.g. DCP's DefaultStager): that stager may reuse its buffers once DCP's
        # future completes, so this save returns only once captured (on DCP's thread, not the caller's).
        foreign = (
            not self._detached
            and threading.current_thread() is not threading.main_thread()
            and not self._tickets.bound_here()
        )
        # dcp.async_save staged by this writer, [job] async_future stronger than "accepted": the
        # capture starts at once and DCP's thread waits for it here (and, for "committed_local",
        # the coordinator waits in finish for the first-tier commit), so DCP's future means that.
        stronger = self.cfg.job.async_future != "accepted" and not self._detached and self._tickets.bound_here()
        if stronger:
            foreign = True
            job.await_commit = self.cfg.job.async_future == "committed_local"
        if not (self._detached or foreign):  # those start the capture at once (nothing to hold back for)
            job.hold = hold(assign, coordinator=ctx.own_assign is not None)
            job.hold_timeout = HOLD_TIMEOUT
        ctx.job = job
        self._last = job
        self._closed = False  # a save after close(): the next close() waits for it
        job.owner = weakref.ref(self)
        if self._persister is not None:
            snap = plancache.snapshot(planner, plan, assign.world, assign.rank, global_rank(), ctx.coord_global)
            if snap is not None:
                coordinator = ctx.own_assign is not None
                if coordinator:
                    plancache.add_coordinator(snap, ctx.members)
                self._persister.after_commit(job.committed, snap, coordinator)
        self.engine.submit(job)
        if foreign:
            try:
                job.captured.result()
            except BaseException:
                self.engine.raise_errors(owner=self)
                raise
        job.stats.save_blocked_s = time.perf_counter() - ctx.t0
        job.stats.phases.add("blocked_in_save", ctx.t0, replace=True)
        self._tickets.captured(job)
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: hand DCP's metadata and every rank's results to the commit (expanded into
        per-item records on a background thread, not here)."""
        ctx = self._ctx()
        job = ctx.job
        if job is None:
            raise TierckptError("finish() called before write_data() on this thread")
        ctx.job = None
        results_worker.submit(job, metadata, results)
        if self._detached:
            self._wait_committed(job)
        elif job.await_commit:
            self._wait_first_commit(job)
        elif len(results) > 1:
            metadata.storage_data = Release(job.assign.token)  # see savehold.Release
        else:
            release(job.assign.token)  # one rank: DCP broadcasts nothing (or to itself) after this
        job.stats.save_blocked_s = time.perf_counter() - ctx.t0
        job.stats.phases.add("blocked_in_save", ctx.t0, replace=True)

    def _wait_first_commit(self, job: RankSave) -> None:
        """``[job] async_future = "committed_local"``, coordinator, in ``finish`` (DCP's save thread):
        block until ``job`` is committed on the first tier, or raise its failure (DCP then fails
        the future on every rank)."""
        try:
            job.committed.result()
        except BaseException:
            self.engine.raise_errors(owner=self, tiers=())
            raise

    def _wait_committed(self, job: RankSave) -> None:
        """Detached writer, coordinator, in ``finish``: block until ``job`` is committed on every
        tier (its commit needs every rank's report, so every rank's part is done too), or raise
        its failure; DCP then fails the save on every rank."""
        try:
            job.replicated.result()
        except BaseException:
            self.engine.raise_errors(owner=self)
            raise
        self.engine.raise_errors(owner=self)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            check_checkpoint_id(checkpoint_id_of(checkpoint_id))
            return True
        except InvalidCheckpointId:
            return False

    # -- async_save support (AsyncStager protocol) -----------------------------------------
    _synchronize_after_execute: bool = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict) -> dict:
        """``dcp.async_save`` hook: no copy here; the capture happens lazily in ``write_data``.

        The returned state dict holds the live tensors, so the same memory bound holds as for
        ``dcp.save``. Until DCP's save thread reaches ``write_data`` (or fails before it),
        ``wait_captured()`` waits for it too (a ticket, see :mod:`tierckpt.asyncsave`), so the
        pre-step hook stays safe. With ``AsyncCheckpointerType.PROCESS`` DCP pickles it for its
        checkpoint process: then (and only then) it is copied, under the same ticket
        (:class:`tierckpt.asyncsave.LiveState`).
        """
        return LiveState(state_dict, self._tickets.open(), self._tickets)

    def synchronize_staging(self) -> None:
        self.wait_captured()

    def close(self) -> None:
        """Wait for this writer's saves to commit (as :meth:`wait`), once; later calls return at once.

        Raises a background error of its saves, like :meth:`wait`; but never during interpreter
        shutdown (where the ``atexit`` handler has already drained every engine and threads may be
        gone) nor when called from a finalizer (``__del__``): there it logs the error instead.
        Pool and threads are shared per configuration, so nothing else is released here.
        """
        if self._closed:
            return
        self._closed = True
        if sys.is_finalizing() or self.engine.closed:
            return
        self.wait()

    def close_quietly(self) -> None:
        """:meth:`close` for finalizers and shutdown paths: never raises, logs what went wrong."""
        try:
            self.close()
        except BaseException as e:  # noqa: BLE001 - see docstring
            if not sys.is_finalizing():
                log.error("closing the writer of %s: %s", self.cfg.source or "its configuration", e)

    def captured_future(self) -> Future:
        """A future that completes once every save staged or started through this writer so far
        has been captured (the state may change), or fails with the first background error: the
        ``staging_completion`` of an :class:`~torch.distributed.checkpoint.state_dict_saver.AsyncSaveResponse`.
        A daemon thread runs :meth:`wait_captured` for it."""
        fut: Future = Future()

        def run() -> None:
            try:
                self.wait_captured()
                fut.set_result(None)
            except BaseException as e:  # noqa: BLE001 - the future carries it
                fut.set_exception(e)

        threading.Thread(target=run, name="tierckpt-staging", daemon=True).start()
        return fut

    # -- the user's side ------------------------------------------------------------------
    def wait_captured(self) -> float:
        """Block until every checkpoint in flight has landed in host memory; raise background errors.

        Returns the seconds spent blocked. After it returns, the state may be mutated.
        """
        t0 = time.perf_counter()
        self._tickets.wait()
        release_all()
        return self.engine.wait_captured(owner=self) + (time.perf_counter() - t0)

    def wait(self, timeout: float | None = None, tiers: str | list[str] | None = None) -> None:
        """Block until every checkpoint in flight is committed on the first tier and copied to
        every later tier in ``tiers`` (or failed there), then raise what failed, once.

        ``tiers``: None or ``"all"``: every tier; ``"first"`` (or the first tier's name, e.g.
        ``"local"``): the commits only, so a job can end cleanly while S3 is down, its backlog
        kept for the next job with this configuration (which copies it first); or a later tier's
        name (``"s3"``, ``"peer"``) or several.

        Raises, of this writer's saves (or of saves whose writer no longer exists): the failure of
        a checkpoint committed nowhere (capture, flush or first-tier commit), with the others in its
        notes; else :class:`~tierckpt.errors.CopiesPending` when copies to the tiers waited for
        failed and are still owed: its message names what is committed where and what is pending.
        ``timeout`` (seconds): :class:`~tierckpt.errors.CommitError` when not done by then, naming
        the tier that is behind and the checkpoint it is on (``checkpoints in flight after 3 s: s3
        is behind: step-90 is committed on local, still being copied to s3 (then step-100)``).
        """
        self.wait_captured()
        self.engine.wait(timeout, owner=self, tiers=tiers)
        if self._persister is not None:
            self._persister.drain(timeout)

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Register a step pre-hook on ``optimizer`` that waits for the capture in flight.

        The hook never waits for flush, commit or promotion, and never raises: a background
        error is logged at once and raised by the next :meth:`wait`. Returns the hook handle.
        """
        engine = self.engine
        tickets = self._tickets

        def _pre_step(opt: Any, args: Any, kwargs: Any) -> None:
            tickets.wait()
            release_all()
            engine.wait_captured(raise_errors=False)

        return optimizer.register_step_pre_hook(_pre_step)

    @property
    def detached(self) -> bool:
        """Whether this writer is a copy unpickled in another process (see the class docstring)."""
        return self._detached

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


def _detached_writer(cfg: TierConfig, no_dist: bool = False) -> TieredWriter:
    """Unpickling a :class:`TieredWriter`: a detached writer of the same configuration."""
    w = TieredWriter(cfg, no_dist=no_dist)
    w._detached = True
    return w
