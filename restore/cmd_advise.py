"""``advise``: how often to checkpoint, from the job's measured costs and a failure rate (Young/Daly)."""

from __future__ import annotations

import argparse

from tierckpt.telemetry.advise import Advice, advise, parse_duration

from .catalog import as_config
from .errors import UsageError
from .fmt import add_json, print_json
from .history import load_runs

EPILOG = """examples:
  tierckpt-restore advise --mtbf 8h
  tierckpt-restore advise --mtbf 2d --cpu-weight 0 --restart 5m     # GPU job: background CPU is free
  tierckpt-restore advise --mtbf 8h --json
"""


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "advise",
        parents=parents,
        help="the checkpoint interval minimising expected lost time",
        description="Print the checkpoint interval that minimises the expected time lost to checkpoints "
        "and failures (Young's and Daly's formulas), from the job's measured cost per "
        "checkpoint (its history in _history/: time training was blocked, CPU seconds of the "
        "background work) and the mean time between failures you give. Prints the formulas "
        "and every input.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--mtbf",
        type=_duration,
        required=True,
        metavar="DURATION",
        help="mean time between failures of the whole job (8h, 90m, 2d, or seconds)",
    )
    p.add_argument(
        "--cpu-weight",
        type=float,
        default=1.0,
        metavar="W",
        help="training seconds lost per background CPU second: 1 (default) when training uses every core, "
        "0 when it leaves cores idle",
    )
    p.add_argument(
        "--restart",
        type=_duration,
        default=0.0,
        metavar="DURATION",
        help="time to restart the job after a failure (only the expected loss depends on it; default 0)",
    )
    p.add_argument("--last", type=int, default=20, metavar="N", help="checkpoints to measure (default the 20 newest)")
    add_json(p)
    p.set_defaults(func=run)


def _t(s: float) -> str:
    if s >= 120:
        h, rem = divmod(round(s), 3600)
        return f"{s:.0f} s ({h}h{rem // 60:02d}m{rem % 60:02d}s)" if h else f"{s:.0f} s ({rem // 60}m{rem % 60:02d}s)"
    return f"{s:.3g} s"


def lines(a: Advice) -> list[str]:
    i = a.inputs
    out = [
        f"checkpoint interval advice from {len(i.checkpoints)} checkpoint(s) ({i.checkpoints[0]} .. "
        f"{i.checkpoints[-1]}), {i.ranks} rank(s)",
        "",
        "inputs:",
        f"  M   mean time between failures               {_t(a.mtbf_s)}   (--mtbf)",
        f"  B   blocked per checkpoint                   {_t(i.blocked_s)}   (median of the slowest rank's "
        "blocked_in_save + prestep_wait)",
        f"  C   background CPU per checkpoint            {_t(i.background_cpu_s)}   (median of the busiest rank's "
        "capture, CRC and write CPU seconds)",
        f"  w   training seconds per background CPU s    {a.cpu_weight:g}   (--cpu-weight)",
        f"  δ = B + w·C   cost of one checkpoint         {_t(a.delta_s)}",
        f"  R   restart time                             {_t(a.restart_s) if a.restart_s else '0 s'}   (--restart)",
    ]
    if i.safe_s is not None:
        out.append(f"      (a save is committed on the first tier {_t(i.safe_s)} after it starts)")
    if i.restarts:
        out.append(
            f"      ({i.restarts} restart(s) of the job among these checkpoints: the time across a restart "
            "is not counted as training)"
        )
    out += [
        "",
        "formulas (τ: seconds of training between checkpoints):",
        f"  Young  τ = sqrt(2·δ·M)                                     = {_t(a.young_s)}",
        f"  Daly   τ = sqrt(2·δ·M)·[1 + ⅓·sqrt(δ/2M) + ⅑·(δ/2M)] − δ  = {_t(a.daly_s)}",
        "  lost   waste(τ) = M·e^(R/M)·(e^((τ+δ)/M) − 1)/τ − 1",
        "",
    ]
    every = f"checkpoint every {_t(a.daly_s)} of training"
    if a.steps is not None and i.s_per_step:
        every += f" ≈ every {a.steps} steps (at the measured {i.s_per_step:.3g} s per step)"
    out.append(f"advice: {every}")
    out.append(f"  expected time lost at that interval: {100 * a.waste_at_daly:.2f}% of wall time")
    if a.waste_now is not None and i.interval_s:
        out.append(f"  at the current interval ({_t(i.interval_s)} between saves): {100 * a.waste_now:.2f}%")
    if a.cpu_weight:
        out.append(f"  if background CPU costs training nothing (w = 0): τ = {_t(a.daly_blocked_only_s)}")
    return out


def run(args: argparse.Namespace) -> int:
    if args.last < 1:
        raise UsageError(f"--last {args.last}: must be at least 1")
    if not 0.0 <= args.cpu_weight <= 1.0:
        raise UsageError(f"--cpu-weight {args.cpu_weight}: must be between 0 and 1")
    runs, _places = load_runs(as_config(args.config), args.last)
    try:
        a = advise(runs, args.mtbf, args.cpu_weight, args.restart)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print_json(a.to_json())
    else:
        print("\n".join(lines(a)))
    return 0
