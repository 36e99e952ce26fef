"""``push``: promote what a later tier lacks (the backlog an outage left), then apply retention."""

from __future__ import annotations

import argparse
import logging

from .errors import EXIT_OTHER
from .fmt import add_json, print_json

log = logging.getLogger("tierckpt.restore")

EPILOG = """examples:
  tierckpt-restore push                # after an S3 outage: copy what S3 lacks, then retention
  tierckpt-restore push --tier s3 --no-gc --json
"""


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "push",
        parents=parents,
        help="copy to S3 the checkpoints it lacks (after an outage), then apply retention",
        description="Copy to every later tier (S3) the committed checkpoints of the first tier that it "
        "should have and lacks (newer than its newest, and its keep_every milestones), as a job "
        "does before its next copy: the same leases and commit protocol (metadata last), so it is "
        "safe while a job runs. With a node-local [local] path ({node}) every node directory "
        "readable here contributes its ranks' files: a checkpoint whose ranks wrote on several "
        "nodes is pushed once every data file is found (with its recorded size); otherwise nothing "
        "of it is copied and the missing ranks and the node directories that could not be read "
        "are named. Then applies retention on every tier, as gc does. Exits 3 when something "
        "could not be pushed (the tier is still down, a node directory unreadable: run it again "
        "later, or where every node directory can be read).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tier", choices=("s3",), help="only to this tier (default: every later tier)")
    p.add_argument("--no-gc", dest="gc", action="store_false", help="do not apply retention afterwards")
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .manage import push_checkpoints  # on use: --help and the other commands do not pay for its imports

    res = push_checkpoints(args.config, tier=args.tier, gc=args.gc)
    for node, why in (res.hops[0].unreadable if res.hops else {}).items():
        log.warning("node %s could not be read, nothing was copied from it: %s", node, why)
    if args.json:
        print_json(res.to_json())
        return 0 if res.ok else EXIT_OTHER
    for h in res.hops:
        if h.error:
            print(f"{h.tier} ({h.url}): could not push: {h.error}")
            continue
        if not h.needed:
            print(f"{h.tier} ({h.url}): nothing to push (it holds everything it should)")
        elif h.promoted:
            print(f"{h.tier} ({h.url}): pushed {len(h.promoted)} checkpoint(s): {', '.join(h.promoted)}")
        for cid, why in h.failed.items():
            print(f"{h.tier} ({h.url}): {cid} not pushed: {why}")
    if res.gc is not None:
        gone = [a for a in res.gc.actions if a.deleted]
        if gone:
            print("retention deleted: " + ", ".join(f"{a.checkpoint_id} ({a.tier})" for a in gone))
    return 0 if res.ok else EXIT_OTHER
