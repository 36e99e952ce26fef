"""One checkpoint's life on one rank: capture -> flush -> commit -> replication down the chain.

The :class:`Engine` is process-wide per configuration (so a fresh ``TieredWriter`` per
``dcp.save`` reuses the same pool and threads); :func:`get_engine` finds it, and
``Engine(cfg, tiers=[...])`` + :func:`register_engine` is the seam through which tests and the
chaos harness give it their own tiers. It owns:

* the tier chain (:class:`tierckpt.tiers.Chain`, fastest first; each tier built on first use),
* the host pool and the capture thread and flush workers (:mod:`tierckpt.capture.stream`): chunks
  copied from live tensors into pool slots, checksummed and written into the first tier;
* one *commit* thread: runs the commit protocol (:mod:`tierckpt.commit`) on the first tier for each
  checkpoint in order, then hands it to the first hop; nothing else, so that commits keep up
  with saves whenever the disk does;
* one *retention* thread (:mod:`tierckpt.chain.retainer`): the first tier's retention after
  commits and hops, one pass for whatever committed meanwhile; a job is settled after it;
* one :class:`~tierckpt.replicate.Replicator` per later tier (its own thread), in chain order.

Futures per checkpoint (:class:`~tierckpt.save.RankSave`): ``captured`` (safe to mutate state),
``durable`` (this rank's file is on the first tier), ``committed`` (metadata written there),
``replicated`` (committed on every tier of the chain). A failure sets the exception on every
future not yet done, is logged at ERROR at once, and is raised by the next
``wait``/``wait_captured`` call (once).

Threads here never call collectives; cross-rank agreement goes through a :class:`Channel`.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..capture.pool import HostPool
from ..capture.ranksave import RankAssign, RankSave, SaveStats, build_metadata
from ..capture.stream import CaptureStream
from ..config import Config
from ..errors import CaptureError, CheckpointNotFound, CommitError, ReplicationError, TierckptError
from ..format.layout import data_key, metadata_key
from ..telemetry.hub import EngineTelemetry
from ..tiers import Chain
from ..tiers.base import Tier
from . import registry
from .commit import Channel, Round, default_channel, run_commit
from .exporter import BackgroundExporter
from .peercopy import PeerHop
from .registry import close_all, live_engines, register_engine
from .replicate import Replicator
from .retainer import FirstTierRetention, Retainer
from .seqfloor import SeqFloor
from .waits import Failure, copies_pending, drain, id_order, pending_text, scope, take

__all__ = [
    "Engine",
    "RankSave",
    "RankAssign",
    "SaveStats",
    "get_engine",
    "register_engine",
    "close_all",
    "live_engines",
]

log = logging.getLogger("tierckpt")


class Engine(FirstTierRetention):
    """Process-wide pipeline for one configuration. Obtain it with :func:`get_engine`."""

    def __init__(self, cfg: Config, tiers: list[Tier] | None = None) -> None:
        """``tiers``: the chain to use instead of the one ``cfg`` describes (fastest first)."""
        self.cfg = cfg
        self.chunk_size = cfg.host.effective_chunk_size
        self.chain = Chain(cfg, tiers)
        self.telemetry = EngineTelemetry(cfg, lambda: self.chain.first, self.pending, lambda: self._closed)
        self._commit_q: queue.Queue[RankSave | None] = queue.Queue()
        self._jobs: list[RankSave] = []
        self._retiring: set[RankSave] = set()  # done but for first-tier retention: not in flight for it
        self._jobs_lock = threading.Lock()
        self._errors: list[Failure] = []  # queued for the next wait (see raise_errors)
        self.history: list[SaveStats] = []
        self.seq = SeqFloor(self.chain)  # the commit order's floor on this rank
        self._closed = False
        if cfg.job.log_level:
            logging.getLogger("tierckpt").setLevel(cfg.job.log_level.upper())
        # [export] every = N: a worker process per node after every Nth commit (off the commit path)
        self.exporter = (
            BackgroundExporter(cfg, lambda: self.chain.first, on_done=self.telemetry.exported)
            if cfg.export.every > 0
            else None
        )
        self._commit_thread = threading.Thread(target=self._commit_loop, name="tierckpt-commit", daemon=True)
        self.retainer = Retainer(self._retain_after)
        self.stream = CaptureStream(cfg, lambda: self.chain.first, self.fail)
        self._commit_thread.start()
        chain = self.chain
        self.hops: list[Replicator] = [
            Replicator(self, lambda: chain[0], functools.partial(chain.__getitem__, i), i, chain.names[i])
            for i in range(1, len(chain))
        ]
        if cfg.peer.replicas:  # copies on other nodes first: the fastest way back after losing a node
            self.hops.insert(0, PeerHop(self, lambda: chain[0], cfg.peer.replicas))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (at exit: :func:`close_all`); a closed engine takes no saves."""
        return self._closed

    @property
    def pool(self) -> HostPool:
        """The host pool, allocated on the first save (readers and tools never allocate it)."""
        return self.stream.pool

    # -- tiers ----------------------------------------------------------------------------
    @property
    def first_tier(self) -> Tier:
        """Where captured chunks are flushed and checkpoints first committed (the chain's first)."""
        return self.chain.first

    def tier(self, name: str) -> Tier:
        """The chain's tier configured by section ``name`` (tools and tests)."""
        return self.chain.named(name)

    # -- submission (training thread) -----------------------------------------------------
    def submit(self, job: RankSave) -> None:
        """Queue a checkpoint for capture. Returns at once (the copies are only enqueued)."""
        if self._closed:
            raise TierckptError("the tierckpt engine is closed")
        if job.assign.rank == 0:
            self.seq.start_later()  # S3's commit order, listed while this save is captured
        with self._jobs_lock:
            self._jobs.append(job)
        self.history.append(job.stats)
        self.telemetry.submitted(job)
        self.stream.submit(job)
        self._commit_q.put(job)

    def in_flight_ids(self) -> set[str]:
        """Ids of the saves not done yet; retention spares them. A save that waits only for the
        retention pass after its commit is not one (that pass may delete what it supersedes).
        No lock (snapshots, atomic in CPython): retention calls it while a signal handler may
        stop the main thread holding ``_jobs_lock``."""
        retiring = frozenset(self._retiring)
        return {j.id for j in self.pending() if j not in retiring}

    # -- commit ---------------------------------------------------------------------------
    def channel(self, job: RankSave) -> Channel:
        """The rendezvous of ``job``'s ranks: the process group's store, or in-process."""
        return default_channel(job.assign.distributed)

    def _commit_loop(self) -> None:
        while True:
            job = self._commit_q.get()
            if job is None:
                return
            try:
                self._commit(job)
                job.stats.commit_s = time.perf_counter() - job.t_durable
                job.stats.phases.add("commit", job.t_durable)
                if not job.committed.done():
                    job.committed.set_result(None)
                if self.exporter is not None:  # queues only: never blocks, never raises
                    self.exporter.after_commit(job.id, job.seq, job.assign.rank, job.assign.meta_writer_rank)
                log.info(
                    "checkpoint %s committed on %s (rank %d, %d bytes, capture %.3fs, flush %.3fs)",
                    job.id,
                    self.first_tier.name,
                    job.assign.rank,
                    job.size,
                    job.stats.capture_s or 0.0,
                    job.stats.flush_s or 0.0,
                )
                self.telemetry.committed(job)  # its history record, written now by the telemetry thread
            except BaseException as e:  # noqa: BLE001
                if job.durable.done() and job.durable.exception() is None:
                    job.stats.phases.add("commit", job.t_durable, error=str(e))
                self.fail(job, e, "commit")
            if job.failed:
                self._settle(job)
            elif self.hops:
                self.hops[0].submit(job)
                self.retainer.after(job)
            else:
                self._retire(job)

    def _retire(self, job: RankSave) -> None:
        """``job`` is done on every tier: settle it once a first-tier retention pass saw it."""
        with self._jobs_lock:
            self._retiring.add(job)
        self.retainer.after(job, self._settle)

    def _commit(self, job: RankSave) -> None:
        """Run the commit protocol for ``job`` on the first tier (see :mod:`tierckpt.commit`).

        Each rank reports only after checking that its data file is still there, whole; the
        coordinator numbers the checkpoint (``seq``: one more than any rank has seen on its tiers)
        and merges the metadata; the metadata writer of each root writes it last.
        """
        a = job.assign
        tier = self.first_tier
        timeout = self.cfg.job.commit_timeout
        rnd = Round(
            self.channel(job), a.token, f"0-{tier.name}", a.rank, a.world, timeout, f"checkpoint {a.checkpoint_id}"
        )

        def work() -> dict:
            job.durable.result(timeout=None)
            self._check_file(job)
            self._check_lease(job)
            return {"size": job.size, "crcs": job.crcs, "seq": self.seq.floor(a.rank), "nonfinite": job.nonfinite}

        def merge(reports: list[dict]) -> bytes:
            md, results = job.global_md.result(timeout=timeout)
            seq = 1 + max(int(r.get("seq", 0)) for r in reports)
            return build_metadata(md, results, reports, job, self.chunk_size, seq)

        def reported() -> None:
            job.reported_ok = True

        job.metadata_json = run_commit(
            rnd,
            tier,
            metadata_key(a.checkpoint_id),
            work=work,
            writer=a.meta_writer_rank,
            merge=merge,
            on_reported=reported,
            before_put=lambda: self._check_lease(job),
        )
        self.seq.note(job.seq)  # its lease goes on the retention thread (off the commit path)

    def _check_file(self, job: RankSave) -> None:
        """A save never commits a file it cannot still see: this rank's data file must be on the
        first tier with its planned size (a deletion elsewhere may have raced the save)."""
        if not job.size:
            return
        key = data_key(job.id, job.assign.file)
        try:
            size = self.first_tier.size(key)
        except CheckpointNotFound:
            raise CommitError(
                f"checkpoint {job.id}: rank {job.assign.rank}: its data file {self.first_tier.url}/{key} "
                "vanished before the commit (deleted by another process?)"
            ) from None
        if size != job.size:
            raise CommitError(
                f"checkpoint {job.id}: rank {job.assign.rank}: its data file {self.first_tier.url}/{key} "
                f"has {size} bytes, {job.size} were written"
            )

    def _check_lease(self, job: RankSave) -> None:
        """A save never commits after its lease may have looked dead to a deletion elsewhere (its
        renewals stalled for most of the lease's lifetime): that deletion may remove its file
        (see :mod:`tierckpt.lease`). Called before the report and by the metadata writer before
        the metadata put."""
        if job.lease is not None and job.lease.lapsed:
            raise CommitError(
                f"checkpoint {job.id}: rank {job.assign.rank}: its lease on {self.first_tier.url} "
                "lapsed (not renewed in time: the process stalled?); a deletion elsewhere may have "
                "judged the save dead, so it is not committed"
            )

    def hurry(self) -> None:
        """A preemption drain started: the commit path waits for nothing optional any more (the
        later tiers' commit order, see :mod:`.seqfloor`). Any thread but a signal handler's."""
        self.seq.hurry()

    def hop_done(self, hop: Replicator, job: RankSave) -> None:
        """A hop thread is done with ``job``: the next hop takes it, and retention on the first
        tier runs (it may have waited for this copy; the job is committed there even if this hop
        failed); after the last hop the job is settled once that retention ran."""
        job.hop_done(hop.name).set()
        i = self.hops.index(hop)
        if i + 1 < len(self.hops):
            self.hops[i + 1].submit(job)
            self.retainer.after(job)
        else:
            self._retire(job)

    def _settle(self, job: RankSave) -> None:
        # Settled after retention, so that wait() returning means retention on every tier ran;
        # retired last, so that a wait() in between still finds the job.
        self.telemetry.settled(job)  # handed to the telemetry thread; wait() flushes it (bounded)
        if not job.failed and not job.replicated.done():
            job.replicated.set_result(None)
        with self._jobs_lock:
            if job in self._jobs:
                self._jobs.remove(job)
            self._retiring.discard(job)

    def fail(self, job: RankSave, exc: BaseException, stage: str) -> None:
        """Fail ``job`` once: the error is queued for the next wait *before* any future is set,
        so a waiter woken by the future always finds it. ``stage`` (capture, flush, commit,
        replication to ...) names the error class an unexpected exception is wrapped in.

        A checkpoint committed nowhere (capture, flush, commit) is logged at ERROR; its error is
        raised by the next ``dcp.save``, ``wait_captured()`` or ``wait()`` of its writer. A failed
        copy to a later tier (``replication to <hop>``) is logged at WARNING, once per checkpoint,
        naming what it is committed on and how many checkpoints that tier lacks: training goes on,
        the hop copies its backlog first next time, and ``wait()`` reports it (see
        :meth:`raise_errors`)."""
        if not isinstance(exc, TierckptError):
            cls = (
                CommitError
                if stage == "commit"
                else ReplicationError
                if stage.startswith("replication")
                else CaptureError
            )
            wrapped = cls(f"checkpoint {job.id}: rank {job.assign.rank}: {stage} failed: {type(exc).__name__}: {exc}")
            wrapped.__cause__ = exc
            exc = wrapped
        if not job.claim_failure(exc):
            return
        if stage in ("capture", "flush"):
            job.stats.phases.add(stage, job.t_start, error=str(exc))
        durable = job.durable.done() and job.durable.exception() is None
        hop = next((h for h in self.hops if stage == f"replication to {h.name}"), None)
        with self._jobs_lock:
            self._errors.append(Failure(job.owner, exc, job.id, hop.name if hop is not None else None))
        job.settle_failure()
        if hop is None:
            log.error("%s", exc)
        else:
            n = len(hop.lacking())
            log.warning(
                "checkpoint %s is committed on %s; its copy to %s failed and is pending (%d checkpoint%s not on %s "
                "yet, copied before the next one): %s",
                job.id,
                self.first_tier.name,
                hop.name,
                n,
                "" if n == 1 else "s",
                hop.name,
                exc,
            )
        if durable and job.size and not job.reported_ok:
            # The data file was complete but the checkpoint can never commit (this rank never
            # reported it good): remove it. Its name carries this save's token, so no committed
            # checkpoint's file is touched. After an OK report the coordinator may still commit
            # it, so the file stays (retention removes it if the checkpoint never commits).
            try:
                self.first_tier.delete(data_key(job.id, job.assign.file))
            except Exception as e:  # noqa: BLE001 - left for retention's partial cleanup
                log.warning("could not remove the data file of failed checkpoint %s: %s", job.id, e)
        job.release_lease()

    # -- waiting (training thread) ----------------------------------------------------------
    def pending(self) -> list[RankSave]:
        """The checkpoints in flight (submitted, not yet done with every hop), oldest first.

        Takes no lock (a snapshot of the list, atomic in CPython): a signal handler interrupting
        the main thread while it holds ``_jobs_lock``, and a preemption drain waiting for that
        handler, call it (see :mod:`tierckpt.save.preempt`)."""
        return list(self._jobs)

    def _pending(self) -> list[RankSave]:
        with self._jobs_lock:
            return list(self._jobs)

    def raise_errors(self, owner: Any = None, tiers: str | Iterable[str] | None = None) -> None:
        """Raise the queued background errors that belong to ``owner`` (a writer) and concern
        ``tiers`` (as in :meth:`wait`; ``()``: the first tier only), each once.

        An error belongs to the writer whose save failed; errors of writers that no longer exist
        (``dcp.save(..., storage_writer=TieredWriter(cfg))`` inline) go to whoever waits next.
        With ``owner=None`` every queued error counts.

        * A checkpoint committed nowhere (capture, flush or first-tier commit failed) concerns
          every wait: the first such error is raised as it is (its class names the stage), the
          others, and the copies pending, are named in its notes; failed copies stay queued.
        * Otherwise the failed copies to ``tiers`` that are still owed raise one
          :class:`~tierckpt.errors.CopiesPending` naming, per tier, the checkpoints committed on
          the first tier and pending there, with the last error; a copy made since (by a backlog
          pass) is not reported.
        """
        later = scope(tiers, self.chain.names[0], [h.name for h in self.hops])
        with self._jobs_lock:
            took, lost = take(self._errors, owner, set(later))
            if not took:
                return
            self._errors = [f for f in self._errors if f not in took]
        pending = self._backlog([h for h in self.hops if h.name in later or lost])
        if lost:
            first = took[0].exc
            for f in took[1:]:
                first.add_note(f"checkpoint {f.checkpoint} failed too: {f.exc}")
            if pending:
                first.add_note(pending_text(self.chain.names[0], pending, {}))
            raise first
        copies = [f for f in took if f.checkpoint in pending.get(f.tier or "", ())]
        if copies:
            raise copies_pending(self.chain.names[0], pending, copies)

    def _backlog(self, hops: list[Any]) -> dict[str, list[str]]:
        """Hop name -> the checkpoints committed on the first tier that it still owes, in id order."""
        return {h.name: sorted(owed, key=id_order) for h in hops if (owed := h.lacking())}

    def wait_captured(self, raise_errors: bool = True, owner: Any = None) -> float:
        """Block until every enqueued capture landed; return the seconds spent blocked. Raises
        (``raise_errors``) the failures of checkpoints committed nowhere, never a failed copy to a
        later tier (training goes on without it: see :meth:`fail`)."""
        t0 = time.perf_counter()
        jobs = [j for j in self._pending() if not j.captured.done()]
        for j in jobs:
            try:
                j.captured.result()
            except BaseException:  # noqa: BLE001 - reported through raise_errors
                pass
        waited = time.perf_counter() - t0
        if jobs:
            jobs[-1].stats.prestep_wait_s += waited
            jobs[-1].stats.phases.add("prestep_wait", t0)
        if raise_errors:
            self.raise_errors(owner, ())
        return waited

    def wait(self, timeout: float | None = None, owner: Any = None, tiers: str | Iterable[str] | None = None) -> None:
        """Block until every checkpoint in flight is committed on the first tier and done with every
        later tier in ``tiers`` (copied there, or failed), then raise what concerns them
        (:meth:`raise_errors`).

        ``tiers``: None or ``"all"`` (every tier), ``"first"`` or the first tier's name (the
        commits only), a later tier's name (``"s3"``, ``"peer"``) or several. A job may end after
        ``wait(tiers="first")``: what later tiers lack stays owed, and the next job with this
        configuration copies it first (its hops' backlog pass). ``timeout``: seconds, then
        :class:`~tierckpt.errors.CommitError`.
        """
        later = scope(tiers, self.chain.names[0], [h.name for h in self.hops])
        hops = [h for h in self.hops if h.name in later]
        self._drain(timeout, hops, patient=True)
        for t in self.chain.built():
            t.wait_deletions()  # deferred deletions (retention) are part of "everything done"
        self.telemetry.flush()  # and the history records of what settled (bounded: a stuck exporter once)
        if self.exporter is not None:
            self.exporter.warn()  # failed background exports: warnings, never a failed checkpoint
        self.raise_errors(owner, [h.name for h in hops])

    def _drain(self, timeout: float | None, hops: list[Any], *, patient: bool) -> None:
        """Wait for the jobs in flight on the first tier and ``hops`` (see :func:`.waits.drain`)."""
        drain(
            self._pending(),
            hops,
            every=len(hops) == len(self.hops),
            retired=self._retired,
            timeout=timeout,
            patient=patient,
            first=self.chain.names[0],
        )

    def _retired(self, job: RankSave) -> bool:
        with self._jobs_lock:
            return job not in self._jobs

    def close(self) -> None:
        """Wait for everything in flight, then stop the threads. Bounded, for the exit path
        (:func:`close_all`): it waits for every commit on the first tier and for the copies to
        each later tier, except to a tier whose copy failed since :meth:`close` began (it is down:
        one attempt, bounded by its retries, is waited for). What a later tier then lacks is
        logged at WARNING and stays owed (the next job copies it first); it is not raised. Raises
        the first failure of a checkpoint committed nowhere, not raised by a wait before."""
        if self._closed:
            return
        try:
            self._drain(None, self.hops, patient=False)
            if self.exporter is not None:
                self.exporter.close()  # the last queued export is started (not waited for)
            for t in self.chain.built():
                t.wait_deletions()
            pending = self._backlog(self.hops)
            if pending:
                log.warning(
                    "closing with copies pending: %s; the next job with this configuration copies them first",
                    pending_text(self.chain.names[0], pending, {}),
                )
            with self._jobs_lock:
                self._errors = [f for f in self._errors if f.tier is None]
            self.raise_errors(None, ())
        finally:
            self._closed = True
            self.telemetry.close()
            self.stream.close()
            self._commit_q.put(None)
            for hop in self.hops:
                hop.close()
            self.retainer.close()


def get_engine(cfg: Config) -> Engine:
    """The process-wide engine for ``cfg`` (equal configurations share one; see :mod:`.registry`)."""
    key = registry.engine_key(cfg)
    with registry._engines_lock:
        eng = registry._engines.get(key)
        if not isinstance(eng, Engine) or eng.closed:
            eng = registry._engines[key] = Engine(cfg)
        return eng
