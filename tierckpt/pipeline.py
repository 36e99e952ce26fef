"""One checkpoint's life on one rank: capture -> flush -> commit -> promote.

The :class:`Engine` is process-wide per configuration (so a fresh ``TieredWriter`` per
``dcp.save`` reuses the same pool and threads). It owns:

* the host pool (:mod:`tierckpt.capture.pool`),
* one *capture* thread: takes a pool slot per chunk (blocking when the pool is full), issues the
  chunk's copies (CUDA side stream, or a plain copy on CPU), hands the chunk to the flush pool;
* ``[local] flush_threads`` *flush* threads: wait for the chunk to land, checksum its pieces,
  write it at its planned offset, release the slot; the last chunk closes (fsyncs) the file;
* one *commit* thread: runs the commit protocol (:mod:`tierckpt.commit`) for each checkpoint in
  order, then retention, then hands it to the promoter (S3), if any.

Futures per checkpoint (:class:`RankSave`): ``captured`` (safe to mutate state), ``durable``
(this rank's file is on disk), ``committed`` (metadata written on the first tier), ``promoted``
(committed on S3). A failure sets the exception on every future not yet done, is logged at
ERROR at once, and is raised by the next ``wait``/``wait_captured`` call (once).

Threads here never call collectives; cross-rank agreement goes through a :class:`Channel`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import google_crc32c
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from .capture.copier import Copier, Piece, Source
from .capture.pool import HostPool, get_pool
from . import lease as leases
from .catalog import max_seq
from .commit import Channel, encode_report, gather_reports
from .config import TierConfig
from .errors import CaptureError, CheckpointNotFound, TierckptError, TornCaptureError
from .layout import CheckpointManifest, data_key, metadata_key, metadata_to_json, read_header
from .planning import SaveInputs
from .retention import enforce
from .tiers import make_local, make_s3
from .tiers.local import drain_deletions
from .tiers.base import DataSink, Tier

__all__ = ["Engine", "RankSave", "RankAssign", "SaveStats", "get_engine"]

log = logging.getLogger("tierckpt")


@dataclass
class RankAssign:
    """What the coordinator decided for one rank in ``prepare_global_plan``."""

    checkpoint_id: str
    token: str
    rank: int
    world: int
    file: str
    meta_writer_rank: int  # the rank that writes metadata.json on this rank's local root
    distributed: bool
    created: float
    step: int | None


@dataclass
class SaveStats:
    """Per-checkpoint, per-rank figures (seconds and bytes). ``None`` until the stage ran.

    ``save_blocked_s``: time inside tierckpt's own hooks of ``dcp.save`` (from
    ``set_up_storage_writer`` to ``write_data``/``finish``; DCP's planning around them is not
    included: time the call itself for the full stall). ``prestep_wait_s``: time the optimizer
    pre-step hook (or ``wait_captured``) waited for this capture. ``capture_s``/``flush_s``: from
    ``write_data`` until every chunk landed in host memory / the file was durable.
    ``commit_s``: from durable until committed. ``promote_s``: the upload and S3 commit.

    CPU seconds (user+system, per thread: ``time.thread_time``) that tierckpt's own threads
    spent on this checkpoint: ``plan_cpu_s`` (cutting chunks and checksum pieces, capture
    thread), ``capture_cpu_s`` (opening the file, zeroing padding, issuing or doing the copies
    into the pool: on CPU the memcpy itself), ``crc_cpu_s`` (CRC32C, flush threads),
    ``write_cpu_s`` (waiting for copies to land, the writes, fsync and rename, flush threads).
    ``cpu_s`` is their sum. Not included: DCP's planning on the training thread (within
    ``save_blocked_s``), the commit protocol and retention.
    """

    checkpoint_id: str
    rank: int
    bytes: int = 0
    items: int = 0
    chunks: int = 0
    save_blocked_s: float = 0.0
    prestep_wait_s: float = 0.0
    capture_s: float | None = None
    flush_s: float | None = None
    commit_s: float | None = None
    promote_s: float | None = None
    error: str | None = None
    plan_cpu_s: float = 0.0
    capture_cpu_s: float = 0.0
    crc_cpu_s: float = 0.0
    write_cpu_s: float = 0.0

    @property
    def cpu_s(self) -> float:
        """CPU seconds of tierckpt's threads for this checkpoint (plan + capture + CRC + write)."""
        return self.plan_cpu_s + self.capture_cpu_s + self.crc_cpu_s + self.write_cpu_s

    def throughput(self, stage: str) -> float | None:
        """Bytes per second of a stage (``capture``, ``flush``, ``promote``)."""
        t = getattr(self, f"{stage}_s")
        return self.bytes / t if t else None

    def add_cpu(self, **secs: float) -> None:
        """Add CPU seconds to the ``*_cpu_s`` fields named (any thread)."""
        with _cpu_lock:
            for k, v in secs.items():
                setattr(self, k, getattr(self, k) + v)

    def to_json(self) -> dict:
        return dict(self.__dict__, cpu_s=self.cpu_s)


_cpu_lock = threading.Lock()


class RankSave:
    """This rank's part of one checkpoint, from ``write_data`` until it is committed everywhere.

    Built by ``TieredWriter.write_data`` on the thread running ``dcp.save`` from the save's
    :class:`~tierckpt.planning.SaveInputs` (cached layout plus this save's tensors). Until
    :meth:`plan` ran on the capture thread, ``sources`` holds only one source per CUDA device (for
    the ready events ``Engine.submit`` records on the training thread); :meth:`plan` replaces it
    with every item's source.
    """

    def __init__(self, assign: RankAssign, inputs: SaveInputs, chunk_size: int) -> None:
        self.assign = assign
        self.inputs: SaveInputs | None = inputs
        self.size = inputs.size
        self.chunk_size = chunk_size
        self.sources: list[Source] = inputs.ready_sources()
        self.hold: Any = None  # has wait(timeout): returns when the capture may start (see TieredWriter)
        self.hold_timeout = 2.0
        self.captured: Future[None] = Future()
        self.durable: Future[None] = Future()
        self.committed: Future[None] = Future()
        self.promoted: Future[None] = Future()
        self.global_md: Future[tuple[Metadata, list[list[WriteResult]]]] = Future()
        self.owner: Any = None  # weakref to the TieredWriter that saved it (whose wait() gets its error)
        self.stats = SaveStats(assign.checkpoint_id, assign.rank, bytes=self.size, items=inputs.n_items)
        # Filled by plan(), on the capture thread, to keep the training thread's share small.
        self.crcs: list[list[int]] = []
        self.crc_pieces: list[list[tuple[int, int, int, int]]] = []
        self.chunks: list[list[Piece]] = []
        self.ready_events: dict = {}
        self.sink: DataSink | None = None
        self.lease: leases.Lease | None = None  # this save's lease on the first tier (until committed or failed)
        self.reported_ok = False  # this rank told the coordinator its file is good: it may commit from now on
        self.metadata_json: bytes | None = None
        self._lock = threading.Lock()
        self._landed = 0
        self._flushed = 0
        self._failed: BaseException | None = None
        self.t_start = time.perf_counter()
        self.t_captured = 0.0
        self.t_durable = self.t_start

    def plan(self) -> None:
        """Capture thread, before the first copy: every item's source, the pieces of every chunk
        and the CRC pieces (from the layout's cached plan; only this save's serialized items and
        the sources are new). First waits for ``hold`` (at most ``hold_timeout`` seconds): the
        writer releases it once ``dcp.save`` no longer needs this process's CPU."""
        if self.hold is not None:
            self.hold.wait(self.hold_timeout)
        if self.inputs is None:  # failed before planning: nothing to capture
            return
        self.sources, self.chunks, self.crc_pieces, self.crcs = self.inputs.capture_plan()
        self.inputs = None  # the sources hold what is still needed
        self.stats.chunks = len(self.chunks)

    def chunk_len(self, k: int) -> int:
        return min(self.chunk_size, self.size - k * self.chunk_size)

    @property
    def id(self) -> str:
        return self.assign.checkpoint_id

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def claim_failure(self, exc: BaseException) -> bool:
        """Record ``exc`` as this checkpoint's failure; False if another failure came first."""
        with self._lock:
            if self._failed is not None:
                return False
            self._failed = exc
        self.stats.error = str(exc)
        return True

    def settle_failure(self) -> None:
        """After :meth:`claim_failure`: fail every pending future and discard the partial file."""
        exc = self._failed
        assert exc is not None
        for f in (self.captured, self.durable, self.committed, self.promoted):
            if not f.done():
                f.set_exception(exc)
        if self.sink is not None:
            self.sink.abort()  # safe while flush workers still write: sinks refuse late writes
        self.sources = []
        self.inputs = None

    def release_lease(self) -> None:
        if self.lease is not None:
            self.lease.release()

    @property
    def seq(self) -> int:
        """The commit sequence number (0 until the coordinator's outcome arrived)."""
        h = read_header(self.metadata_json) if self.metadata_json else None
        return h.seq if h is not None else 0

    def landed(self) -> bool:
        """Count one chunk as landed in host memory; True when it was the last one."""
        with self._lock:
            self._landed += 1
            return self._landed == len(self.chunks)

    def flushed(self) -> bool:
        with self._lock:
            self._flushed += 1
            return self._flushed == len(self.chunks)

    def check_versions(self) -> None:
        """The torn-capture guard: no tensor may have been modified in place before its copy landed."""
        for s in self.sources:
            if s.guard is not None and s.guard._version != s.version:
                raise TornCaptureError(
                    f"checkpoint {self.id}: rank {self.assign.rank}: tensor {s.fqn!r} was modified in place "
                    "while its copy to host memory was pending (call writer.attach(optimizer) or "
                    "writer.wait_captured() before the optimizer step); the checkpoint will not be committed"
                )


class Engine:
    """Process-wide pipeline for one configuration. Obtain it with :func:`get_engine`."""

    def __init__(self, cfg: TierConfig) -> None:
        self.cfg = cfg
        self.chunk_size = cfg.host.effective_chunk_size
        self._pool: HostPool | None = None
        self.local: Tier | None = make_local(cfg)
        self.s3: Tier | None = None
        self._s3_lock = threading.Lock()
        nflush = cfg.local.flush_threads if cfg.local is not None else (cfg.s3.concurrency if cfg.s3 else 4)
        self.copier = Copier()
        self._capture_q: queue.Queue[RankSave | None] = queue.Queue()
        self._commit_q: queue.Queue[RankSave | None] = queue.Queue()
        self._flush = _Workers(nflush, "tierckpt-flush", cfg.job.background_nice)
        self._jobs: list[RankSave] = []
        self._jobs_lock = threading.Lock()
        self._errors: list[tuple[Any, BaseException]] = []  # (owner weakref or None, error)
        self.history: list[SaveStats] = []
        self.promoter: Any = None
        self._seq_floor: int | None = None  # highest commit seq seen on the tiers (see _floor)
        self._seq_lock = threading.Lock()
        self._closed = False
        if cfg.job.log_level:
            logging.getLogger("tierckpt").setLevel(cfg.job.log_level.upper())
        self._capture_thread = threading.Thread(target=self._capture_loop, name="tierckpt-capture", daemon=True)
        self._commit_thread = threading.Thread(target=self._commit_loop, name="tierckpt-commit", daemon=True)
        self._capture_thread.start()
        self._commit_thread.start()
        if cfg.local is not None and cfg.s3 is not None:
            from .promote import Promoter

            self.promoter = Promoter(self)

    @property
    def pool(self) -> HostPool:
        """The host pool, allocated on the first save (readers and tools never allocate it)."""
        if self._pool is None:
            self._pool = get_pool(self.cfg.host.buffer_size, self.chunk_size, self.cfg.host.pinned)
        return self._pool

    # -- tiers ----------------------------------------------------------------------------
    @property
    def first_tier(self) -> Tier:
        """Where captured chunks are flushed: the local tier, or S3 in direct mode."""
        return self.local if self.local is not None else self.s3_tier()

    def s3_tier(self) -> Tier:
        with self._s3_lock:
            if self.s3 is None:
                self.s3 = make_s3(self.cfg)
                if self.s3 is None:
                    raise TierckptError("no [s3] section in the configuration")
            return self.s3

    # -- submission (training thread) -----------------------------------------------------
    def submit(self, job: RankSave) -> None:
        """Queue a checkpoint for capture. Returns at once (the copies are only enqueued)."""
        if self._closed:
            raise TierckptError("the tierckpt engine is closed")
        job.ready_events = Copier.record_ready(job.sources)
        with self._jobs_lock:
            self._jobs.append(job)
        self.history.append(job.stats)
        self._capture_q.put(job)
        self._commit_q.put(job)

    def in_flight_ids(self) -> set[str]:
        with self._jobs_lock:
            return {j.id for j in self._jobs}

    # -- capture --------------------------------------------------------------------------
    def _capture_loop(self) -> None:
        try:
            self.pool  # noqa: B018 - allocate and touch the pool now, not during the first save
        except Exception as e:  # noqa: BLE001 - the first save reports it
            log.warning("host pool allocation failed: %s", e)
        while True:
            job = self._capture_q.get()
            if job is None:
                return
            try:
                self._capture(job)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the user
                self._fail(job, e, "capture")

    def _capture(self, job: RankSave) -> None:
        """Capture thread: plan, open the sink, copy chunk by chunk into pool slots (blocking on
        a free slot), hand each chunk to the flush workers. CPU time goes to ``job.stats``."""
        c0 = time.thread_time()
        job.plan()
        c1 = time.thread_time()
        job.stats.add_cpu(plan_cpu_s=c1 - c0)
        try:
            self._capture_chunks(job)
        finally:
            job.stats.add_cpu(capture_cpu_s=time.thread_time() - c1)

    def _capture_chunks(self, job: RankSave) -> None:
        tier = self.first_tier
        if job.size:
            # The lease comes before the first file: a deletion that listed the checkpoint before
            # the file existed leaves the file alone, one that lists it after sees the lease.
            job.lease = leases.acquire(tier, job.id, kind="save", purpose=f"save by rank {job.assign.rank}",
                                       require_committed=False, check_tombs=False)
            job.sink = tier.open_sink(data_key(job.id, job.assign.file), job.size)
        if not job.chunks:
            self._capture_done(job)
            self._durable(job)
            return
        for k, pieces in enumerate(job.chunks):
            slot = self.pool.acquire(should_stop=lambda: job.failed)
            if slot is None:
                return
            if job.failed:
                self.pool.release(slot)
                return
            try:
                n = job.chunk_len(k)
                view = self.pool.slot(slot, n)
                _zero_gaps(view, pieces)
                events = self.copier.copy(pieces, view, job.ready_events)
            except BaseException:
                self.pool.release(slot)
                raise
            if not events and job.landed():
                self._capture_done(job)
            self._flush.submit(self._flush_chunk, job, k, slot, events)

    def _capture_done(self, job: RankSave) -> None:
        try:
            job.check_versions()
        except TornCaptureError as e:
            self._fail(job, e, "capture")
            return
        job.t_captured = time.perf_counter()
        job.stats.capture_s = job.t_captured - job.t_start
        for s in job.sources:  # drop references to live state: the copies have landed
            s.tensor = s.guard = s._flat = None
            s.data = None
        if not job.captured.done():
            job.captured.set_result(None)

    # -- flush ----------------------------------------------------------------------------
    def _flush_chunk(self, job: RankSave, k: int, slot: int, events: list) -> None:
        """Flush worker: wait for chunk ``k`` to land, CRC32C its pieces, write it at its offset
        (direct I/O from the slot where the tier allows it), release the slot; the last chunk
        closes (fsyncs) the file. CPU time goes to ``job.stats`` (``crc_cpu_s``/``write_cpu_s``)."""
        c0 = time.thread_time()
        crc = 0.0
        try:
            if events:
                for ev in events:
                    ev.synchronize()
                if job.landed():
                    self._capture_done(job)
            if job.failed:
                return
            n = job.chunk_len(k)
            view = self.pool.slot(slot, n)
            arr = view.numpy()
            c1 = time.thread_time()
            crcs = job.crcs
            for item, j, off, n in job.crc_pieces[k]:
                crcs[item][j] = google_crc32c.value(arr[off : off + n])
            crc = time.thread_time() - c1
            assert job.sink is not None
            job.sink.write_at(k * self.chunk_size, memoryview(arr))
        except BaseException as e:  # noqa: BLE001
            self._fail(job, e, "flush")
            return
        finally:
            self.pool.release(slot)
            job.stats.add_cpu(crc_cpu_s=crc, write_cpu_s=time.thread_time() - c0 - crc)
        if job.flushed():
            c0 = time.thread_time()
            try:
                job.sink.close()
                self._durable(job)
            except BaseException as e:  # noqa: BLE001
                self._fail(job, e, "flush")
            finally:
                job.stats.add_cpu(write_cpu_s=time.thread_time() - c0)

    def _durable(self, job: RankSave) -> None:
        if job.failed:
            return
        job.t_durable = time.perf_counter()
        job.stats.flush_s = job.t_durable - job.t_start
        if not job.durable.done():
            job.durable.set_result(None)

    # -- commit ---------------------------------------------------------------------------
    def channel(self, job: RankSave) -> Channel:
        from .commit import default_channel

        return default_channel(job.assign.distributed)

    def _commit_loop(self) -> None:
        while True:
            job = self._commit_q.get()
            if job is None:
                return
            try:
                self._commit(job)
                job.stats.commit_s = time.perf_counter() - job.t_durable
                if not job.committed.done():
                    job.committed.set_result(None)
                log.info("checkpoint %s committed on %s (rank %d, %d bytes, capture %.3fs, flush %.3fs)",
                         job.id, self.first_tier.name, job.assign.rank, job.size,
                         job.stats.capture_s or 0.0, job.stats.flush_s or 0.0)
            except BaseException as e:  # noqa: BLE001
                self._fail(job, e, "commit")
            if self.promoter is not None and not job.failed:
                self.promoter.submit(job)
            else:
                self._retire(job)

    def _commit(self, job: RankSave) -> None:
        """Run the commit protocol for ``job`` on the first tier (see :mod:`tierckpt.commit`).

        Each rank reports only after checking that its data file is still there, whole; the
        coordinator numbers the checkpoint (``seq``: one more than any rank has seen on its tiers)
        and merges the metadata; the metadata writer of each root writes it last.
        """
        a = job.assign
        ch = self.channel(job)
        tier = self.first_tier
        prefix = f"tierckpt/{a.token}/{tier.name}"
        timeout = self.cfg.job.commit_timeout
        try:
            job.durable.result(timeout=None)
            self._check_file(job)
            ch.publish(f"{prefix}/rank{a.rank}", encode_report(True, size=job.size, crcs=job.crcs, seq=self._floor(a.rank)))
            job.reported_ok = True
        except BaseException as e:  # noqa: BLE001
            ch.publish(f"{prefix}/rank{a.rank}", encode_report(False, error=f"{type(e).__name__}: {e}"))
            if a.rank == 0:
                ch.publish(f"{prefix}/outcome", b"E" + f"rank 0 failed: {e}".encode())
            raise
        if a.rank == 0:
            try:
                md, results = job.global_md.result(timeout=timeout)
                reports = gather_reports(ch, prefix, a.world, timeout, f"checkpoint {a.checkpoint_id}")
                seq = 1 + max(int(r.get("seq", 0)) for r in reports)
                job.metadata_json = build_metadata(md, results, reports, job, self.chunk_size, seq)
                ch.publish(f"{prefix}/outcome", b"M" + job.metadata_json)
            except BaseException as e:
                ch.publish(f"{prefix}/outcome", b"E" + str(e).encode())
                raise
        outcome = ch.wait_get(f"{prefix}/outcome", timeout + 30, f"checkpoint {a.checkpoint_id}: commit outcome")
        if outcome[:1] != b"M":
            raise CaptureError(f"checkpoint {a.checkpoint_id} was not committed: {outcome[1:].decode(errors='replace')}")
        job.metadata_json = outcome[1:]
        self._note_seq(job.seq)
        written = f"{prefix}/written{a.meta_writer_rank}"
        if a.meta_writer_rank == a.rank:
            try:
                tier.put(metadata_key(a.checkpoint_id), job.metadata_json, if_absent=True)
            except BaseException as e:
                ch.publish(written, b"E" + str(e).encode())
                raise
            ch.publish(written, b"OK")
            job.release_lease()
            self.retain_first_tier(job)
        else:
            ack = ch.wait_get(written, timeout + 30, f"checkpoint {a.checkpoint_id}: metadata write by rank {a.meta_writer_rank}")
            if ack != b"OK":
                raise CaptureError(f"checkpoint {a.checkpoint_id}: rank {a.meta_writer_rank} could not write its metadata: "
                                   f"{ack[1:].decode(errors='replace')}")
            job.release_lease()

    def _check_file(self, job: RankSave) -> None:
        """A save never commits a file it cannot still see: this rank's data file must be on the
        first tier with its planned size (a deletion elsewhere may have raced the save)."""
        if not job.size:
            return
        key = data_key(job.id, job.assign.file)
        try:
            size = self.first_tier.size(key)
        except CheckpointNotFound:
            raise CaptureError(f"checkpoint {job.id}: rank {job.assign.rank}: its data file {self.first_tier.url}/{key} "
                               "vanished before the commit (deleted by another process?)") from None
        if size != job.size:
            raise CaptureError(f"checkpoint {job.id}: rank {job.assign.rank}: its data file {self.first_tier.url}/{key} "
                               f"has {size} bytes, {job.size} were written")

    def _floor(self, rank: int) -> int:
        """The highest commit seq this rank can see: its first tier (when listing it is cheap) and,
        on rank 0, every other configured tier; listed once per engine, then tracked."""
        with self._seq_lock:
            if self._seq_floor is None:
                floor = 0
                tiers = [self.first_tier] if self.first_tier.cheap_listing else []
                if rank == 0:
                    tiers = [t for t in (self.local, self.s3_tier() if self.cfg.s3 is not None else None) if t is not None]
                for t in tiers:
                    try:
                        floor = max(floor, max_seq(t))
                    except TierckptError as e:
                        log.warning("cannot read the commit order on %s (numbering from what is known): %s", t.url, e)
                self._seq_floor = floor
            return self._seq_floor

    def _note_seq(self, seq: int) -> None:
        with self._seq_lock:
            self._seq_floor = max(self._seq_floor or 0, seq)

    def retain_first_tier(self, job: RankSave) -> None:
        """Retention on the first tier after ``job`` committed there (its metadata writer only;
        called by the commit thread, and by the promoter after each promotion).

        Best effort: a failure is logged and never fails the committed checkpoint; the next
        commit retries. With a promoter, checkpoints not yet on S3 are protected (and nothing
        is deleted before the promoter has looked for a backlog left by an earlier run).
        """
        if job.assign.meta_writer_rank != job.assign.rank:
            return
        tier = self.first_tier
        try:
            protect = self.in_flight_ids() | {job.id}
            if tier is self.local:
                assert self.cfg.local is not None
                owed: set[str] = set()
                if self.promoter is not None:
                    if not self.promoter.settled:
                        log.debug("local retention after %s waits for the promoter's backlog check", job.id)
                        return
                    owed = self.promoter.owed()
                enforce(tier, self.cfg.local.keep, 0, protect, owed=owed, need_bytes=2 * job.size)
            else:
                self.retain_s3(job)
        except Exception as e:  # noqa: BLE001 - see docstring
            log.warning("retention after committing %s failed (will retry after the next commit): %s", job.id, e)

    def retain_s3(self, job: RankSave) -> None:
        """``[s3] keep``/``keep_every`` after ``job`` committed on S3 (rank 0), then abort stale uploads."""
        self.retain_s3_now({job.id})

    def retain_s3_now(self, protect: set[str]) -> None:
        """``[s3] keep``/``keep_every`` on S3 now (rank 0 only), sparing ``protect`` and saves in flight."""
        s3 = self.s3_tier()
        cfg = self.cfg.s3
        assert cfg is not None
        enforce(s3, cfg.keep, cfg.keep_every, self.in_flight_ids() | protect)
        abort = getattr(s3, "abort_stale_uploads", None)
        if abort is not None:
            aborted = abort("", older_than_s=self.cfg.job.commit_timeout)
            if aborted:
                log.info("aborted %d stale multipart uploads on %s", aborted, s3.url)

    def _retire(self, job: RankSave) -> None:
        with self._jobs_lock:
            if job in self._jobs:
                self._jobs.remove(job)

    def _fail(self, job: RankSave, exc: BaseException, stage: str) -> None:
        """Fail ``job`` once: the error is queued for the next wait *before* any future is set,
        so a waiter woken by the future always finds it."""
        if not isinstance(exc, TierckptError):
            wrapped = CaptureError(f"checkpoint {job.id}: rank {job.assign.rank}: {stage} failed: {type(exc).__name__}: {exc}")
            wrapped.__cause__ = exc
            exc = wrapped
        if not job.claim_failure(exc):
            return
        durable = job.durable.done() and job.durable.exception() is None
        with self._jobs_lock:
            self._errors.append((job.owner, exc))
        job.settle_failure()
        log.error("%s", exc)
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
    def _pending(self) -> list[RankSave]:
        with self._jobs_lock:
            return list(self._jobs)

    def raise_errors(self, owner: Any = None) -> None:
        """Raise the first queued background error that belongs to ``owner`` (a writer).

        An error belongs to the writer whose save failed; errors of writers that no longer
        exist (``dcp.save(..., storage_writer=TieredWriter(cfg))`` inline) go to whoever waits
        next. With ``owner=None`` every queued error counts.
        """
        with self._jobs_lock:
            mine = [(o, e) for o, e in self._errors
                    if owner is None or o is None or o() is None or o() is owner]
            if not mine:
                return
            self._errors = [x for x in self._errors if x not in mine]
        errs = [e for _o, e in mine]
        if len(errs) > 1:
            log.error("%d more background errors before this one: %s", len(errs) - 1, "; ".join(map(str, errs[1:])))
        raise errs[0]

    def wait_captured(self, raise_errors: bool = True, owner: Any = None) -> float:
        """Block until every enqueued capture landed; return the seconds spent blocked."""
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
        if raise_errors:
            self.raise_errors(owner)
        return waited

    def wait(self, timeout: float | None = None, owner: Any = None) -> None:
        """Block until every checkpoint in flight is committed on every configured tier."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.promoter is not None:  # a backlog promoted at start is part of "everything done"
            self.promoter.started.wait(timeout)
        for j in self._pending():
            fut = j.promoted if self.promoter is not None else j.committed
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                fut.result(timeout=left)
            except TimeoutError:
                raise CaptureError(f"checkpoint {j.id}: not committed after {timeout} s") from None
            except BaseException:  # noqa: BLE001 - reported through raise_errors
                pass
        if self.local is not None:
            drain_deletions()  # retention's deletions are part of "everything done"
        self.raise_errors(owner)

    def close(self) -> None:
        """Wait for everything in flight, then stop the threads."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            # Stop in data-flow order: the capture thread may still hand chunks to the flush
            # workers (a failed checkpoint's last chunks), and each chunk holds a pool slot.
            self._capture_q.put(None)
            self._capture_thread.join(timeout=60)
            self._flush.shutdown()
            self._commit_q.put(None)
            if self.promoter is not None:
                self.promoter.close()


def lower_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's niceness (Linux: per thread); no-op elsewhere."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:
        log.debug("cannot lower the priority of %s: %s", threading.current_thread().name, e)


class _Workers:
    """A fixed set of daemon threads running submitted calls in FIFO order.

    Unlike ``ThreadPoolExecutor`` it keeps accepting work during interpreter shutdown, so the
    ``atexit`` handler can still drain checkpoints the user did not wait for.
    """

    def __init__(self, n: int, name: str, nice: int = 0) -> None:
        self._q: queue.Queue = queue.Queue()
        self._nice = nice
        self._lock = threading.Lock()
        self._stopped = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args) -> None:
        with self._lock:
            if not self._stopped:
                self._q.put((fn, args))
                return
        fn(*args)  # after shutdown: run here, so that the task's slot is still released

    def _run(self) -> None:
        lower_priority(self._nice)
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args = item
            fn(*args)  # callers catch their own errors (see Engine._flush_chunk)

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout=10)


def build_metadata(md: Metadata, results: list[list[WriteResult]], reports: list[dict], job: RankSave, chunk_size: int,
                   seq: int) -> bytes:
    """Coordinator: merge DCP's metadata, every rank's write results and reported CRCs into JSON."""
    storage: dict = {}
    files: dict[str, int] = {}
    for r, (res, rep) in enumerate(zip(results, reports)):
        crcs = rep["crcs"]
        if len(crcs) != len(res):
            raise CaptureError(f"checkpoint {job.id}: rank {r} reported {len(crcs)} checksums for {len(res)} items")
        for wr, c in zip(res, crcs):
            rec = replace(wr.storage_data, crcs=list(c))
            storage[wr.index] = rec
            files[rec.file] = rep["size"]
    md = replace(md, storage_data=storage)
    manifest = CheckpointManifest(
        checkpoint_id=job.id, world_size=job.assign.world, chunk_size=chunk_size, files=files,
        created=job.assign.created, committed=time.time(), step=job.assign.step, save_token=job.assign.token, seq=seq,
    )
    return metadata_to_json(md, manifest)


def _zero_gaps(view: torch.Tensor, pieces: list[Piece]) -> None:
    """Zero the alignment padding of a chunk (bytes no piece covers)."""
    at = 0
    for p in sorted(pieces, key=lambda p: p.slot_off):
        if p.slot_off > at:
            view[at : p.slot_off].zero_()
        at = max(at, p.slot_off + p.n)
    if at < len(view):
        view[at:].zero_()


_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def _engine_key(cfg: TierConfig) -> str:
    return repr((cfg.host, cfg.local, cfg.s3, cfg.job, os.getpid()))


def get_engine(cfg: TierConfig) -> Engine:
    """The process-wide engine for ``cfg`` (equal configurations share one)."""
    key = _engine_key(cfg)
    with _engines_lock:
        eng = _engines.get(key)
        if eng is None or eng._closed:
            eng = _engines[key] = Engine(cfg)
        return eng


def close_all() -> None:
    """Close every engine (waits for in-flight checkpoints). Registered with ``atexit``."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for e in engines:
        try:
            e.close()
        except TierckptError as err:
            log.error("at exit: %s", err)


import atexit  # noqa: E402

atexit.register(close_all)

