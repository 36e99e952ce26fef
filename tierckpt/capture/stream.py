"""Capture and flush: a checkpoint's bytes from live tensors, through pool slots, into the first tier.

Owned by the engine (:mod:`tierckpt.engine`), one per process and configuration:

* one *capture* thread: plans each queued checkpoint (chunks and CRC pieces), takes a pool slot per
  chunk (blocking when the pool is full), issues the chunk's copies (CUDA side stream, or a plain
  copy on CPU) and hands the chunk to the flush workers;
* *flush* workers (the first tier's ``read_concurrency``): wait for the chunk to land, CRC32C its
  pieces, write it at its planned offset (direct I/O from the slot where the tier allows it),
  release the slot; the last chunk closes (fsyncs) the file and settles ``job.durable``.

Every failure goes to the engine's ``fail`` callback with its stage (``capture`` or ``flush``).
CPU seconds go to the job's :class:`~tierckpt.save.SaveStats`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from .. import loading
from ..background import Workers
from ..catalog import lease as leases
from ..checksum import crc32c
from ..config import Config
from ..errors import TornCaptureError
from ..format.layout import data_key
from ..tiers.base import Tier
from .copier import Copier, Piece
from .pool import HostPool, get_pool
from .ranksave import RankSave

__all__ = ["CaptureStream"]

log = logging.getLogger("tierckpt")


class CaptureStream:
    """The capture thread and flush workers of one engine. ``first()`` returns the first tier;
    ``fail(job, exc, stage)`` fails a checkpoint (the engine's :meth:`~tierckpt.engine.Engine.fail`)."""

    def __init__(
        self, cfg: Config, first: Callable[[], Tier], fail: Callable[[RankSave, BaseException, str], None]
    ) -> None:
        self.cfg = cfg
        self.chunk_size = cfg.host.effective_chunk_size
        self._first = first
        self._fail = fail
        self._pool: HostPool | None = None
        self.copier = Copier()
        self._saves = 0  # saves submitted (verify_capture = "sample" rotates over it)
        self._capture_q: queue.Queue[RankSave | None] = queue.Queue()
        self._flush_workers: Workers | None = None
        self._capture_thread = threading.Thread(target=self._capture_loop, name="tierckpt-capture", daemon=True)
        self._capture_thread.start()

    @property
    def pool(self) -> HostPool:
        """The host pool, allocated on the first save (readers and tools never allocate it)."""
        if self._pool is None:
            # the first touch yields to a load in flight (a resume), never to a save waiting for it
            self._pool = get_pool(
                self.cfg.host.buffer_size,
                self.chunk_size,
                self.cfg.host.pinned,
                pause=lambda: loading.in_flight() and self._capture_q.empty(),
                wanted=lambda: not self._capture_q.empty(),  # a save waits: touch the rest on demand
            )
        return self._pool

    @property
    def _flush(self) -> Workers:
        """The flush threads, started on the first save (their number is the first tier's)."""
        if self._flush_workers is None:
            self._flush_workers = Workers(
                self._first().read_concurrency, "tierckpt-flush", self.cfg.job.background_nice
            )
        return self._flush_workers

    def submit(self, job: RankSave) -> None:
        """Queue ``job`` for capture (training thread; returns at once)."""
        job.ready_events = Copier.record_ready(job.sources)
        job.check_modes = (self.cfg.job.verify_capture, self.cfg.job.nonfinite, self._saves)
        self._saves += 1
        self._capture_q.put(job)

    def close(self) -> None:
        """Stop in data-flow order: the capture thread may still hand chunks to the flush workers
        (a failed checkpoint's last chunks), and each chunk holds a pool slot."""
        self._capture_q.put(None)
        self._capture_thread.join(timeout=60)
        if self._flush_workers is not None:
            self._flush_workers.shutdown()

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
            probe_s = job.check.probe_cpu_s if job.check is not None else 0.0
            job.stats.add_cpu(capture_cpu_s=time.thread_time() - c1 - probe_s, verify_cpu_s=probe_s)

    def _capture_chunks(self, job: RankSave) -> None:
        tier = self._first()
        if job.size:
            # The lease comes before the first file: a deletion that listed the checkpoint before
            # the file existed leaves the file alone, one that lists it after sees the lease, and
            # one under way (a tombstone) is waited for (see tierckpt.lease).
            job.lease = leases.acquire_for_write(tier, job.id, purpose=f"save by rank {job.assign.rank}")
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
                check = job.check
                events = self.copier.copy(pieces, view, job.ready_events, check.probe if check else None)
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
        job.stats.phases.add("capture", job.t_start, job.t_captured)
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
        crc = vfy = 0.0
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
            crcs = job.crcs
            c1 = time.thread_time()
            if job.check is not None:  # CRC32C, host digest and NaN/Inf scan in one pass
                try:
                    crc = job.check.seal(job.chunks[k], job.crc_pieces[k], arr, crcs)
                finally:
                    vfy = time.thread_time() - c1 - crc
            else:
                for item, j, off, n in job.crc_pieces[k]:
                    crcs[item][j] = crc32c(arr[off : off + n])
                crc = time.thread_time() - c1
            assert job.sink is not None
            job.sink.write_at(k * self.chunk_size, memoryview(arr))
        except BaseException as e:  # noqa: BLE001
            self._fail(job, e, "flush")
            return
        finally:
            self.pool.release(slot)
            job.stats.add_cpu(crc_cpu_s=crc, verify_cpu_s=vfy, write_cpu_s=time.thread_time() - c0 - crc - vfy)
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
        if job.check is not None:
            job.check.warn()
        job.t_durable = time.perf_counter()
        job.stats.flush_s = job.t_durable - job.t_start
        job.stats.phases.add("flush", job.t_start, job.t_durable)
        if not job.durable.done():
            job.durable.set_result(None)


def _zero_gaps(view: torch.Tensor, pieces: list[Piece]) -> None:
    """Zero the alignment padding of a chunk (bytes no piece covers)."""
    at = 0
    for p in sorted(pieces, key=lambda p: p.slot_off):
        if p.slot_off > at:
            view[at : p.slot_off].zero_()
        at = max(at, p.slot_off + p.n)
    if at < len(view):
        view[at:].zero_()
