"""What checkpointing costs, as numbers, spans and pictures.

* :mod:`.phases`: each save's (and load's) phases with wall-clock start and end, recorded by the
  stages when a phase ends (``SaveStats.phases``); ``SaveStats.as_dict()`` flattens the figures
  for metric loggers.
* :mod:`.hub`: the engine's two calls per save (submitted, settled): the history file and,
  with ``[job] telemetry = "otel"``, the OpenTelemetry export (:mod:`.otel`, :mod:`.lag`).
* :mod:`.worker`: the telemetry thread and its bounded queue: every file write and export runs
  there, never on a checkpoint's or a load's thread (:func:`drain` waits for it; :func:`dropped`).
* :mod:`.history`: the per-rank phase history kept in ``_history/`` on the local tier.
* :mod:`.timeline` (matplotlib) and :mod:`.advise` (Young/Daly): what ``tierckpt-restore timeline``
  and ``advise`` make of that history.

With ``telemetry = "none"`` (the default) OpenTelemetry is never imported and nothing here runs
per chunk. This package imports nothing heavy at import time (no torch, no OpenTelemetry).

Stage ``telemetry``: May import ``catalog``, ``codec``, ``format``, ``tiers``, ``config`` and the
base modules (and the package root's ``__version__``). May be imported by ``capture`` (the phase
log), ``chain`` (the hub), ``save``, ``load``, integrations, testing and ``restore/``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .phases import Phase, PhaseLog

__all__ = ["Phase", "PhaseLog", "drain", "dropped", "loaded"]


def drain(timeout: float = 5.0) -> bool:
    """Wait at most ``timeout`` seconds for the telemetry records posted so far (spans, metrics,
    history writes: :mod:`.worker`) to be handed to their exporters and files; returns whether they
    were. For tests and tools that read what was exported; ``Engine.close`` does it at exit."""
    from .worker import telemetry_queue

    return telemetry_queue().drain(timeout)


def dropped() -> int:
    """Telemetry records this process dropped because the telemetry queue was full."""
    from .worker import dropped as count

    return count()


def loaded(reader: Any, t0: float, error: str | None, items: list) -> None:
    """``TieredReader.read_data`` is done (``t0``: its ``time.perf_counter`` start; ``items``: what it
    read, each with its ``rec``): with OpenTelemetry on, the load's span and metrics, and the fill's once it
    committed, posted to the telemetry thread (:mod:`.worker`: the training thread and the fill's
    commit never wait for an exporter); else nothing (not even the byte count). Never raises."""
    if reader.cfg.job.telemetry != "otel" or reader.resolved_id is None:
        return
    try:
        from . import otel
        from .worker import telemetry_queue

        ex, cid, fill = otel.export(), reader.resolved_id, reader.fill
        phase = PhaseLog().add("load", t0, time.perf_counter(), error=error)
        tiers = set(reader.served.values()) | ({"peer"} if reader.from_peers else set())
        parent: list[Any] = [None]  # the load span's context, for the fill's (one thread runs both, in order)

        def load_span(nbytes: int) -> None:
            parent[0] = ex.load(cid, phase, nbytes, tiers)

        telemetry_queue().post(f"spans of the load of {cid}", load_span, sum(it.rec.length for it in items))
        if fill is not None:

            def fill_span(f0: float, f1: float, n: int, err: str | None) -> None:
                ex.fill(parent[0], cid, PhaseLog().add("fill", f0, f1, error=err), n, fill.local.name)

            def done(f0: float, f1: float, n: int, err: str | None) -> None:
                telemetry_queue().post(f"spans of the fill of {cid}", fill_span, f0, f1, n, err)

            fill.when_done(done)
    except Exception as e:  # noqa: BLE001 - telemetry never fails a load
        logging.getLogger("tierckpt").warning("telemetry of the load of %s failed: %s", reader.resolved_id, e)
