"""``verify``: check every byte of a committed checkpoint on each tier holding it."""

from __future__ import annotations

import argparse

from .errors import VerificationFailed
from .fmt import add_json, add_tier, checkpoint_ref, human_size, print_json

EPILOG = """examples:
  tierckpt-restore verify latest
  tierckpt-restore verify step-000300 --tier s3
  tierckpt-restore verify latest --json > report.json || echo "checkpoint is damaged"
"""


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "verify",
        parents=parents,
        help="check sizes and CRC32C of a checkpoint on every tier",
        description="Check a committed checkpoint on every tier holding it: metadata, the size of "
        "every data file, and the CRC32C of every byte (files are read in large "
        "sequential ranges). Sizes are logical (the data files as saved, decoded where the tier "
        "compresses, metadata not counted); list shows what is stored. Prints what is bad "
        "(tier, file, item) and exits 1 on any problem.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="ID|latest", type=checkpoint_ref, help="checkpoint id, or 'latest'")
    add_json(p)
    add_tier(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .verify import verify_checkpoint  # on use: --help and the other commands do not pay for its imports

    rep = verify_checkpoint(args.config, args.checkpoint, tier=args.tier, progress=not args.quiet)
    if args.json:
        print_json(rep.to_json())
    else:
        for t in rep.tiers:
            state = "OK" if t.ok else f"{len(t.problems)} problem(s)"
            absent = f", {len(t.absent)} file(s) not on this tier" if t.absent else ""
            print(
                f"{rep.checkpoint_id} on {t.tier} ({t.url}): {t.files_checked} file(s), "
                f"{human_size(t.bytes_checked)} of data checked (logical size, as saved){absent}: {state}"
            )
            for p in t.problems:
                print(f"  BAD {p.describe()}")
        for p in rep.problems:
            if not any(p in t.problems for t in rep.tiers):
                print(f"  BAD {p.describe()}")
    if not rep.ok:
        raise VerificationFailed(f"checkpoint {rep.checkpoint_id} failed verification: {len(rep.problems)} problem(s)")
    return 0
