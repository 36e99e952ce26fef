"""``timeline``: draw each checkpoint's phases on each rank against wall time."""

from __future__ import annotations

import argparse

from tierckpt.telemetry.history import CheckpointRun

from .catalog import as_config
from .errors import UsageError
from .fmt import add_json, print_json, table
from .history import load_runs

EPILOG = """examples:
  tierckpt-restore timeline                          # the last 5 checkpoints into timeline.png
  tierckpt-restore timeline --last 20 --out ckpt.png --ranks 0,1,7
  tierckpt-restore timeline --json                   # the phases as JSON (no picture)

needs matplotlib: pip install "tierckpt[plot]"
"""


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "timeline",
        parents=parents,
        help="draw the phases of the last checkpoints (PNG)",
        description="Draw, for the last checkpoints saved, each phase (blocked in save, pre-step wait, "
        "capture, flush, commit, each hop of the chain) on each rank against wall time, from "
        "the history each rank keeps in _history/ on its local tier (other nodes' too when "
        "their directories are readable here). Prints a table of the same checkpoints.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--last", type=int, default=5, metavar="N", help="the N newest checkpoints (default 5; 0: all kept)")
    p.add_argument("--out", default="timeline.png", metavar="PATH", help="picture to write (default timeline.png)")
    p.add_argument("--ranks", default=None, metavar="R,R,...", help="ranks to draw (default: the first 8)")
    add_json(p)
    p.set_defaults(func=run)


def _ranks(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--ranks {text!r}: expected rank numbers separated by commas") from None


def _row(run: CheckpointRun, before: CheckpointRun | None) -> list[str]:
    def worst(name: str) -> float:
        return max(r.seconds(name) for r in run.ranks)

    hops = sorted({p.name for r in run.ranks for p in r.phases if p.tier is not None})
    cells = [f"{worst(n):.3f}" for n in ("blocked_in_save", "prestep_wait", "capture", "flush", "commit")]
    return [
        run.checkpoint_id,
        str(len(run.ranks)),
        *cells,
        " ".join(f"{h[4:]}={worst(h):.2f}" for h in hops) or "-",
        f"{run.end - run.start:.2f}",
        ("failed" if run.failed else "ok")
        + (f", copy to {', '.join(run.copies_failed)} failed" if run.copies_failed and not run.failed else "")
        + (", job restarted before it" if before and run.restarted_after(before) else ""),
    ]


def run(args: argparse.Namespace) -> int:
    if args.last < 0:
        raise UsageError(f"--last {args.last}: must not be negative")
    ranks = _ranks(args.ranks)
    runs, _places = load_runs(as_config(args.config), args.last or None)
    present = sorted({x.rank for r in runs for x in r.ranks})
    if ranks is not None and not set(ranks) & set(present):
        raise UsageError(f"--ranks {args.ranks}: no such rank in the history (ranks there: {present})")
    if args.json:
        print_json(
            [
                {
                    "id": r.checkpoint_id,
                    "token": r.token,
                    "step": r.step,
                    "restarted": bool(i and r.restarted_after(runs[i - 1])),
                    "ranks": [x.to_json() for x in r.ranks],
                }
                for i, r in enumerate(runs)
            ]
        )
        return 0
    print(
        table(
            ["ID", "RANKS", "BLOCKED", "PRESTEP", "CAPTURE", "FLUSH", "COMMIT", "HOPS", "TOTAL", ""],
            [_row(r, runs[i - 1] if i else None) for i, r in enumerate(runs)],
        )
    )
    print("(seconds, slowest rank; CAPTURE and FLUSH count from the start of the save)")
    from tierckpt.telemetry.timeline import draw

    try:
        got = draw(runs, args.out, ranks=ranks)
    except ImportError as e:
        raise UsageError(str(e)) from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    shown = "" if len(got["ranks"]) == len(got["all_ranks"]) else f" (ranks {got['ranks']} of {len(got['all_ranks'])})"
    restarts = f", {got['restarts']} restart(s) of the job (red lines)" if got["restarts"] else ""
    print(f"wrote {got['out']}: {len(runs)} checkpoint(s){shown}{restarts}")
    return 0
