"""One engine's telemetry: the history file and, with ``[job] telemetry = "otel"``, the export.

Called by the engine (:mod:`tierckpt.engine`) at three points of each save's life, never per chunk,
and at close. None of them does I/O or calls an exporter on the caller's thread: what may block
(the history file write, spans and metrics through the application's providers) is handed to the
telemetry thread (:mod:`tierckpt.telemetry.worker`: one bounded queue per process; a full queue
drops the record and counts it), so a slow or stuck exporter never holds up a commit, a
``writer.wait()`` or a SIGTERM drain.

* :meth:`EngineTelemetry.submitted` (training thread, ``Engine.submit``): with OpenTelemetry on,
  hooks the save's :class:`~tierckpt.telemetry.phases.PhaseLog` to the lag gauges (in-memory
  bookkeeping under a short lock, run where the phase ends: no I/O, no application code);
  otherwise nothing.
* :meth:`EngineTelemetry.committed` (the commit thread, once the save is committed on the first
  tier): keeps its record so far for this rank's history file (:mod:`tierckpt.telemetry.history`)
  and has the telemetry thread write the file at once, so a job killed later keeps it.
* :meth:`EngineTelemetry.settled` (the engine thread that settles the save, before
  ``writer.wait()`` returns): keeps the save's full record (replacing the first; written by the
  telemetry thread at once) and, with OpenTelemetry on, posts its spans and metrics.
* :meth:`EngineTelemetry.close` (``Engine.close``, at exit): waits for the telemetry thread at most
  :data:`~tierckpt.telemetry.worker.CLOSE_WAIT` seconds, then writes what the history holds.

Neither ever raises into the engine: failures are logged (once).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..config.values import node_name
from ..errors import ConfigError
from ..tiers.base import Tier
from .history import PROCESS, HistoryLog
from .worker import CLOSE_WAIT, telemetry_queue

__all__ = ["EngineTelemetry", "flush_history"]

log = logging.getLogger("tierckpt")

_logs: dict[tuple[str, int], HistoryLog] = {}
_logs_lock = threading.Lock()


def _history_log(tier: Tier, global_rank: int, keep: int) -> HistoryLog:
    """The process's history of ``global_rank`` on ``tier`` (shared by the engines of one root)."""
    with _logs_lock:
        h = _logs.get((tier.url, global_rank))
        if h is None:
            h = _logs[(tier.url, global_rank)] = HistoryLog(tier, global_rank, node_name(), keep)
        h.keep = max(h.keep, keep)
        return h


def flush_history(timeout: float = CLOSE_WAIT) -> None:
    """Write every history record of this process not written yet (tools that draw the timeline of
    saves they just made; engines do it when they close), after waiting at most ``timeout`` seconds
    for the telemetry thread."""
    telemetry_queue().drain(timeout)
    with _logs_lock:
        logs = list(_logs.values())
    for h in logs:
        h.flush()


def _global_rank(default: int) -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else default


class EngineTelemetry:
    """See the module docstring. ``first`` returns the engine's first tier; ``pending`` its saves in
    flight and ``closed`` whether it is closed (for the queue-depth gauge)."""

    def __init__(
        self, cfg: Config, first: Callable[[], Tier], pending: Callable[[], list], closed: Callable[[], bool]
    ) -> None:
        self.keep = cfg.job.history
        self._first = first
        self._otel: Any = None
        self._gauges: Any = None
        self._warned = False
        self._logs: set[HistoryLog] = set()  # the history files this engine appended to
        if cfg.job.telemetry == "otel":
            try:
                from . import otel
            except ImportError as e:
                where = f"{cfg.source}: " if cfg.source else ""
                raise ConfigError(
                    f'{where}[job] telemetry = "otel" needs the OpenTelemetry API ({e}); install it '
                    'with: pip install "tierckpt[otel]"'
                ) from None
            self._otel = otel.export()
            self._gauges = otel.engine_gauges(pending, closed)

    def submitted(self, job: Any) -> None:
        """``Engine.submit``, training thread."""
        if self._gauges is not None:
            job.stats.phases.listener = self._gauges.listener(self._first().name, job.id, job.assign.step)

    def committed(self, job: Any) -> None:
        """The save is committed on the first tier (the commit thread, after the commit): its record
        so far goes to the history file now (written by the telemetry thread, never on the commit's
        path), so a job killed later still has it. :meth:`settled` replaces it."""
        try:
            self._keep(job, settled=False)
        except Exception as e:  # noqa: BLE001 - telemetry never fails a checkpoint
            if not self._warned:
                self._warned = True
                log.warning("checkpoint %s: telemetry failed (the checkpoint is not affected): %s", job.id, e)

    def _keep(self, job: Any, settled: bool) -> None:
        if self.keep:
            tier = self._first()
            if tier.cheap_listing:
                h = _history_log(tier, _global_rank(job.assign.rank), self.keep)
                self._logs.add(h)
                if h.append(record_of(job, settled)) and not telemetry_queue().post(f"history of {job.id}", h.write):
                    h.cancel()

    def settled(self, job: Any) -> None:
        """The save is committed on every tier, or failed (an engine thread). Never blocks: the
        record is kept in memory and the work handed to the telemetry thread."""
        try:
            self._keep(job, settled=True)
            if self._otel is not None:
                telemetry_queue().post(
                    f"spans of {job.id}", self._otel.save, job.stats, job.assign.step, job.assign.world
                )
        except Exception as e:  # noqa: BLE001 - telemetry never fails a checkpoint
            if not self._warned:
                self._warned = True
                log.warning("checkpoint %s: telemetry failed (the checkpoint is not affected): %s", job.id, e)

    def exported(self, checkpoint_id: str, start: float, end: float, result: dict | None, error: str | None) -> None:
        """A background export ended (the export thread): its span and figures go to OpenTelemetry
        through the telemetry thread (:meth:`~tierckpt.telemetry.otel.OtelExport.export`)."""
        if self._otel is not None:
            telemetry_queue().post(
                f"export span of {checkpoint_id}", self._otel.export, checkpoint_id, start, end, result, error
            )

    def flush(self) -> None:
        """``Engine.wait`` and ``Engine.close`` (the caller's thread): wait for the telemetry thread
        (at most :data:`~tierckpt.telemetry.worker.CLOSE_WAIT` seconds, once per stuck record), then
        write the history records not written yet (on the calling thread: they never depend on an
        exporter). So a ``wait()`` that returned leaves no write behind it in the tier's directory."""
        if self._otel is not None or self._logs:
            telemetry_queue().drain(CLOSE_WAIT)
        for h in list(self._logs):
            h.flush()

    def close(self) -> None:
        """``Engine.close``: :meth:`flush`."""
        self.flush()


def record_of(job: Any, settled: bool = True) -> dict:
    """The history record of one save on this rank (``settled``: committed on every tier, or failed;
    else committed on the first tier so far)."""
    st = job.stats
    return {
        "id": job.id,
        "token": job.assign.token,
        "step": job.assign.step,
        "rank": job.assign.rank,
        "world": job.assign.world,
        "bytes": st.bytes,
        "error": st.error[:300] if st.error else None,
        "stats": {k: round(v, 6) if isinstance(v, float) else v for k, v in st.as_dict(prefix="").items()},
        "phases": [p.to_json() for p in st.phases.snapshot()],
        "process": PROCESS,
        "settled": settled,
    }
