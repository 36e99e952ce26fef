"""``list``: every checkpoint on every tier."""

from __future__ import annotations

import argparse
import time

from .catalog import as_config, list_all, open_tiers
from .fmt import add_json, add_tier, human_age, human_size, print_json, table

EPILOG = """examples:
  tierckpt-restore list
  tierckpt-restore --config tiers.toml list --tier s3
  tierckpt-restore list --json | jq -r '.[] | select(.committed) | .checkpoint_id'
"""


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "list",
        parents=parents,
        help="list checkpoints on every tier",
        description="List every checkpoint on every configured tier: id, step, committed or partial "
        "per tier, size, number of rank files, age (since commit, or last write).",
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
        listings = list_all(tiers)
    finally:
        for t in tiers:
            t.close()
    now = time.time()
    if args.json:
        print_json([l.to_json(now) for l in listings])
        return 0
    if not listings:
        print("no checkpoints on " + ", ".join(f"{t.name} ({t.url})" for t in tiers))
        return 0
    names = [t.name for t in tiers]
    any_peer = any(e.peer_copies for l in listings for e in l.tiers.values())
    rows = []
    for l in listings:
        best = l.best()
        counts = {e.rank_files for e in l.tiers.values()}
        files = (
            str(best.rank_files)
            if len(counts) == 1
            else "/".join(str(l.tiers[n].rank_files) if n in l.tiers else "-" for n in names)
        )
        states = [
            ("committed" + (", bad" if l.tiers[n].bad else "") if l.tiers[n].committed else "partial")
            if n in l.tiers
            else "-"
            for n in names
        ]
        peer = ["yes" if any(e.peer_copies for e in l.tiers.values()) else "-"] if any_peer else []
        rows.append(
            [
                l.checkpoint_id,
                "-" if l.step is None else l.step,
                *states,
                *peer,
                human_size(best.size),
                files,
                human_age(now - l.newest),
            ]
        )
    print(
        table(
            ["ID", "STEP", *(n.upper() for n in names), *(["PEER COPIES"] if any_peer else []), "SIZE", "FILES", "AGE"],
            rows,
        )
    )
    return 0
