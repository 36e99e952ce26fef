"""``delete``: remove checkpoints, or a whole run, from every tier."""

from __future__ import annotations

import argparse
import logging
import sys

from .errors import EXIT_FAILED
from .fmt import add_json, add_tier, checkpoint_ref, human_size, print_json, table

log = logging.getLogger("tierckpt.restore")

EPILOG = """examples:
  tierckpt-restore delete step-000300             # asks before deleting
  tierckpt-restore delete --all --yes             # a fresh start: the next run may reuse step-0
  tierckpt-restore delete latest --tier local --yes
"""


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "delete",
        parents=parents,
        help="delete checkpoints (or --all of them) from every tier",
        description="Delete checkpoints from every tier (or --tier), committed or partial: the metadata "
        "first, then the data files, under the lease protocol: a checkpoint that a process is "
        "loading, fetching or still writing is left alone and reported (exit 1; run again once "
        "it is done), and a job that starts writing the same id meanwhile waits for the deletion "
        "to finish. Asks for confirmation (on stdin) unless --yes. Use --all before rerunning a "
        "job from scratch: its step-0 commit otherwise fails with CommitConflict. With a node-local "
        "[local] path ({node}) every node directory readable here is deleted from; one that cannot "
        "be read is named (exit 1: delete there from a host that can read it).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoints", nargs="*", metavar="ID|latest", type=checkpoint_ref, help="checkpoints to delete")
    p.add_argument("--all", dest="every", action="store_true", help="every checkpoint (the whole run)")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    add_json(p)
    add_tier(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .errors import UsageError
    from .manage import delete_checkpoints, plan_delete  # on use

    if bool(args.checkpoints) == args.every:
        raise UsageError("delete: name the checkpoints to delete, or --all (not both)")
    plan = plan_delete(args.config, args.checkpoints, every=args.every, tier=args.tier)
    for name, why in plan.unreadable.items():
        log.warning("%s could not be read, nothing is deleted there: %s", name, why)
    if not args.yes:
        rows = [
            [t, cid, human_size(size), "committed" if c else "partial"]
            for t, v in plan.targets.items()
            for cid, size, c in v
        ]
        print(table(["TIER", "ID", "SIZE", "STATE"], rows), file=sys.stderr)
        print(
            f"delete {len(plan.ids)} checkpoint(s) from {', '.join(plan.targets)}? [y/N] ",
            end="",
            file=sys.stderr,
            flush=True,
        )
        answer = sys.stdin.readline().strip().lower()
        if answer not in ("y", "yes"):
            print("nothing deleted", file=sys.stderr)
            return EXIT_FAILED
    res = delete_checkpoints(args.config, args.checkpoints, every=args.every, tier=args.tier)
    if args.json:
        print_json(res.to_json())
    else:
        for t, ids in res.deleted.items():
            if ids:
                print(f"deleted from {t}: {', '.join(ids)}")
        for t, ids in res.in_use.items():
            print(f"in use on {t} (not deleted): {', '.join(ids)}")
        for t in res.unreadable:
            print(f"not read, nothing deleted there: {t}")
    return 0 if res.ok else EXIT_FAILED
