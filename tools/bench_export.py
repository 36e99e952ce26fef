#!/usr/bin/env python
"""Benchmark of the Hugging Face export (``restore/export.py``, ``[export] every``), side by side in one run.

    python tools/bench_export.py [--hidden 1024] [--layers 8] [--vocab 32000] [--steps 16] [--pairs 2]
        [--parts export,consolidate,stall] [--dir DIR] [--export-dir DIR]

1. A ``LlamaForCausalLM`` built from a config (float32, random init, no download) is saved with
   ``dcp.save`` through ``TieredWriter`` into a local tier (fsync on; a 256 MiB host pool, smaller
   than the state).
2. *Source read*: the checkpoint's data files read back with 8 MiB ``readinto`` calls (page cache
   warm, as for the export right after).
3. *Export*: ``export_hf`` in a fresh process (peak RSS sampled every 5 ms; the process's RSS
   before the call is reported apart), 200 MB shards.
4. *Anchor*: what a user does today: the full state gathered into the model (``dcp.load`` into a
   ``LlamaForCausalLM`` in a fresh process), then ``model.save_pretrained`` (200 MB shards); its
   files are compared byte for byte with the export's.
5. *Anchor, DCP* (``--parts consolidate``): torch's own route, ``dcp.save`` through
   ``HuggingFaceStorageWriter(save_distributed=True)`` (per-rank safetensors with DCP's sharding
   metadata, one process here) then
   ``torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files`` into
   the same 200 MB split as the export (its ``fqn_to_index_mapping`` from the export's index), in a
   fresh process: wall time and peak RSS of the consolidation alone (the save is not counted).
6. *Stall*: a loop of ``--steps`` steps (a fixed amount of matmul work, then ``dcp.save`` of a
   64 MiB state + ``wait_captured``; ``wait()`` at the end) with ``[export] every = 1`` and
   without, in fresh processes, alternated A B A B (``--pairs``); wall time of the loop, the
   trainer's CPU seconds and its children's (the export workers it reaped), the CPU seconds of the
   whole tree (trainer and every worker: this process is made their subreaper), and which
   checkpoints were exported (the last worker outlives the loop and is waited for).

Prints one JSON document. Numbers depend on the machine: say which one ran them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(REPO), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

MiB = 1 << 20
SHARD = "200MB"


def _llama(args: dict):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args["vocab"],
        hidden_size=args["hidden"],
        intermediate_size=int(args["hidden"] * 2.75),
        num_hidden_layers=args["layers"],
        num_attention_heads=args["hidden"] // 64,
        num_key_value_heads=args["hidden"] // 128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _toml(d: Path, pool: str, export: str = "") -> Path:
    p = d / f"tiers{'-export' if export else ''}.toml"
    p.write_text(
        f'[host]\nbuffer_size = "{pool}"\nchunk_size = "16MiB"\n[local]\npath = "{d / "local"}"\nfsync = true\nkeep = 2\n'
        + export
    )
    return p


def child_export(spec: dict) -> dict:
    from benchlib.common import RssPeak

    from restore.export import export_hf

    with RssPeak() as mem:
        t0 = time.perf_counter()
        res = export_hf(
            spec["cfg"], "step-1", out=spec["out"], keys=["model."], strip_prefix="model.", max_shard_size=SHARD,
            files=[spec["config_json"]], progress=False,
        )  # fmt: skip
        sec = time.perf_counter() - t0
    return {
        "seconds": sec,
        "bytes": res.bytes,
        "shards": len(res.shards),
        "rss_before": mem.base,
        "rss_peak": mem.peak,
        "largest_tensor": res.largest_tensor,
    }


def child_save_pretrained(spec: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from benchlib.common import RssPeak

    from tierckpt import TieredReader, load_config

    with RssPeak() as mem:
        t0 = time.perf_counter()
        model = _llama(spec)
        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id="step-1", storage_reader=TieredReader(load_config(spec["cfg"])), no_dist=True)
        gathered = time.perf_counter() - t0
        t1 = time.perf_counter()
        model.save_pretrained(spec["out"], max_shard_size=SHARD)
        sec = time.perf_counter() - t1
    return {"gather_seconds": gathered, "save_seconds": sec, "rss_before": mem.base, "rss_peak": mem.peak}


def child_hf_save(spec: dict) -> dict:
    """The model's state saved by DCP's ``HuggingFaceStorageWriter`` (sharded, as on N ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    model = _llama(spec)
    t0 = time.perf_counter()
    w = HuggingFaceStorageWriter(spec["out"], fqn_to_index_mapping=spec["mapping"], save_distributed=True)
    dcp.save(model.state_dict(), storage_writer=w, no_dist=True)
    return {"seconds": time.perf_counter() - t0}


def child_consolidate(spec: dict) -> dict:
    from benchlib.common import RssPeak
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    Path(spec["out"]).mkdir(parents=True, exist_ok=True)  # it writes into an existing directory
    with RssPeak() as mem:
        t0 = time.perf_counter()
        consolidate_safetensors_files(spec["src"], spec["out"], spec["mapping"], num_threads=1)
        sec = time.perf_counter() - t0
    nbytes = sum(p.stat().st_size for p in Path(spec["out"]).glob("*.safetensors"))
    return {"seconds": sec, "bytes": nbytes, "rss_before": mem.base, "rss_peak": mem.peak}


def child_train(spec: dict) -> dict:
    import resource

    import torch
    import torch.distributed.checkpoint as dcp

    from tierckpt import TieredWriter, load_config

    torch.set_num_threads(1)
    cfg = load_config(spec["cfg"])
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(MiB, generator=g) for i in range(16)}  # 64 MiB
    a = torch.randn(384, 384, generator=g)
    t0 = time.perf_counter()
    w = None
    for step in range(1, spec["steps"] + 1):
        for _ in range(40):
            a = torch.tanh(a @ a)
        for t in state.values():
            t.add_(1.0)
        w = TieredWriter(cfg)
        dcp.save(state, checkpoint_id=f"step-{step}", storage_writer=w, no_dist=True)
        w.wait_captured()
    assert w is not None
    w.wait()
    sec = time.perf_counter() - t0
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"seconds": sec, "cpu": me.ru_utime + me.ru_stime, "cpu_children": kids.ru_utime + kids.ru_stime}


CHILDREN = {
    "export": child_export,
    "save_pretrained": child_save_pretrained,
    "train": child_train,
    "hf_save": child_hf_save,
    "consolidate": child_consolidate,
}


def _run_child(kind: str, spec: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, __file__, "--child", kind, json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if p.returncode != 0:
        raise RuntimeError(f"{kind} child failed: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _read_bandwidth(root: Path) -> dict:
    files = sorted(root.rglob("*.data"))
    buf = bytearray(8 * MiB)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    sec = time.perf_counter() - t0
    return {"bytes": total, "seconds": sec, "gbps": total / sec / 1e9}


def _write_bandwidth(d: Path, nbytes: int) -> dict:
    """``nbytes`` written with 8 MiB ``write`` calls into one new file, then fsync-ed: what the
    destination takes (the export writes and fsyncs as much)."""
    buf = bytes(8 * MiB)
    path = d / "write-probe.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(left, len(buf))])
        os.fsync(fd)
    finally:
        os.close(fd)
    sec = time.perf_counter() - t0
    path.unlink()
    return {"bytes": nbytes, "seconds": sec, "gbps": nbytes / sec / 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=2, help="stall: runs with and without, alternated")
    ap.add_argument("--dir", default="")
    ap.add_argument(
        "--export-dir", default="", help="stall: where the exports go (e.g. /dev/shm: not the training's disk)"
    )
    ap.add_argument(
        "--parts",
        default="export,stall",
        help="export (throughput, RSS, save_pretrained anchor), consolidate (DCP's anchor; needs export), stall",
    )
    ap.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](json.loads(args.child[1]))))
        return 0

    import torch.distributed.checkpoint as dcp

    from tierckpt import TieredWriter, load_config

    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-export-"))
    work.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    dims = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}
    out: dict = {"model": dims}
    try:
        if "export" in parts or "consolidate" in parts:
            _bench_export(work, dims, out, dcp, TieredWriter, load_config, parts)
        if "stall" in parts:
            _bench_stall(work, args.steps, args.pairs, out, args.export_dir)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=2))
    return 0


def _bench_export(work: Path, dims: dict, out: dict, dcp, TieredWriter, load_config, parts: set[str]) -> None:
    cfg = _toml(work, "256MiB")
    model = _llama(dims)
    model.config.save_pretrained(work / "hfconfig")
    sd = {"model": model.state_dict()}
    out["state_bytes"] = sum(t.numel() * t.element_size() for t in sd["model"].values())
    out["largest_tensor"] = max(t.numel() * t.element_size() for t in sd["model"].values())
    w = TieredWriter(load_config(cfg))
    dcp.save(sd, checkpoint_id="step-1", storage_writer=w, no_dist=True)
    w.wait()
    del model, sd
    out["source_read"] = _read_bandwidth(work / "local")
    out["dest_write"] = _write_bandwidth(work, out["state_bytes"])
    spec = {"cfg": str(cfg), "config_json": str(work / "hfconfig" / "config.json"), **dims}
    ex = out["export"] = _run_child("export", {**spec, "out": str(work / "export")})
    ex["gbps"] = ex["bytes"] / ex["seconds"] / 1e9
    ex["vs_source_read"] = ex["gbps"] / out["source_read"]["gbps"]
    ex["vs_dest_write"] = ex["gbps"] / out["dest_write"]["gbps"]
    ex["rss_over_start"] = ex["rss_peak"] - ex["rss_before"]
    if "consolidate" in parts:
        _bench_consolidate(work, spec, out)
    if "export" in parts:
        out["save_pretrained"] = _run_child("save_pretrained", {**spec, "out": str(work / "anchor")})
        out["same_shard_bytes"] = all(
            (work / "export" / p.name).read_bytes() == p.read_bytes() for p in (work / "anchor").glob("*.safetensors")
        )
        shutil.rmtree(work / "anchor")
    shutil.rmtree(work / "export")


def _bench_consolidate(work: Path, spec: dict, out: dict) -> None:
    """DCP's route (module docstring, 5.), into the export's shard split; compared tensor by tensor."""
    from safetensors import safe_open

    idx = work / "export" / "model.safetensors.index.json"
    if idx.exists():
        weight_map = json.loads(idx.read_text())["weight_map"]
    else:  # one shard: model.safetensors
        with safe_open(work / "export" / "model.safetensors", "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    mapping = {k: int(v.split("-")[1]) if "-" in v else 1 for k, v in weight_map.items()}
    src, dst = work / "dcp-hf", work / "dcp-consolidated"
    saved = _run_child("hf_save", {**spec, "out": str(src), "mapping": mapping})
    res = out["dcp_consolidate"] = _run_child("consolidate", {"src": str(src), "out": str(dst), "mapping": mapping})
    res["save_seconds"] = saved["seconds"]
    res["gbps"] = res["bytes"] / res["seconds"] / 1e9
    res["rss_over_start"] = res["rss_peak"] - res["rss_before"]
    same = True
    theirs = sorted(dst.glob("*.safetensors"))
    for name, other in zip(sorted(set(weight_map.values())), theirs, strict=True):
        with safe_open(work / "export" / name, "pt") as a, safe_open(other, "pt") as b:
            same = same and sorted(a.keys()) == sorted(b.keys())
            same = same and all(a.get_tensor(k).equal(b.get_tensor(k)) for k in a.keys())
    res["same_tensors_as_export"] = same
    shutil.rmtree(src)
    shutil.rmtree(dst)


def _subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``),
    so that an export worker outliving its trainer is reaped here and its CPU time counted in
    ``RUSAGE_CHILDREN``. False where that is not available."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _reap_all() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _tree_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _bench_stall(work: Path, steps: int, pairs: int, out: dict, export_root: str = "") -> None:
    out["cpu_tree_counted"] = _subreaper()
    runs: dict[str, list[float]] = {"without": [], "every_1": []}
    tree: dict[str, list[float]] = {"without": [], "every_1": []}  # trainer + every export worker, CPU s
    cpu: dict[str, list[list[float]]] = {"without": [], "every_1": []}  # [trainer, its reaped children]
    for i in range(pairs):
        for name in ("without", "every_1"):
            d = work / f"train-{name}-{i}"
            d.mkdir()
            hf = Path(export_root) / d.name if export_root else d / "hf"
            export = f'[export]\nevery = 1\npath = "{hf / "{checkpoint_id}"}"\n' if name == "every_1" else ""
            c = _toml(d, "256MiB", export)
            cpu0 = _tree_cpu()
            r = _run_child("train", {"cfg": str(c), "steps": steps})
            runs[name].append(r["seconds"])
            cpu[name].append([round(r["cpu"], 2), round(r["cpu_children"], 2)])
            if name == "every_1":  # the last worker outlives the loop: let it finish before counting
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not (hf / f"step-{steps}").exists():
                    time.sleep(0.5)
                out.setdefault("exported", []).append(sorted(p.name for p in hf.iterdir()))
                shutil.rmtree(hf, ignore_errors=True)
            _reap_all()  # the orphaned worker, if any (this process is their subreaper)
            tree[name].append(round(_tree_cpu() - cpu0, 2))
            shutil.rmtree(d, ignore_errors=True)
    out["stall"] = {
        "steps": steps,
        "seconds": runs,
        "cpu_seconds": cpu,
        "cpu_seconds_tree": tree,
        "ratio_best": min(runs["every_1"]) / min(runs["without"]),
        "ratio_median": sorted(runs["every_1"])[pairs // 2] / sorted(runs["without"])[pairs // 2],
        "ratio_each": [a / b for a, b in zip(runs["every_1"], runs["without"])],
    }


if __name__ == "__main__":
    sys.exit(main())
