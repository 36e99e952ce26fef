"""How often to checkpoint: the interval that minimises expected lost time (Young/Daly).

With a mean time between failures ``M`` and a cost ``δ`` per checkpoint, checkpointing after every
``τ`` seconds of training loses ``δ`` per checkpoint and, per failure, on average half an interval
of work. The interval minimising the total is, to first order (Young 1974)::

    τ_Young = sqrt(2 δ M)

and, with Daly's higher-order correction (Daly 2006, "A higher order estimate of the optimum
checkpoint interval for restart dumps", FGCS 22(3))::

    τ_Daly = sqrt(2 δ M) · [1 + (1/3) sqrt(δ / 2M) + (1/9) (δ / 2M)] - δ     for δ < 2M,  else M

The fraction of wall time lost at an interval ``τ`` (restart cost ``R``) is Daly's complete model::

    waste(τ) = M e^(R/M) (e^((τ+δ)/M) - 1) / τ - 1

**δ from the job.** tierckpt's saves block training only briefly; most of their work runs in the
background. The history (:mod:`tierckpt.telemetry.history`) gives, per checkpoint, the slowest
rank's *blocked* time (``blocked_in_save`` + ``prestep_wait``) and the busiest rank's *background*
CPU seconds (capture, CRC, writes). ``δ = blocked + w · background`` where ``w`` (``--cpu-weight``,
default 1) is how much training a background CPU second costs: 1 when training uses every core
(an upper bound), 0 when it leaves cores idle (GPU jobs usually do). Medians over the checkpoints
read, so one slow first save (warm-up) does not count.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from .history import CheckpointRun

__all__ = ["Advice", "Inputs", "advise", "daly", "parse_duration", "waste", "young"]

_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds of ``"8h"``, ``"90m"``, ``"2d"``, ``"45s"``, ``"1h30m"`` or a plain number of seconds."""
    t = text.strip().lower()
    try:
        v = float(t)
    except ValueError:
        parts = re.findall(r"(\d+(?:\.\d+)?)\s*(min|s|m|h|d|w)", t)
        if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*(min|s|m|h|d|w)", "", t).strip():
            raise ValueError(f"{text!r} is not a duration (e.g. 8h, 90m, 2d, 1h30m, 3600)") from None
        v = sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{text!r}: a duration must be positive")
    return v


def young(delta: float, mtbf: float) -> float:
    """Young's interval ``sqrt(2 δ M)`` (seconds of training between checkpoints)."""
    return math.sqrt(2.0 * delta * mtbf)


def daly(delta: float, mtbf: float) -> float:
    """Daly's higher-order interval (see the module docstring); ``M`` when ``δ >= 2M``."""
    if delta >= 2.0 * mtbf:
        return mtbf
    r = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - delta


def waste(tau: float, delta: float, mtbf: float, restart: float = 0.0) -> float:
    """Fraction of wall time lost (checkpoints, rework, restarts) at interval ``tau`` (Daly's model)."""
    return mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf) / tau - 1.0


@dataclass
class Inputs:
    """What the history says one checkpoint costs (seconds, medians over ``checkpoints``)."""

    checkpoints: list[str]
    ranks: int
    blocked_s: float
    background_cpu_s: float
    safe_s: float | None  # save start until committed on the first tier (slowest rank)
    interval_s: float | None  # between consecutive saves' starts (wall), restarts excluded
    s_per_step: float | None  # over consecutive saves of one process (restarts excluded)
    restarts: int = 0  # saves that a new process made after an earlier one's (CheckpointRun.restarted_after)

    @classmethod
    def from_runs(cls, runs: list[CheckpointRun]) -> Inputs:
        runs = [r for r in runs if not r.failed]
        if not runs:
            raise ValueError("no committed checkpoint in the history")
        blocked = [max(x.seconds("blocked_in_save") + x.seconds("prestep_wait") for x in r.ranks) for r in runs]
        cpu = [max(x.stats.get("cpu_s", 0.0) for x in r.ranks) for r in runs]
        safe = [
            max(c.end for x in r.ranks for c in x.phases if c.name == "commit") - r.start
            for r in runs
            if all(any(c.name == "commit" for c in x.phases) for x in r.ranks)
        ]
        # Consecutive saves of one process only: the time between the last save before a restart
        # (a crash, a kill, a requeue) and the first after it is no training.
        pairs = [(a, b) for a, b in zip(runs, runs[1:]) if not b.restarted_after(a)]
        gaps = [b.start - a.start for a, b in pairs]
        stepped = [
            (b.start - a.start, b.step - a.step)
            for a, b in pairs
            if a.step is not None and b.step is not None and b.step > a.step
        ]
        per_step = None
        if stepped:
            per_step = sum(dt for dt, _ in stepped) / sum(ds for _, ds in stepped)
        return cls(
            [r.checkpoint_id for r in runs],
            max(len(r.ranks) for r in runs),
            statistics.median(blocked),
            statistics.median(cpu),
            statistics.median(safe) if safe else None,
            statistics.median(gaps) if gaps else None,
            per_step if per_step and per_step > 0 else None,
            sum(1 for a, b in zip(runs, runs[1:]) if b.restarted_after(a)),
        )


@dataclass
class Advice:
    """The advised interval and how it was found (see :func:`advise`)."""

    inputs: Inputs
    mtbf_s: float
    cpu_weight: float
    restart_s: float
    delta_s: float
    young_s: float
    daly_s: float
    waste_at_daly: float
    waste_now: float | None
    daly_blocked_only_s: float

    @property
    def steps(self) -> int | None:
        """The Daly interval in steps, at the measured seconds per step."""
        sps = self.inputs.s_per_step
        return max(1, round(self.daly_s / sps)) if sps else None

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "inputs"}
        return dict(d, inputs=dict(self.inputs.__dict__), steps=self.steps)


def advise(runs: list[CheckpointRun], mtbf: float, cpu_weight: float = 1.0, restart: float = 0.0) -> Advice:
    """The Young and Daly intervals for the checkpoints in ``runs`` (see the module docstring)."""
    if not 0.0 <= cpu_weight <= 1.0:
        raise ValueError(f"cpu weight must be between 0 and 1, got {cpu_weight}")
    inp = Inputs.from_runs(runs)
    delta = inp.blocked_s + cpu_weight * inp.background_cpu_s
    delta = max(delta, 1e-6)  # a checkpoint never costs nothing (the formulas need δ > 0)
    tau = daly(delta, mtbf)
    now = None
    if inp.interval_s:
        now_tau = max(inp.interval_s - delta, 1e-6)
        now = waste(now_tau, delta, mtbf, restart)
    return Advice(
        inp,
        mtbf,
        cpu_weight,
        restart,
        delta,
        young(delta, mtbf),
        tau,
        waste(tau, delta, mtbf, restart),
        now,
        daly(max(inp.blocked_s, 1e-6), mtbf),
    )
