"""The timeline picture: each checkpoint's phases on each rank against wall time (matplotlib).

:func:`draw` takes the saves of the phase history (:func:`tierckpt.telemetry.history.group_checkpoints`)
and writes one PNG (or any format matplotlib knows by the file's suffix):

* one band per rank, one lane per phase kind inside it (``blocked_in_save``, ``prestep_wait``,
  ``capture``, ``flush``, ``commit``, then each hop in chain order); every checkpoint's phases
  on the same wall-clock axis, so a hop that outlasts the save interval shows as bars of
  consecutive checkpoints overlapping in its lane;
* time the training thread waited is red/orange and hatched; a phase that failed has a black
  hatched edge; a dotted line and the id mark where each checkpoint started;
* idle stretches between checkpoints more than 8 times longer than the longest stretch of
  activity (a job that saves every 30 minutes) are shortened to a marked gap saying how long they were, so that the
  phases stay visible; every tick label still reads real seconds since the first phase.

Uses matplotlib's object API (``matplotlib.figure.Figure``): no pyplot, no global backend change,
safe inside a training process or a benchmark. matplotlib is an optional extra
(``pip install "tierckpt[plot]"``); without it :func:`draw` raises ImportError saying so.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .history import CheckpointRun

__all__ = ["COLORS", "TimeMap", "draw", "lane_kinds"]

COLORS = {
    "blocked_in_save": "#d62728",
    "prestep_wait": "#ff7f0e",
    "capture": "#1f77b4",
    "flush": "#2ca02c",
    "commit": "#9467bd",
    "load": "#d62728",
    "fill": "#7f7f7f",
}
_HOP_COLORS = ("#17becf", "#8c564b", "#e377c2", "#bcbd22", "#7f7f7f")
_ORDER = ("blocked_in_save", "prestep_wait", "capture", "flush", "commit")
MAX_RANKS = 8
"""Ranks drawn when none are chosen (the first ones)."""


def lane_kinds(runs: list[CheckpointRun]) -> list[str]:
    """The phase names present, in drawing order (hops in the order they first appear)."""
    seen: list[str] = []
    for run in runs:
        for r in run.ranks:
            for p in r.phases:
                if p.name not in seen:
                    seen.append(p.name)
    fixed = [k for k in _ORDER if k in seen]
    return fixed + [k for k in seen if k not in fixed]


def _color(kind: str, kinds: list[str]) -> str:
    if kind in COLORS:
        return COLORS[kind]
    hops = [k for k in kinds if k.startswith("hop:")]
    return _HOP_COLORS[hops.index(kind) % len(_HOP_COLORS)] if kind in hops else "#7f7f7f"


@dataclass
class TimeMap:
    """Real seconds (since the first phase) to x positions, with long idle gaps shortened.

    ``pieces``: (real start, x start, slope), sorted; ``gaps``: the shortened gaps (real start,
    real end). Activity is drawn at slope 1; a gap longer than ``factor`` times the longest
    stretch of continuous activity becomes ``0.6`` times that stretch wide."""

    pieces: list[tuple[float, float, float]]
    gaps: list[tuple[float, float]]

    @classmethod
    def build(cls, intervals: list[tuple[float, float]], factor: float = 8.0) -> TimeMap:
        merged: list[list[float]] = []
        for a, b in sorted(intervals):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        longest = max((b - a for a, b in merged), default=1.0) or 1.0
        long_gaps = [(b0, a1) for (_a0, b0), (a1, _b1) in zip(merged, merged[1:]) if a1 - b0 > factor * longest]
        kept = (merged[-1][1] - merged[0][0] if merged else 0.0) - sum(b - a for a, b in long_gaps)
        width = max(0.6 * longest, 0.05 * kept)  # wide enough to read its label among many checkpoints
        pieces: list[tuple[float, float, float]] = [(0.0, 0.0, 1.0)]
        gaps: list[tuple[float, float]] = []
        x_of = lambda t: cls(pieces, gaps).x(t)  # noqa: E731
        for (_a0, b0), (a1, _b1) in zip(merged, merged[1:]):
            if a1 - b0 > factor * longest:
                gaps.append((b0, a1))
                xb = x_of(b0)
                pieces.append((b0, xb, width / (a1 - b0)))
                pieces.append((a1, xb + width, 1.0))
        return cls(pieces, gaps)

    def x(self, t: float) -> float:
        i = max(0, bisect.bisect_right([p[0] for p in self.pieces], t) - 1)
        t0, x0, slope = self.pieces[i]
        return x0 + (t - t0) * slope

    def real(self, x: float) -> float | None:
        """The real time at ``x``; None inside a shortened gap."""
        i = max(0, bisect.bisect_right([p[1] for p in self.pieces], x) - 1)
        t0, x0, slope = self.pieces[i]
        if slope != 1.0:
            return None
        return t0 + (x - x0)


def _fmt(seconds: float) -> str:
    s = abs(seconds)
    if s < 1e-9:
        return "0"
    if s >= 3600:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    if s >= 120:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    if s >= 10:
        return f"{s:.0f}s"
    return f"{s:.2g}s" if s >= 0.01 else f"{s * 1e3:.2g}ms"


def _matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter, MaxNLocator
    except ImportError as e:
        raise ImportError(
            f'drawing the timeline needs matplotlib ({e}); install it with: pip install "tierckpt[plot]"'
        ) from None
    return Figure, Patch, FuncFormatter, MaxNLocator


def draw(runs: list[CheckpointRun], out: str | Path, *, ranks: list[int] | None = None, title: str = "") -> dict:
    """Draw ``runs`` (oldest first) into ``out``; ``ranks``: which ranks (default: the first
    :data:`MAX_RANKS`). Returns what was drawn: ``{"checkpoints", "ranks", "all_ranks", "gaps", "restarts", "labelled"
    (checkpoint names written), "xticks" (the axis labels), "out"}``."""
    Figure, Patch, FuncFormatter, MaxNLocator = _matplotlib()
    if not runs:
        raise ValueError("no checkpoints to draw")
    all_ranks = sorted({r.rank for run in runs for r in run.ranks})
    drawn = [r for r in (ranks if ranks is not None else all_ranks[:MAX_RANKS]) if r in all_ranks]
    if not drawn:
        raise ValueError(f"none of ranks {ranks} is in the history (ranks there: {all_ranks})")
    kinds = lane_kinds(runs)
    t0 = min(run.start for run in runs)
    tmap = TimeMap.build(
        [(p.start - t0, p.end - t0) for run in runs for r in run.ranks if r.rank in drawn for p in r.phases]
    )
    x_end = max(tmap.x(run.end - t0) for run in runs)
    min_w = 0.002 * max(x_end, 1e-6)
    lanes: dict[tuple[int, str], float] = {}
    labels: list[tuple[float, str]] = []
    y = 0.0
    for rank in drawn:
        for k in kinds:
            lanes[(rank, k)] = y
            labels.append((y, f"r{rank} {k}"))
            y -= 1.0
        y -= 0.7
    seps = [lanes[(rank, kinds[0])] + 0.85 for rank in drawn[1:]]
    fig = Figure(figsize=(13, 1.6 + 0.23 * len(lanes) + 0.1 * len(drawn)), layout="constrained")
    ax = fig.add_subplot()
    for run in runs:
        for r in run.ranks:
            if r.rank not in drawn:
                continue
            for p in r.phases:
                xa, xb = tmap.x(p.start - t0), tmap.x(p.end - t0)
                style: dict[str, Any] = {"color": _color(p.name, kinds), "edgecolor": "white", "linewidth": 0.6}
                if p.blocked:
                    style.update(hatch="////", edgecolor="#5a0000", linewidth=0.4)
                if p.error:
                    style.update(hatch="xx", edgecolor="black", linewidth=1.0)
                ax.barh(lanes[(r.rank, p.name)], max(xb - xa, min_w), left=xa, height=0.8, **style)
    # Checkpoint names: vertical when many; one at most every 1/45 of the axis (the others keep their line).
    label_gap = x_end / 45 if len(runs) > 12 else 0.0
    last_label = -math.inf
    labelled = 0
    for run in runs:
        xs = tmap.x(run.start - t0)
        ax.axvline(xs, color="#555555", linestyle=":", linewidth=0.8)
        if xs - last_label < label_gap:
            continue
        last_label = xs
        labelled += 1
        ax.text(
            xs,
            1.005,
            run.checkpoint_id + (" (failed)" if run.failed else ""),
            transform=ax.get_xaxis_transform(),
            fontsize=7 if len(runs) <= 12 else 6,
            rotation=0 if len(runs) <= 6 else 30 if len(runs) <= 12 else 90,
            ha="left" if len(runs) <= 12 else "center",
            va="bottom",
        )
    restarts = [(a.end - t0, b.start - t0) for a, b in zip(runs, runs[1:]) if b.restarted_after(a)]
    for a, b in restarts:
        xb = tmap.x(b)
        ax.axvline(xb, color="#b00000", linewidth=1.4)
        if any(ga <= b and gb >= a for ga, gb in tmap.gaps):
            continue  # the shortened gap's label says it
        ax.text(
            xb,
            0.02,
            " restart",
            transform=ax.get_xaxis_transform(),
            fontsize=7,
            color="#b00000",
            ha="left",
            va="bottom",
            rotation=90,
        )
    for a, b in tmap.gaps:
        xa, xb = tmap.x(a), tmap.x(b)
        crash = any(ra <= b and rb >= a for ra, rb in restarts)
        ax.axvspan(xa, xb, color="#f4dede" if crash else "#eeeeee", zorder=0)
        ax.text(
            (xa + xb) / 2,
            0.5,
            f"{'stopped, restarted' if crash else 'idle'} {_fmt(b - a)}",
            transform=ax.get_xaxis_transform(),
            rotation=90,
            ha="center",
            va="center",
            fontsize=8,
            color="#555555",
        )
    for s in seps:
        ax.axhline(s, color="#999999", linewidth=0.6)
    ax.set_yticks([p for p, _ in labels], [t for _, t in labels], fontsize=7)
    ax.set_ylim(y + 0.2, 0.8)
    ax.set_xlim(0, x_end * 1.01)
    ax.xaxis.set_major_locator(MaxNLocator(12))

    def tick(x: float, pos: Any) -> str:
        t = tmap.real(x)
        if t is None:
            return ""
        locs = ax.xaxis.get_majorticklocs()
        step = min((b - a for a, b in zip(locs, locs[1:]) if b > a), default=1.0)
        if t < 120 and step < 10:  # as many decimals as the spacing needs: no "33s 33s 33s"
            return f"{t:.{max(0, 1 - math.floor(math.log10(step)))}f}s"
        return _fmt(t)

    ax.xaxis.set_major_formatter(FuncFormatter(tick))
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    start = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0))
    ax.set_xlabel(
        f"wall time since {start}"
        + ("; long idle gaps shortened (shaded)" if tmap.gaps else "")
        + ("; red line: a new process (the job restarted)" if restarts else "")
    )
    shown = f"ranks {', '.join(map(str, drawn))}" + (f" of {len(all_ranks)}" if len(drawn) < len(all_ranks) else "")
    fig.suptitle(
        title
        or f"tierckpt timeline: {len(runs)} checkpoint(s), {runs[0].checkpoint_id} to "
        f"{runs[-1].checkpoint_id}; {shown}",
        fontsize=10,
    )
    handles = [Patch(color=_color(k, kinds), label=k) for k in kinds]
    handles.append(Patch(facecolor="white", edgecolor="#5a0000", hatch="////", label="training thread waits"))
    if any(p.error for run in runs for r in run.ranks for p in r.phases):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="xx", label="failed"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.002, 1.0), fontsize=7, frameon=False)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return {
        "checkpoints": [run.checkpoint_id for run in runs],
        "ranks": drawn,
        "all_ranks": all_ranks,
        "gaps": [b - a for a, b in tmap.gaps],
        "restarts": len(restarts),
        "labelled": labelled,
        "xticks": [t.get_text() for t in ax.get_xticklabels() if t.get_text()],
        "out": str(out),
    }
