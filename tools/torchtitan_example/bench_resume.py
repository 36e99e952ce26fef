"""Resume time through torchtitan's checkpoint path: tierckpt's manager vs torchtitan's own (DCP's
``FileSystemReader``), side by side in one run, same model, same ranks (issue 21's fixed-cost target).

    python tools/torchtitan_example/bench_resume.py [--rounds 3] [--json out.json]

Per round and manager: one run of tests/titan_scenarios.py (llama3 debugmodel, FSDP2, AdamW, 2 gloo
ranks on CPU) trains 2 steps and saves step 2 (waited for); a second run in fresh processes resumes
from it. Reported: the seconds ``CheckpointManager.load`` took on each rank of the resuming run
(the slower rank counts), as the median over rounds, and their ratio; the CPU seconds of each
rank's process during that load (all its threads; the ranks summed), and the load average at the
end. Managers alternate within each round. (The ranks are forked from the launcher's fork server,
not children of this process: the CPU time of whole runs is not visible here.)
``--profile DIR``: a cProfile of each rank's load in DIR (``load-<manager>-<rank>.prof``, last round).
``--cold``: before each resume, the checkpoint's files are dropped from the page cache
(``posix_fadvise(DONTNEED)``), as on a restart on another node: both managers read from the disk.
Without it, DCP's ``FileSystemWriter`` (buffered writes) leaves its files in the page cache while
tierckpt writes with ``O_DIRECT`` (``[local] direct_io = "auto"``): tierckpt reads from the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tierckpt.testing.launch import run_world  # noqa: E402

SCRIPT = ROOT / "tests" / "titan_scenarios.py"


def _run(root: Path, manager: str, tag: str) -> list[dict]:
    toml = root / "tiers.toml"
    toml.write_text(f'[host]\nbuffer_size = "128MiB"\nchunk_size = "16MiB"\n[local]\npath = "{root / "tiers"}"\nkeep = 0\n')
    res = run_world(2, "train", {"tiers": str(toml), "dump": str(root / "dump"), "mode": "disabled", "steps": 2,
                                 "interval": 2, "manager": manager}, root / tag, script=SCRIPT, timeout=600)
    for r in res:
        if "errors" in r:
            raise SystemExit(f"{manager} {tag} failed: {r['errors']}")
    return res


def _drop_cached(root: Path) -> None:
    """Drop every file under ``root`` from the page cache (clean pages only: the saves fsynced)."""
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="directory for cProfile dumps of each rank's load")
    ap.add_argument("--cold", action="store_true", help="drop the checkpoint from the page cache before each resume")
    a = ap.parse_args()
    if a.profile:
        Path(a.profile).mkdir(parents=True, exist_ok=True)
        os.environ["TIERCKPT_PROFILE_LOAD"] = str(Path(a.profile).resolve())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            order = ("torchtitan", "tierckpt") if rnd % 2 == 0 else ("tierckpt", "torchtitan")
            for manager in order:
                root = Path(tmp) / f"{rnd}-{manager}"
                root.mkdir()
                _run(root, manager, "save")
                if a.cold:
                    _drop_cached(root)
                res = _run(root, manager, "resume")
                if any(r["resumed_from"] != 2 for r in res):
                    raise SystemExit(f"{manager}: resumed from {[r['resumed_from'] for r in res]}, not step 2")
                rows.append({"round": rnd, "manager": manager, "load_s": max(r["load_s"] for r in res),
                             "load_s_ranks": [r["load_s"] for r in res],
                             "load_cpu_s": sum(r["load_cpu_s"] for r in res), "loadavg": os.getloadavg()[0]})
    print(f"{'round':>5} {'manager':11} {'load s':>8} {'load CPU s':>11} {'load avg':>9}")
    for r in rows:
        print(f"{r['round']:5d} {r['manager']:11} {r['load_s']:8.3f} {r['load_cpu_s']:11.3f} {r['loadavg']:9.1f}")
    ms = ("tierckpt", "torchtitan")
    med = {m: statistics.median(r["load_s"] for r in rows if r["manager"] == m) for m in ms}
    cpu = {m: statistics.median(r["load_cpu_s"] for r in rows if r["manager"] == m) for m in ms}
    print(f"median load: tierckpt {med['tierckpt']:.3f} s, torchtitan (FileSystemReader) {med['torchtitan']:.3f} s: "
          f"{med['tierckpt'] / med['torchtitan']:.2f}x; load CPU s (ranks summed): {cpu['tierckpt']:.3f} vs "
          f"{cpu['torchtitan']:.3f}: {cpu['tierckpt'] / cpu['torchtitan']:.2f}x; load average {os.getloadavg()[0]:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"cold": a.cold, "rows": rows, "median_load_s": med, "ratio": med["tierckpt"] / med["torchtitan"],
                                            "median_load_cpu_s": cpu, "cpu_ratio": cpu["tierckpt"] / cpu["torchtitan"],
                                            "loadavg": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
