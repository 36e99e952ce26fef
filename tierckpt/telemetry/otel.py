"""OpenTelemetry export (``[job] telemetry = "otel"``): spans per checkpoint phase and metrics.

Imported only when a configuration asks for it; it uses the ``opentelemetry-api`` package alone
and the tracer and meter providers the application installed (``trace.set_tracer_provider``,
``metrics.set_meter_provider``, or the ``opentelemetry-instrument`` auto-configuration). tierckpt
ships no exporter: without a configured provider the API's no-op provider drops everything.
:func:`use_providers` passes providers explicitly instead of through the globals.

**Spans** (instrumentation scope ``tierckpt``), emitted when a checkpoint *settles* (committed on
every tier or failed) with the timestamps the phases were measured at, so nothing is created on
the hot path:

* ``tierckpt.save``: one per checkpoint per rank, from its first phase to its last; attributes
  ``tierckpt.checkpoint_id``, ``tierckpt.step``, ``tierckpt.rank``, ``tierckpt.world``,
  ``tierckpt.bytes``; status ERROR with the error when the checkpoint failed.
* its children, one per phase (:mod:`tierckpt.telemetry.phases`): ``tierckpt.blocked_in_save``,
  ``tierckpt.prestep_wait``, ``tierckpt.capture``, ``tierckpt.flush``, ``tierckpt.commit``,
  ``tierckpt.hop`` (``tierckpt.tier`` = ``peer``, ``s3``, …). Each carries ``tierckpt.phase`` and
  ``tierckpt.blocked`` (True where the training thread waited: not goodput; False for overlapped
  background work).
* ``tierckpt.load`` (``TieredReader.read_data``, blocked) with a child ``tierckpt.fill`` when the
  load filled the local tier (ends when the fill committed, after the load returned).

**Metrics** (meter ``tierckpt``):

=============================  ===========  ==========================================================
``tierckpt.bytes``             counter, By  ``tierckpt.op`` = save | replicate | load | fill; ``tierckpt.tier``
``tierckpt.cpu.time``          counter, s   CPU seconds of tierckpt's threads; ``tierckpt.cpu`` = plan | capture | crc | write
``tierckpt.blocked.time``      histogram, s time the training thread waited; ``tierckpt.phase`` = blocked_in_save | prestep_wait | load
``tierckpt.queue.depth``       gauge        checkpoints in flight per ``tierckpt.stage`` = capture | flush | commit | replication
``tierckpt.tier.lag.steps``    gauge        steps each ``tierckpt.tier`` lags behind the newest saved checkpoint
``tierckpt.tier.lag.seconds``  gauge, s     how long each ``tierckpt.tier`` has been behind (:mod:`tierckpt.telemetry.lag`)
``tierckpt.telemetry.dropped`` counter      telemetry records dropped, the telemetry queue being full (:mod:`.worker`)
=============================  ===========  ==========================================================

Gauges are observed at the reader's collection time from the engine's state (no work between
collections). Every export is best effort: an exception from a provider is logged once and never
reaches a checkpoint. :meth:`OtelExport.save`, :meth:`~OtelExport.load` and :meth:`~OtelExport.fill`
run on the telemetry thread (:mod:`tierckpt.telemetry.worker`), never on a checkpoint's or a
load's thread: a span processor that blocks (a ``SimpleSpanProcessor`` whose collector does not
answer) holds up telemetry only.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Status, StatusCode

from .lag import LagTracker
from .phases import Phase
from .worker import dropped

__all__ = ["OtelExport", "engine_gauges", "export", "use_providers"]

log = logging.getLogger("tierckpt")

_SCOPE = "tierckpt"
_CPU = (("plan", "plan_cpu_s"), ("capture", "capture_cpu_s"), ("crc", "crc_cpu_s"), ("write", "write_cpu_s"))


def _ns(t: float) -> int:
    return int(t * 1e9)


class OtelExport:
    """The tracer, meter and instruments of this process (one, see :func:`export`)."""

    def __init__(self, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        from .. import __version__

        self.tracer = trace.get_tracer(_SCOPE, __version__, tracer_provider=tracer_provider)
        self.meter = metrics.get_meter(_SCOPE, __version__, meter_provider=meter_provider)
        self.bytes = self.meter.create_counter(
            "tierckpt.bytes", unit="By", description="bytes checkpointed, replicated, loaded and filled"
        )
        self.cpu = self.meter.create_counter(
            "tierckpt.cpu.time", unit="s", description="CPU seconds of tierckpt's threads per checkpoint stage"
        )
        self.blocked = self.meter.create_histogram(
            "tierckpt.blocked.time", unit="s", description="time the training thread waited for tierckpt"
        )
        self._gauges: list[weakref.ref] = []
        self._gauge_lock = threading.Lock()
        self.meter.create_observable_gauge(
            "tierckpt.queue.depth",
            callbacks=[self._queue_depth],
            unit="{checkpoint}",
            description="checkpoints in flight per stage",
        )
        self.meter.create_observable_gauge(
            "tierckpt.tier.lag.steps",
            callbacks=[self._lag_steps],
            unit="{step}",
            description="steps a tier lags behind the newest saved checkpoint",
        )
        self.meter.create_observable_gauge(
            "tierckpt.tier.lag.seconds",
            callbacks=[self._lag_seconds],
            unit="s",
            description="how long a tier has been behind the newest saved checkpoint",
        )
        self.meter.create_observable_counter(
            "tierckpt.telemetry.dropped",
            callbacks=[lambda options: [Observation(dropped())]],
            unit="{record}",
            description="telemetry records dropped because the telemetry queue was full (an exporter slow or stuck)",
        )
        self._warned = False

    # -- spans and counters ------------------------------------------------------------------
    def save(self, stats: Any, step: int | None, world: int) -> None:
        """One settled checkpoint on this rank: its span tree, bytes, CPU and blocked time."""
        phases = stats.phases.snapshot()
        if not phases:
            return
        try:
            attrs = {
                "tierckpt.checkpoint_id": stats.checkpoint_id,
                "tierckpt.rank": stats.rank,
                "tierckpt.world": world,
                "tierckpt.bytes": stats.bytes,
            }
            if step is not None:
                attrs["tierckpt.step"] = step
            root = self.tracer.start_span(
                "tierckpt.save", start_time=_ns(min(p.start for p in phases)), attributes=attrs
            )
            self._children(root, phases)
            if stats.error:
                root.set_status(Status(StatusCode.ERROR, stats.error[:300]))
            root.end(end_time=_ns(max(p.end for p in phases)))
            if stats.bytes and stats.flush_s is not None and not stats.error:
                self.bytes.add(stats.bytes, {"tierckpt.op": "save"})
            for p in phases:
                if p.tier is not None and p.error is None and stats.bytes:
                    self.bytes.add(stats.bytes, {"tierckpt.op": "replicate", "tierckpt.tier": p.tier})
            for kind, field in _CPU:
                secs = getattr(stats, field)
                if secs:
                    self.cpu.add(secs, {"tierckpt.cpu": kind})
            for name in ("blocked_in_save", "prestep_wait"):
                secs = sum(p.seconds for p in phases if p.name == name)
                if secs or name == "blocked_in_save":
                    self.blocked.record(secs, {"tierckpt.phase": name})
        except Exception as e:  # noqa: BLE001 - telemetry never fails a checkpoint
            self._failed(e)

    def load(self, checkpoint_id: str, phase: Phase, nbytes: int, tiers: Iterable[str]) -> Any:
        """A load (``read_data``) on this rank; returns its span's context (for :meth:`fill`)."""
        try:
            attrs: dict[str, Any] = {
                "tierckpt.checkpoint_id": checkpoint_id,
                "tierckpt.bytes": nbytes,
                "tierckpt.phase": "load",
                "tierckpt.blocked": True,
                "tierckpt.tiers": sorted(set(tiers)),
            }
            span = self.tracer.start_span("tierckpt.load", start_time=_ns(phase.start), attributes=attrs)
            if phase.error:
                span.set_status(Status(StatusCode.ERROR, phase.error[:300]))
            span.end(end_time=_ns(phase.end))
            self.blocked.record(phase.seconds, {"tierckpt.phase": "load"})
            if nbytes and not phase.error:
                self.bytes.add(nbytes, {"tierckpt.op": "load"})
            return trace.set_span_in_context(span)
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            return None

    def fill(self, parent: Any, checkpoint_id: str, phase: Phase, nbytes: int, tier: str) -> None:
        """The fill of a load (its commit ended), a child of the load's span."""
        try:
            span = self.tracer.start_span(
                "tierckpt.fill",
                context=parent,
                start_time=_ns(phase.start),
                attributes={
                    "tierckpt.checkpoint_id": checkpoint_id,
                    "tierckpt.phase": "fill",
                    "tierckpt.blocked": False,
                    "tierckpt.tier": tier,
                    "tierckpt.bytes": nbytes,
                },
            )
            if phase.error:
                span.set_status(Status(StatusCode.ERROR, phase.error[:300]))
            span.end(end_time=_ns(phase.end))
            if nbytes:
                self.bytes.add(nbytes, {"tierckpt.op": "fill", "tierckpt.tier": tier})
        except Exception as e:  # noqa: BLE001
            self._failed(e)

    def export(self, checkpoint_id: str, start: float, end: float, result: dict | None, error: str | None) -> None:
        """A background export (``[export] every``) of ``checkpoint_id``, from the queue to the
        worker's exit (wall-clock ``start``/``end``): span ``tierckpt.export`` with its figures
        (bytes, shards, tensors, the worker's own seconds), and its bytes in ``tierckpt.bytes``
        (``tierckpt.op = export``)."""
        try:
            attrs: dict[str, Any] = {
                "tierckpt.checkpoint_id": checkpoint_id,
                "tierckpt.phase": "export",
                "tierckpt.blocked": False,
            }
            if result:
                attrs["tierckpt.bytes"] = int(result.get("bytes", 0))
                attrs["tierckpt.export.shards"] = len(result.get("shards", []))
                attrs["tierckpt.export.tensors"] = int(result.get("tensors", 0))
                attrs["tierckpt.export.seconds"] = float(result.get("seconds", 0.0))
                attrs["tierckpt.export.out"] = str(result.get("out", ""))
            span = self.tracer.start_span("tierckpt.export", start_time=_ns(start), attributes=attrs)
            if error:
                span.set_status(Status(StatusCode.ERROR, error[:300]))
            span.end(end_time=_ns(end))
            if result and not error and result.get("bytes"):
                self.bytes.add(int(result["bytes"]), {"tierckpt.op": "export"})
        except Exception as e:  # noqa: BLE001
            self._failed(e)

    def _children(self, root: Any, phases: list[Phase]) -> None:
        ctx = trace.set_span_in_context(root)
        for p in phases:
            kind = p.name.split(":", 1)[0]
            attrs: dict[str, Any] = {"tierckpt.phase": p.name, "tierckpt.blocked": p.blocked}
            if p.tier is not None:
                attrs["tierckpt.tier"] = p.tier
            span = self.tracer.start_span(f"tierckpt.{kind}", context=ctx, start_time=_ns(p.start), attributes=attrs)
            if p.error:
                span.set_status(Status(StatusCode.ERROR, p.error[:300]))
            span.end(end_time=_ns(p.end))

    def _failed(self, e: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("OpenTelemetry export failed (telemetry only; checkpoints are not affected): %s", e)

    # -- gauges --------------------------------------------------------------------------------
    def add_gauges(self, gauges: EngineGauges) -> None:
        with self._gauge_lock:
            self._gauges = [g for g in self._gauges if g() is not None] + [weakref.ref(gauges)]

    def _live(self) -> list[EngineGauges]:
        with self._gauge_lock:
            return [g for g in (r() for r in self._gauges) if g is not None and not g.closed()]

    def _queue_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        counts = {"capture": 0, "flush": 0, "commit": 0, "replication": 0}
        for g in self._live():
            for stage in g.stages():
                counts[stage] += 1
        return [Observation(n, {"tierckpt.stage": s}) for s, n in counts.items()]

    def _lag_steps(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(lag.steps, {"tierckpt.tier": lag.tier}) for g in self._live() for lag in g.lag.lags()]

    def _lag_seconds(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(lag.seconds, {"tierckpt.tier": lag.tier}) for g in self._live() for lag in g.lag.lags()]


class EngineGauges:
    """One engine's state behind the gauges: its saves in flight and its tiers' lag."""

    def __init__(self, pending: Callable[[], list], closed: Callable[[], bool]) -> None:
        self.pending = pending
        self.closed = closed
        self.lag = LagTracker()

    def stages(self) -> list[str]:
        """The stage of every checkpoint in flight (by which of its futures are done)."""
        out = []
        for job in self.pending():
            if not job.captured.done():
                out.append("capture")
            elif not job.durable.done():
                out.append("flush")
            elif not job.committed.done():
                out.append("commit")
            else:
                out.append("replication")
        return out

    def listener(self, first_tier: str, checkpoint_id: str, step: int | None) -> Callable[[Phase], None]:
        """The :attr:`PhaseLog.listener` of one save: moves the lag as its phases end."""
        lag = self.lag

        def on_phase(p: Phase) -> None:
            if p.name == "blocked_in_save":
                lag.saved(checkpoint_id, step, p.end)
            elif p.name == "commit":
                lag.reached(first_tier, None if p.error else checkpoint_id)
            elif p.tier is not None:
                lag.reached(p.tier, None if p.error else checkpoint_id)

        return on_phase


_export: OtelExport | None = None
_export_lock = threading.Lock()


def export() -> OtelExport:
    """This process's :class:`OtelExport` (created on first use)."""
    global _export
    with _export_lock:
        if _export is None:
            _export = OtelExport()
        return _export


def use_providers(tracer_provider: Any = None, meter_provider: Any = None) -> OtelExport:
    """Export through these providers instead of the global ones (None: the global one), from the
    next engine and load on: for applications that keep their providers out of the OpenTelemetry
    globals, and for tests (the SDK's in-memory exporter and reader)."""
    global _export
    with _export_lock:
        _export = OtelExport(tracer_provider, meter_provider)
        return _export


def engine_gauges(pending: Callable[[], list], closed: Callable[[], bool]) -> EngineGauges:
    """Gauges for one engine, observed by this process's meter from now on."""
    g = EngineGauges(pending, closed)
    export().add_gauges(g)
    return g
