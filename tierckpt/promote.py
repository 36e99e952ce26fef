"""Background promotion: committed local checkpoints are uploaded to S3 and committed there.

One promoter thread per engine (per process), fed in commit order. For each checkpoint, on
every rank: upload this rank's data file (multipart, concurrent parts, CRC32C per part), then
run the same commit protocol as on the local tier (:mod:`tierckpt.commit`) on a separate channel
prefix: rank reports, the coordinator's outcome, then rank 0 writes ``ID/metadata.json`` on S3
with ``If-None-Match`` (S3 is one shared root, so one writer). ``latest`` on S3 therefore moves
only after every rank's upload completed. After the commit, rank 0 applies ``[s3] keep`` /
``keep_every`` and aborts multipart uploads left behind by failed promotions.

A failure (outage past botocore's and our retries, a rank that died) fails the promotion of
*that* checkpoint: it is logged at once, raised by the next ``writer.wait()``, the S3 copy stays
uncommitted (never loaded), training and the local tier go on, and the next checkpoint is
promoted normally. Promotion never blocks training: only ``wait()`` waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from .commit import encode_report, gather_reports
from .errors import CaptureError
from .layout import data_key, metadata_key
from .retention import apply_local_retention, apply_s3_retention, best_effort_retention

if TYPE_CHECKING:
    from .pipeline import Engine, RankSave

__all__ = ["Promoter"]

log = logging.getLogger("tierckpt.promote")


class Promoter:
    """Uploads and commits checkpoints on S3 after their local commit. Created by the engine."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self._q: queue.Queue[RankSave | None] = queue.Queue()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="tierckpt-promote", daemon=True)
        self._thread.start()

    def submit(self, job: "RankSave") -> None:
        """Queue a locally committed checkpoint for promotion (commit thread)."""
        with self._lock:
            self._pending.add(job.id)
        self._q.put(job)

    def pending_ids(self) -> set[str]:
        with self._lock:
            return set(self._pending)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        from .pipeline import lower_priority

        lower_priority(self.engine.cfg.job.background_nice)
        try:
            self.engine.s3_tier()  # build the client now, not during the first promotion
        except Exception as e:  # noqa: BLE001 - reported by the first promotion that needs it
            log.warning("S3 tier not ready yet: %s", e)
        while True:
            job = self._q.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                self._promote(job)
                job.stats.promote_s = time.perf_counter() - t0
                log.info("checkpoint %s promoted to %s (rank %d, %.1f MiB in %.2f s)", job.id,
                         self.engine.s3_tier().url, job.assign.rank, job.size / 2**20, job.stats.promote_s)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the user
                self.engine._fail(job, e, "promotion to S3")
            with self._lock:
                self._pending.discard(job.id)
            self._local_retention(job)
            # Settled after retention, so that wait() returning means retention on both tiers ran;
            # retired last, so that a wait() in between still finds the job.
            if not job.failed and not job.promoted.done():
                job.promoted.set_result(None)
            self.engine._retire(job)

    def _local_retention(self, job: "RankSave") -> None:
        """Local retention skipped checkpoints still waiting for promotion: apply it again now."""
        eng = self.engine
        if job.failed or job.assign.meta_writer_rank != job.assign.rank or eng.local is None:
            return
        best_effort_retention(apply_local_retention, eng, job)

    def _promote(self, job: "RankSave") -> None:
        eng = self.engine
        s3 = eng.s3_tier()
        local = eng.local
        assert local is not None and eng.cfg.s3 is not None
        a = job.assign
        ch = eng.channel(job)
        prefix = f"tierckpt/{a.token}/s3"
        timeout = eng.cfg.job.commit_timeout
        try:
            if job.size:
                src = local.root / data_key(a.checkpoint_id, a.file)
                s3.upload_file(data_key(a.checkpoint_id, a.file), str(src))
            ch.publish(f"{prefix}/rank{a.rank}", encode_report(True, size=job.size))
        except BaseException as e:
            ch.publish(f"{prefix}/rank{a.rank}", encode_report(False, error=f"{type(e).__name__}: {e}"))
            if a.rank == 0:
                ch.publish(f"{prefix}/outcome", b"E" + f"rank 0 failed: {e}".encode())
            raise
        if a.rank == 0:
            try:
                gather_reports(ch, prefix, a.world, timeout, f"checkpoint {a.checkpoint_id} (S3)")
                assert job.metadata_json is not None
                s3.put(metadata_key(a.checkpoint_id), job.metadata_json, if_absent=True)
                ch.publish(f"{prefix}/outcome", b"OK")
            except BaseException as e:
                ch.publish(f"{prefix}/outcome", b"E" + str(e).encode())
                raise
            best_effort_retention(apply_s3_retention, self.engine, job)
        else:
            out = ch.wait_get(f"{prefix}/outcome", timeout + 30, f"checkpoint {a.checkpoint_id}: S3 commit outcome")
            if out != b"OK":
                raise CaptureError(f"checkpoint {a.checkpoint_id} was not committed on S3: {out[1:].decode(errors='replace')}")
