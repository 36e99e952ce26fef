"""``list``: every checkpoint on every tier."""

from __future__ import annotations

import argparse
import logging
import time

from .catalog import as_config, open_tiers, survey
from .errors import classify
from .fmt import add_json, add_tier, human_age, human_size, print_json, table

EPILOG = """examples:
  tierckpt-restore list
  tierckpt-restore --config tiers.toml list --tier s3
  tierckpt-restore list --json | jq -r '.[] | select(.committed) | .checkpoint_id'
  tierckpt-restore list --strict || echo "a tier could not be read"
"""

log = logging.getLogger("tierckpt.restore")


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "list",
        parents=parents,
        help="list checkpoints on every tier",
        description="List every checkpoint on every configured tier: id, step, committed or partial "
        "per tier, STORED (the bytes it occupies on a tier: data files as stored there, compressed "
        "where the tier compresses, plus its metadata; verify reports the logical data size, as "
        "saved, without metadata), number of rank files, age (since commit, or last write). With a "
        "node-local [local] path ({node}) every node directory readable here is listed "
        "(as 'latest' sees them) and a NODES column says which nodes hold each checkpoint; "
        "a node directory that cannot be read is named in a warning. "
        "A tier that cannot be read (S3 down, no credentials) is named in a warning and the "
        "other tiers are listed; the exit status is 0 unless --strict.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_json(p)
    add_tier(p)
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit non-zero (the tier's error status: 2 credentials, 3 storage) when a tier could not be read",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = as_config(args.config)
    tiers = open_tiers(cfg, args.tier)
    try:
        found = survey(cfg, tiers)
    finally:
        for t in tiers:
            t.close()
    if found.unreadable and len(found.unreadable) == len(tiers):
        raise next(iter(found.unreadable.values()))  # nothing answered: the error itself, as 'latest'
    status = 0
    for name, err in found.unreadable.items():
        msg, code = classify(err)
        status = status or code
        log.warning(
            "tier %s (%s) could not be read, its checkpoints are not listed: %s", name, found.urls.get(name, "?"), msg
        )
    for node, (url, err) in found.unreadable_nodes.items():
        msg, code = classify(err)
        status = status or code
        log.warning("node %s (%s) could not be read, its checkpoints are not listed: %s", node, url, msg)
    listings = found.listings
    now = time.time()
    if args.json:
        print_json([l.to_json(now) for l in listings])
    else:
        _print_table(listings, [t for t in tiers if t.name not in found.unreadable], now)
    return status if args.strict else 0


def _print_table(listings: list, tiers: list, now: float) -> None:
    """The table for people: a column per tier that was read (``tiers``), NODES and PEER COPIES when
    any checkpoint has them."""
    if not listings:
        print("no checkpoints on " + ", ".join(f"{t.name} ({t.url})" for t in tiers))
        return
    names = [t.name for t in tiers]
    any_peer = any(e.peer_copies for l in listings for e in l.tiers.values())
    any_nodes = any(e.nodes for l in listings for e in l.tiers.values())
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
        held = {n: st for e in l.tiers.values() for n, st in e.nodes.items()}
        nodes = (
            [",".join(n if st == "committed" else f"{n}(partial)" for n, st in sorted(held.items())) or "-"]
            if any_nodes
            else []
        )
        rows.append(
            [
                l.checkpoint_id,
                "-" if l.step is None else l.step,
                *states,
                *nodes,
                *peer,
                human_size(best.size),
                files,
                human_age(now - l.newest),
            ]
        )
    print(
        table(
            [
                "ID",
                "STEP",
                *(n.upper() for n in names),
                *(["NODES"] if any_nodes else []),
                *(["PEER COPIES"] if any_peer else []),
                "STORED",
                "FILES",
                "AGE",
            ],
            rows,
        )
    )
