"""``mark``: mark a checkpoint bad (or good again) on every tier that holds it."""

from __future__ import annotations

import argparse

from tierckpt.catalog.health import bad_key, mark_bad, read_mark
from tierckpt.format.layout import check_checkpoint_id

from .catalog import as_config, open_tiers
from .fmt import add_json, print_json

EPILOG = """examples:
  tierckpt-restore mark step-000300 bad --reason "loss spike at 290, diverged"
  tierckpt-restore mark step-000300 good      # remove the mark
"""


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "mark",
        parents=parents,
        help="mark a checkpoint bad (never resumed from) or good again",
        description="Mark a checkpoint bad: a small object (bad.json, with the reason, who and "
        "when) is written beside its metadata on every tier that holds it committed. "
        "tierckpt.latest(cfg, healthy=True), the integrations' resume and tierckpt.resume skip "
        "it; 'list' shows it; retention never keeps it as the newest checkpoint. 'good' removes "
        "the mark from every tier.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="the checkpoint id")
    p.add_argument("state", choices=("bad", "good"), help="bad: mark it; good: remove the mark")
    p.add_argument("--reason", default="", help="why (recorded in the mark)")
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cid = check_checkpoint_id(args.checkpoint)
    tiers = open_tiers(as_config(args.config))
    try:
        if args.state == "bad":
            done = mark_bad(tiers, cid, args.reason or "marked bad with tierckpt-restore mark")
        else:
            done = [t.name for t in tiers if read_mark(t, cid) is not None]
            for t in tiers:
                if t.name in done:
                    t.delete(bad_key(cid))
    finally:
        for t in tiers:
            t.close()
    if args.json:
        print_json({"checkpoint_id": cid, "state": args.state, "tiers": done})
    else:
        print(f"{cid}: marked {args.state} on {', '.join(done) or 'no tier (it had no mark)'}")
    return 0
