"""Blocked time per save through torchtitan's checkpoint path: tierckpt's manager vs torchtitan's own
(DCP's FileSystemWriter), side by side in one run, same model, same ranks.

    python tools/torchtitan_example/bench_blocked.py [--steps 9] [--interval 2] [--json out.json]

Runs tests/titan_scenarios.py (llama3 debugmodel, FSDP2, AdamW, 2 gloo ranks on CPU) once per
(manager, mode), interleaved, and reports per save, on every rank: the time in
``CheckpointManager.save`` plus the time the next ``maybe_wait_for_staging`` blocked (what the
training loop waits for), as median and max; and the CPU seconds of the whole run (all ranks).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tierckpt.testing.launch import run_world  # noqa: E402

SCRIPT = ROOT / "tests" / "titan_scenarios.py"


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for mode in ("disabled", "async"):
                for manager in ("torchtitan", "tierckpt"):
                    root = Path(tmp) / f"{rnd}-{mode}-{manager}"
                    root.mkdir()
                    toml = root / "tiers.toml"
                    toml.write_text(f'[host]\nbuffer_size = "128MiB"\nchunk_size = "16MiB"\n'
                                    f'[local]\npath = "{root / "tiers"}"\nkeep = 0\n')
                    cpu0 = _cpu_children()
                    res = run_world(2, "train", {"tiers": str(toml), "dump": str(root / "dump"), "mode": mode,
                                                 "steps": a.steps, "interval": a.interval, "manager": manager,
                                                 "no_last": True}, root / "w", script=SCRIPT, timeout=600)
                    cpu = _cpu_children() - cpu0
                    per_save = []
                    for r in res:
                        if "errors" in r:
                            raise SystemExit(f"{manager}/{mode} failed: {r['errors']}")
                        waits = r["staging_wait"]
                        saves = [s for s in range(1, a.steps + 1) if s % a.interval == 0]
                        for i, s in enumerate(saves):
                            nxt = waits[s] if s < len(waits) else 0.0  # the wait before step s+1's optimizer step
                            per_save.append(r["blocked"][i] + nxt)
                    rows.append({"round": rnd, "mode": mode, "manager": manager, "saves_per_rank": len(per_save) // 2,
                                 "blocked_median_s": statistics.median(per_save), "blocked_max_s": max(per_save),
                                 "cpu_s_all_ranks": cpu})
    print(f"{'mode':10} {'manager':11} {'median s':>9} {'max s':>7} {'CPU s':>7}")
    for r in rows:
        print(f"{r['mode']:10} {r['manager']:11} {r['blocked_median_s']:9.3f} {r['blocked_max_s']:7.3f} {r['cpu_s_all_ranks']:7.1f}")
    for mode in ("disabled", "async"):
        ours = statistics.median(r["blocked_median_s"] for r in rows if r["mode"] == mode and r["manager"] == "tierckpt")
        theirs = statistics.median(r["blocked_median_s"] for r in rows if r["mode"] == mode and r["manager"] == "torchtitan")
        print(f"{mode}: tierckpt / torchtitan default = {ours / theirs:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
