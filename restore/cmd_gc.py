"""``gc``: apply retention now on every tier."""

from __future__ import annotations

import argparse

from .fmt import add_json, add_tier, human_size, print_json, table

EPILOG = """examples:
  tierckpt-restore gc --dry-run        # what would go, and why
  tierckpt-restore gc                  # delete it
  tierckpt-restore gc --tier local --json
"""


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gc",
        parents=parents,
        help="apply retention now (delete old and stale checkpoints)",
        description="Apply the retention policy now on every tier: [local] keep, [s3] keep and "
        "keep_every (0 keeps all). Also removes partial checkpoints older than the start "
        "of the newest committed one, and leftovers of interrupted writes (on S3 stale multipart "
        "uploads, on a local tier half-written files of killed processes such as a "
        "peer copy whose receiver died). The newest "
        "committed checkpoint of a tier is never deleted.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dry-run", "-n", action="store_true", help="only print what would be deleted")
    add_json(p)
    add_tier(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .gc import gc_checkpoints  # on use: --help and the other commands do not pay for its imports

    res = gc_checkpoints(args.config, dry_run=args.dry_run, tier=args.tier)
    if args.json:
        print_json(res.to_json())
        return 0
    if not res.actions:
        print("nothing to delete")
    else:
        verb = "would delete" if res.dry_run else "deleted"
        print(
            table(
                ["", "TIER", "ID", "SIZE", "WHY"],
                [
                    [
                        verb if (res.dry_run or a.deleted) else "kept",
                        a.tier,
                        a.checkpoint_id,
                        human_size(a.size),
                        a.reason,
                    ]
                    for a in res.actions
                ],
            )
        )
    if res.aborted_uploads:
        print(
            f"removed {res.aborted_uploads} leftover(s) of interrupted writes (stale multipart uploads, "
            "half-written files of killed processes)"
        )
    return 0
