"""Blocked time per save and resume time through Lightning and Accelerate: tierckpt's integrations
vs each framework's default path, side by side in one run, same model, same ranks (2 gloo ranks, CPU).

    python tools/bench_integrations.py [--width 2048] [--saves 4] [--rounds 1] [--json out.json]

Cases (each run once per round, default and tierckpt interleaved):

* ``lightning-ddp``: ``trainer.save_checkpoint`` after every step (rank 0 saves the whole state;
  default: Lightning's ``TorchCheckpointIO``, i.e. ``torch.save``; tierckpt: ``TierckptCheckpointIO``);
* ``lightning-fsdp2``: the same with ``ModelParallelStrategy`` (FSDP2; default: DCP's
  ``FileSystemWriter`` plus ``meta.pt``; tierckpt: ``TierckptModelParallelStrategy``);
* ``accelerate-fsdp2``: ``accelerator.save_state()`` after every step (default: Accelerate's two
  DCP saves plus its pickles; tierckpt: ``enable()``).

Blocked: the seconds a save call took, per save and rank (tierckpt returns once captured and
nothing waits later; the default returns once written). Resume: a new trainer/Accelerator in the
same process loads the last save (seconds in the strategy's ``load_checkpoint`` /
``accelerator.load_state``; page cache warm for both). CPU: user+system seconds of all ranks of
the run, the resume included. Prints a table and the ratios (targets: blocked <= 0.3x, resume
<= 1.2x); ``--json`` writes every figure. Workers: tests/lightning_scenarios.py,
tests/accelerate_scenarios.py.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierckpt.testing.launch import run_world  # noqa: E402

LIGHTNING = ROOT / "tests" / "lightning_scenarios.py"
ACCELERATE = ROOT / "tests" / "accelerate_scenarios.py"
CASES = ("lightning-ddp", "lightning-fsdp2", "accelerate-fsdp2")


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run(case: str, io: str, root: Path, width: int, saves: int, direct_io: str) -> dict:
    toml = root / "tiers.toml"
    dio = "true" if direct_io == "true" else "false" if direct_io == "false" else '"auto"'
    toml.write_text(
        f'[host]\nbuffer_size = "512MiB"\nchunk_size = "16MiB"\n'
        f'[local]\npath = "{root / "tiers"}"\nkeep = 2\ndirect_io = {dio}\n'
    )
    common = {
        "io": io,
        "tiers": str(toml),
        "steps": saves,
        "interval": 1,
        "width": width,
        "save_every_step": True,
        "then_resume": True,
    }
    if case.startswith("lightning"):
        args = common | {"strategy": "ddp" if case == "lightning-ddp" else "fsdp2", "dirpath": str(root / "ckpt")}
        script, scenario = LIGHTNING, "fit"
    else:
        args = common | {"dump": str(root / "run")}
        script, scenario = ACCELERATE, "train"
    cpu0, t0 = _cpu_children(), time.perf_counter()
    res = run_world(2, scenario, args, root / "w", script=script, timeout=900)
    wall, cpu = time.perf_counter() - t0, _cpu_children() - cpu0
    for r in res:
        if "errors" in r:
            raise SystemExit(f"{case}/{io} failed: {r['errors']}")
    blocked = [b for r in res for b in r["blocked"]]
    return {
        "case": case,
        "io": io,
        "blocked_median_s": statistics.median(blocked),
        "blocked_max_s": max(blocked),
        "blocked_s": blocked,
        "resume_s": max(r["load_s"] for r in res),
        "cpu_s": cpu,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048, help="hidden width of the MLP (state ~ 12 * width^2 bytes)")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument(
        "--direct-io",
        default="auto",
        choices=("auto", "true", "false"),
        help="[local] direct_io of the tiers (auto: data files under 256 MiB are written through the page "
        "cache, as the default path's are, larger ones bypass it; true: every data file bypasses it, so a "
        "resume in the same process reads them from the disk while the default path's files are cached)",
    )
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for case in a.cases.split(","):
                for io in ("default", "tierckpt"):
                    root = Path(tmp) / f"{rnd}-{case}-{io}"
                    root.mkdir()
                    row = _run(case, io, root, a.width, a.saves, a.direct_io) | {"round": rnd}
                    rows.append(row)
                    print(
                        f"{case:17s} {io:9s} blocked median {row['blocked_median_s'] * 1e3:8.1f} ms  "
                        f"max {row['blocked_max_s'] * 1e3:8.1f} ms  resume {row['resume_s'] * 1e3:8.1f} ms  "
                        f"cpu {row['cpu_s']:6.1f} s  wall {row['wall_s']:6.1f} s",
                        flush=True,
                    )
    summary = []
    print(
        f"\n{'case':17s} {'blocked x':>10s} {'resume x':>9s}   (tierckpt / default, medians over rounds; "
        "targets <= 0.3x, <= 1.2x)"
    )
    for case in a.cases.split(","):
        d = [r for r in rows if r["case"] == case and r["io"] == "default"]
        t = [r for r in rows if r["case"] == case and r["io"] == "tierckpt"]
        blocked = statistics.median(r["blocked_median_s"] for r in t) / statistics.median(
            r["blocked_median_s"] for r in d
        )
        resume = statistics.median(r["resume_s"] for r in t) / statistics.median(r["resume_s"] for r in d)
        summary.append({"case": case, "blocked_ratio": blocked, "resume_ratio": resume})
        print(f"{case:17s} {blocked:10.2f} {resume:9.2f}")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "width": a.width,
                    "saves": a.saves,
                    "rounds": a.rounds,
                    "direct_io": a.direct_io,
                    "rows": rows,
                    "summary": summary,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
