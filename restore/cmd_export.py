"""``export --format hf``: a checkpoint as a Hugging Face ``save_pretrained`` folder."""

from __future__ import annotations

import argparse

from .fmt import add_json, checkpoint_ref, human_size, print_json

EPILOG = """examples:
  tierckpt-restore export latest --format hf --out hf/{checkpoint_id} --keys model. --strip-prefix model. \\
      --files config.json generation_config.json tokenizer/ --dtype bfloat16
  tierckpt-restore export step-000300 --format hf --out hf-300 --max-shard-size 5GB --adapter mypkg.convert:to_hf
  tierckpt-restore export latest --out s3://bucket/hf/{checkpoint_id} --adapter torchtitan:llama3/8B \\
      --keys tok_embeddings. layers. norm. lm_head. --files llama3-8b-assets/config.json
  python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('hf-300')"
"""


def register(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        parents=parents,
        help="write a Hugging Face save_pretrained folder (sharded safetensors)",
        description="Write a committed checkpoint as the folder model.save_pretrained writes: "
        "model.safetensors, or model-0000K-of-0000N.safetensors shards and model.safetensors.index.json "
        "(split as save_pretrained splits them), plus extra files (config.json, tokenizer files). "
        "Streams tensor by tensor (peak memory near the largest tensor), reading from the fastest "
        "tier holding a committed copy and verifying every CRC32C, under a lease (retention does not "
        "delete the checkpoint meanwhile). Written into a hidden temporary folder, the index last, "
        "then renamed: an interrupted export leaves no folder under --out. Needs the hf extra "
        "(pip install 'tierckpt[hf]').",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="ID|latest", type=checkpoint_ref, help="checkpoint id, or 'latest'")
    p.add_argument("--format", choices=("hf",), default="hf", help="output format (hf: save_pretrained folder)")
    p.add_argument(
        "--out", "-o", required=True, metavar="DIR", help="output directory; {checkpoint_id} is replaced by the id"
    )
    p.add_argument(
        "--keys", nargs="+", action="extend", metavar="PREFIX", help="export only keys starting with these (model.)"
    )
    p.add_argument("--strip-prefix", default="", metavar="PREFIX", help="remove this prefix from every name")
    p.add_argument(
        "--dtype", choices=("keep", "bfloat16", "float16", "float32"), help="cast floating-point tensors (default keep)"
    )
    p.add_argument(
        "--files", nargs="+", action="extend", metavar="PATH", help="extra files (or directories' files) to copy in"
    )
    p.add_argument(
        "--adapter",
        metavar="DOTTED.PATH",
        help="callable mapping {name: tensor} to Hugging Face's; torchtitan:MODEL/FLAVOR (torchtitan:llama3/8B) "
        "or torchtitan:MODULE:CONFIG_FN: torchtitan's StateDictAdapter.to_hf for that model",
    )
    p.add_argument(
        "--max-shard-size", default="50GB", metavar="SIZE", help="as save_pretrained takes it (default 50GB)"
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    add_json(p)
    p.set_defaults(func=run)


def _size(v: str) -> int | str:
    return int(v) if v.isdigit() else v


def run(args: argparse.Namespace) -> int:
    from .export import export_hf  # on use: --help and the other commands do not pay for its imports

    res = export_hf(
        args.config,
        args.checkpoint,
        out=args.out,
        keys=args.keys,
        strip_prefix=args.strip_prefix,
        dtype=args.dtype,
        files=args.files,
        adapter=args.adapter,
        max_shard_size=_size(args.max_shard_size),
        overwrite=args.force,
        progress=not args.quiet,
    )
    if args.json:
        print_json(res.to_json())
        return 0
    tiers = sorted(set(res.served.values()))
    print(
        f"wrote {res.out} (hf): {len(res.shards)} shard(s), {res.tensors} tensor(s), {human_size(res.bytes)}"
        + (f", {len(res.files)} extra file(s)" if res.files else "")
        + f" from {res.checkpoint_id}"
        + (f" (read from {', '.join(tiers)})" if tiers else "")
        + f" in {res.seconds:.1f} s"
        + (f"; left out {len(res.skipped)} non-tensor key(s)" if res.skipped else "")
    )
    return 0
