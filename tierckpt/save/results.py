"""The coordinator's results worker: DCP's gathered write results, expanded off the training thread.

``TieredWriter.finish`` (the coordinator, on the training thread inside ``dcp.save``) hands each
save's metadata and results to :data:`results_worker` and returns; its thread waits until the
save's file is durable, expands the results into per-item records and sets ``RankSave.global_md``,
which the commit thread waits for. An error there becomes that checkpoint's commit failure.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import wait as futures_wait

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from ..capture.planning import expand_results, patch_dtypes
from ..capture.ranksave import RankSave

__all__ = ["ResultsWorker", "results_worker"]


class ResultsWorker:
    """One background thread per process: once a save's file is durable on the coordinator,
    expands the gathered results into per-item records (:func:`tierckpt.planning.expand_results`)
    and hands them to the commit thread (``RankSave.global_md``)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[RankSave, Metadata, list[list[WriteResult]]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: RankSave, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tierckpt-results", daemon=True)
                self._thread.start()
        self._q.put((job, metadata, results))

    def _run(self) -> None:
        while True:
            job, metadata, results = self._q.get()
            # Not needed before this rank's file is durable (the commit waits for that first).
            futures_wait([job.durable])
            try:
                expanded, fixes = expand_results(job.id, job.assign.token, results)
                job.global_md.set_result((patch_dtypes(metadata, fixes), expanded))
            except BaseException as e:  # noqa: BLE001 - the commit thread reports it as this checkpoint's failure
                job.global_md.set_exception(e)


results_worker = ResultsWorker()
"""The process's worker (``TieredWriter.finish`` on the coordinator submits to it)."""
