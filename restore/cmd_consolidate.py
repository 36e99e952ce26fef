"""``consolidate``: one full state dict file (.pt or .safetensors) from a sharded checkpoint."""

from __future__ import annotations

import argparse

from .fmt import add_json, checkpoint_ref, human_size, print_json

EPILOG = """examples:
  tierckpt-restore consolidate latest --out model.safetensors --keys model. --strip-prefix model.
  tierckpt-restore consolidate --keys model. --keys ema. latest --out k.pt   # options anywhere
  tierckpt-restore consolidate step-000300 --out full.pt          # everything, optimizer included
  tierckpt-restore consolidate latest --out model.pt --exclude optim. --exclude extra.
  python -c "import torch; sd = torch.load('full.pt', weights_only=True)"
"""


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "consolidate",
        parents=parents,
        help="write one full state dict (.pt / .safetensors)",
        description="Reassemble a sharded checkpoint into one flat state dict of full tensors "
        "(fqn -> tensor), without a process group or GPU, streaming: peak memory stays "
        "near the largest tensor. .safetensors holds tensors only (other items are "
        "skipped and listed); .pt also holds non-tensor items and loads with "
        "torch.load(..., weights_only=True). Reads from the fastest tier holding a "
        "committed copy, verifying every CRC32C.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="ID|latest", type=checkpoint_ref, help="checkpoint id, or 'latest'")
    p.add_argument("--out", "-o", required=True, metavar="PATH", help="output file: *.pt or *.safetensors")
    p.add_argument(
        "--keys",
        action="append",
        metavar="PREFIX",
        help="keep only keys starting with this prefix (e.g. model.); repeat for several",
    )
    p.add_argument(
        "--exclude",
        action="append",
        metavar="PREFIX",
        help="leave out keys starting with this prefix; repeat for several",
    )
    p.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        help="write keys without this prefix (--strip-prefix model.: model.layer.w is written as layer.w)",
    )
    p.add_argument("--format", choices=("pt", "safetensors"), help="output format (default: from the --out suffix)")
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .consolidate import consolidate_checkpoint  # on use: --help and the other commands do not pay for its imports

    res = consolidate_checkpoint(
        args.config,
        args.checkpoint,
        out=args.out,
        keys=args.keys,
        exclude=args.exclude,
        fmt=args.format,
        progress=not args.quiet,
        strip_prefix=args.strip_prefix,
    )
    if args.json:
        print_json(res.to_json())
        return 0
    tiers = sorted(set(res.served.values()))
    skipped = f"; left out {len(res.skipped)} non-tensor key(s)" if res.skipped else ""
    print(
        f"wrote {res.out} ({res.format}): {res.tensors} tensor(s), {res.objects} other item(s), "
        f"{human_size(res.bytes)} from {res.checkpoint_id}"
        + (f" (read from {', '.join(tiers)})" if tiers else "")
        + f" in {res.seconds:.1f} s{skipped}"
    )
    return 0
