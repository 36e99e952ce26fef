"""The phases of one checkpoint on one rank, with wall-clock start and end.

A :class:`PhaseLog` lives in each save's :class:`~tierckpt.save.SaveStats` (``stats.phases``) and
in each load's telemetry. The stages append to it when a phase *ends*, from whichever thread ran
it (training thread, capture thread, flush worker, commit thread, a hop's thread): a handful of
calls per checkpoint, never per chunk. Times are taken with ``time.perf_counter`` by the stages
(as the durations in ``SaveStats``) and turned into wall-clock seconds here, at the moment the
phase is added, so that ranks and processes can be drawn on one time axis
(:mod:`tierckpt.telemetry.timeline`) and spans carry real timestamps.

Phase names (stable; the history, the timeline and the OpenTelemetry spans use them):

=====================  ====================================================================
``blocked_in_save``    tierckpt's hooks inside ``dcp.save`` (training thread; blocked)
``prestep_wait``       the optimizer pre-step hook / ``wait_captured`` waiting (blocked)
``capture``            from ``write_data`` until every chunk landed in host memory
``flush``              from ``write_data`` until the rank's file was durable on the first tier
``commit``             from durable until committed on the first tier
``hop:<tier>``         one hop of the chain (copy and commit), e.g. ``hop:peer``, ``hop:s3``
``load``               ``TieredReader.read_data`` (blocked)
``fill``               the fill of the local tier during a load, until its commit
=====================  ====================================================================
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BLOCKED", "MAX_PHASES", "Phase", "PhaseLog", "wall"]

BLOCKED = frozenset({"blocked_in_save", "prestep_wait", "load"})
"""Phases during which the training thread waits (marked ``blocked`` in spans and pictures)."""
MAX_PHASES = 32
"""Phases kept per log (a job that waits before every step adds one ``prestep_wait`` per wait)."""


def wall(t_perf: float) -> float:
    """The wall-clock time (``time.time``) of a ``time.perf_counter`` reading taken in this process."""
    return time.time() - (time.perf_counter() - t_perf)


@dataclass(frozen=True)
class Phase:
    """One phase: ``name`` (see the module docstring), wall-clock ``start``/``end`` (seconds since
    the epoch), whether the training thread was ``blocked`` meanwhile, and the ``error`` that
    ended it (None: it succeeded)."""

    name: str
    start: float
    end: float
    blocked: bool = False
    error: str | None = None

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def tier(self) -> str | None:
        """The tier of a ``hop:<tier>`` phase."""
        return self.name.split(":", 1)[1] if self.name.startswith("hop:") else None

    def to_json(self) -> dict:
        d: dict = {"name": self.name, "start": round(self.start, 6), "end": round(self.end, 6)}
        if self.blocked:
            d["blocked"] = True
        if self.error:
            d["error"] = self.error[:300]
        return d


class PhaseLog:
    """The phases of one checkpoint (or load) on one rank; thread-safe, at most :data:`MAX_PHASES`.

    ``listener`` (set by telemetry when an exporter is on, else None) is called with each phase
    as it is added, on the thread that added it; it must be quick and never raise.
    """

    __slots__ = ("_phases", "_lock", "listener")

    def __init__(self) -> None:
        self._phases: list[Phase] = []
        self._lock = threading.Lock()
        self.listener: Callable[[Phase], None] | None = None

    def add(
        self, name: str, t0: float, t1: float | None = None, *, error: str | None = None, replace: bool = False
    ) -> Phase:
        """Record phase ``name`` from ``t0`` to ``t1`` (``time.perf_counter`` readings; ``t1``
        None: now). ``replace``: drop an earlier phase of that name first (a phase measured again
        to a later end, e.g. ``blocked_in_save`` on the coordinator in ``finish``)."""
        now_perf, now_wall = time.perf_counter(), time.time()
        end = now_perf if t1 is None else t1
        p = Phase(name, now_wall - (now_perf - t0), now_wall - (now_perf - end), name in BLOCKED, error)
        with self._lock:
            if replace:
                self._phases = [q for q in self._phases if q.name != name]
            if len(self._phases) < MAX_PHASES:
                self._phases.append(p)
        listener = self.listener
        if listener is not None:
            listener(p)
        return p

    def snapshot(self) -> list[Phase]:
        """The phases so far, in the order they ended."""
        with self._lock:
            return list(self._phases)

    def seconds(self, name: str) -> float:
        """Total seconds of the phases called ``name``."""
        return sum(p.seconds for p in self.snapshot() if p.name == name)

    def __repr__(self) -> str:
        return f"PhaseLog({[p.name for p in self.snapshot()]})"
