"""How far each tier lags behind the newest checkpoint, from what this process saw (no listing).

:class:`LagTracker` is fed by the phases of this process's saves (``blocked_in_save`` ends: a
checkpoint is saved; ``commit`` ends: it is on the first tier; ``hop:<tier>`` ends without error:
it is on that tier) and answers, per tier:

* ``steps``: the step of the newest saved checkpoint minus the step of the newest one the tier
  holds; when a step is unknown (ids without ``-<number>``), the number of saved checkpoints
  newer than the tier's newest. 0 when the tier is current.
* ``seconds``: how long the tier has been behind: now minus the save time of the oldest saved
  checkpoint newer than the tier's newest (0 when current). A tier stuck since the start counts
  from the first save of this process.

Only tiers that this process has seen take part at least once (the first tier after the first
commit, each hop after its first attempt) are reported, so a tier name appears as soon as it
matters and never before. Thread-safe; O(saved checkpoints kept), at most :data:`KEEP`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

__all__ = ["KEEP", "LagTracker", "Lag"]

KEEP = 256
"""Saved checkpoints remembered (older ones no longer count towards a lag)."""


@dataclass(frozen=True)
class Lag:
    tier: str
    steps: int
    seconds: float


@dataclass
class _Saved:
    checkpoint_id: str
    step: int | None
    n: int  # order of the save in this process
    saved: float  # wall clock


class LagTracker:
    """See the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saved: list[_Saved] = []
        self._by_id: dict[str, _Saved] = {}
        self._newest_on: dict[str, _Saved | None] = {}  # tier -> newest checkpoint it holds (None: none yet)
        self._n = 0

    def saved(self, checkpoint_id: str, step: int | None, when: float | None = None) -> None:
        """A save returned (``dcp.save`` is done with this checkpoint on this rank)."""
        with self._lock:
            if checkpoint_id in self._by_id:
                return
            self._n += 1
            s = _Saved(checkpoint_id, step, self._n, time.time() if when is None else when)
            self._saved.append(s)
            self._by_id[checkpoint_id] = s
            if len(self._saved) > KEEP:
                old = self._saved.pop(0)
                self._by_id.pop(old.checkpoint_id, None)

    def reached(self, tier: str, checkpoint_id: str | None) -> None:
        """``checkpoint_id`` is committed on ``tier`` (None: the tier was tried and holds nothing new)."""
        with self._lock:
            s = self._by_id.get(checkpoint_id) if checkpoint_id is not None else None
            cur = self._newest_on.get(tier)
            if s is not None and (cur is None or s.n > cur.n):
                self._newest_on[tier] = s
            elif tier not in self._newest_on:
                self._newest_on[tier] = None

    def lags(self, now: float | None = None) -> list[Lag]:
        """The lag of every tier seen so far, in the order they were first seen."""
        now = time.time() if now is None else now
        with self._lock:
            if not self._saved:
                return []
            newest = self._saved[-1]
            out = []
            for tier, have in self._newest_on.items():
                behind = [s for s in self._saved if have is None or s.n > have.n]
                if not behind:
                    out.append(Lag(tier, 0, 0.0))
                    continue
                if have is not None and have.step is not None and newest.step is not None:
                    steps = max(0, newest.step - have.step)
                else:
                    steps = len(behind)
                out.append(Lag(tier, steps, max(0.0, now - behind[0].saved)))
            return out
