"""``fetch``: pull a committed checkpoint from other nodes or S3 into the local tier (resumable, verified)."""

from __future__ import annotations

import argparse
import logging

from .fmt import add_json, checkpoint_ref, human_size, print_json

EPILOG = """examples:
  tierckpt-restore fetch latest                      # the whole newest checkpoint (other nodes, then S3)
  tierckpt-restore fetch step-000300 --rank 0 --rank 1   # only what ranks 0 and 1 wrote
  tierckpt-restore fetch latest --quiet --json       # for scripts; rerun after a failure to resume
  tierckpt-restore fetch latest --node 0             # into node 0's directory ([local] path ".../{node}")
  TIERCKPT_NODE=n1 tierckpt-restore fetch latest --no-peers   # a replacement node, from S3 only
"""

log = logging.getLogger("tierckpt.restore")


MAX_RANK = (1 << 24) - 1
"""Largest rank accepted (checkpoints hold at most 2**24 ranks)."""


def rank_arg(value: str) -> int:
    """argparse type of ``--rank``: an integer in ``[0, MAX_RANK]``; refused before any tier is contacted."""
    text = value.strip()
    if len(text) > 12 or not text.lstrip("+-").isdigit() or not text.isascii():
        raise argparse.ArgumentTypeError(f"invalid rank {value[:40]!r}: expected a non-negative integer")
    rank = int(text)
    if not 0 <= rank <= MAX_RANK:
        raise argparse.ArgumentTypeError(f"invalid rank {rank}: ranks are integers from 0 to {MAX_RANK}")
    return rank


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "fetch",
        parents=parents,
        help="copy a checkpoint from other nodes or S3 to the local tier",
        description="Copy a committed checkpoint into the local tier with parallel ranged reads, "
        "verifying every CRC32C: from other nodes' directories readable here when the "
        "[local] path is node-local ({node}: their own files and peer copies), then from "
        "S3 (a range that fails on one source comes from the next; the output says where "
        "each file came from). Interrupted fetches resume where they stopped "
        "(run the same command again). Files already present and intact are skipped. "
        "metadata.json is written last, so the local copy becomes committed only when "
        "complete. With --rank only the files written by those ranks are fetched; the "
        "reader takes the other files from S3. With a node-local [local] path the "
        "checkpoint goes into the directory of --node (default: $TIERCKPT_NODE, else "
        "torchrun's $GROUP_RANK, else $NODE_RANK, else the host name: the directory a "
        "job started the same way reads); the output says which.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "checkpoint",
        metavar="ID|latest",
        type=checkpoint_ref,
        help="checkpoint id, or 'latest' (the newest the sources hold in full)",
    )
    p.add_argument(
        "--rank",
        type=rank_arg,
        action="append",
        metavar="R",
        help="fetch only the data file written by rank R, an integer >= 0 (repeatable)",
    )
    p.add_argument(
        "--no-peers",
        action="store_true",
        help="take every file from the shared tiers (S3), never from other nodes' directories",
    )
    p.add_argument(
        "--node",
        metavar="NAME",
        help='with [local] path ".../{node}": write into the directory of node NAME (torchrun\'s '
        "GROUP_RANK, e.g. 0); default: TIERCKPT_NODE, GROUP_RANK, NODE_RANK, else the host name",
    )
    add_json(p)
    p.set_defaults(func=run, interrupt_hint="run the same command again to resume the fetch")


def run(args: argparse.Namespace) -> int:
    from .fetch import fetch_checkpoint  # on use: --help and the other commands do not pay for its imports

    res = fetch_checkpoint(
        args.config,
        args.checkpoint,
        ranks=args.rank,
        progress=not args.quiet,
        peers=not args.no_peers,
        node=args.node,
    )
    if res.node is not None and res.node_from == "host name" and res.fresh_node and res.other_nodes:
        log.warning(
            "wrote into node %s's directory (the host name: no --node, TIERCKPT_NODE or GROUP_RANK is set), "
            "where no job had written; the nodes with directories here are %s: a job launched by torchrun reads the directory of its "
            "GROUP_RANK (fetch again with --node NAME)",
            res.node,
            ", ".join(res.other_nodes),
        )
    if args.json:
        print_json(res.to_json())
        return 0
    notes = []
    if res.skipped:
        notes.append(f"{len(res.skipped)} already there")
    if res.resumed:
        notes.append(f"{len(res.resumed)} resumed")
    if res.repaired:
        notes.append(f"{len(res.repaired)} repaired")
    if res.ranges_retried:
        notes.append(f"{res.ranges_retried} range(s) downloaded again after a checksum mismatch")
    which = "" if res.ranks is None else f" (ranks {', '.join(map(str, res.ranks))})"
    by_source: dict[str, int] = {}
    for src in res.sources.values():
        by_source[src] = by_source.get(src, 0) + 1
    if by_source:
        notes.append("from " + ", ".join(f"{src}: {n}" for src, n in sorted(by_source.items())))
    where = f"node {res.node} ({res.local_url})" if res.node is not None else res.local_url
    print(
        f"fetched {res.checkpoint_id}{which} to {where}: {len(res.files)} file(s)"
        + (f" ({'; '.join(notes)})" if notes else "")
        + f", {human_size(res.bytes_downloaded)} downloaded, {human_size(res.bytes_reused)} reused, in {res.seconds:.1f} s"
    )
    return 0
