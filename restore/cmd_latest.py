"""``latest``: the newest committed checkpoint over all tiers."""

from __future__ import annotations

import argparse

from .catalog import as_config, find_latest, find_latest_here, open_tiers
from .fmt import add_json, add_tier, print_json

EPILOG = """examples:
  tierckpt-restore latest                     # prints e.g. step-000300; exit status 1 if none
  CKPT=$(tierckpt-restore latest) && echo "resuming from $CKPT"
  tierckpt-restore latest --json
"""


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "latest",
        parents=parents,
        help="print the newest committed checkpoint id",
        description="Print the id of the newest committed checkpoint over all tiers (the one "
        "TieredReader loads for 'latest'; tiers are compared by the commit order in the "
        "metadata). With a node-local [local] path ({node}) the other nodes' directories "
        "readable here count too, as in a distributed load: the newest checkpoint whose "
        "every file this node, another node (peer copies included) or S3 holds. Exit "
        "status 1 when no tier holds a committed checkpoint.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_json(p)
    add_tier(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = as_config(args.config)
    tiers = open_tiers(cfg, args.tier)
    try:
        latest = find_latest(tiers) if args.tier else find_latest_here(cfg, tiers)
    finally:
        for t in tiers:
            t.close()
    if args.json:
        print_json(latest.to_json())
    else:
        print(latest.checkpoint_id)
    return 0
