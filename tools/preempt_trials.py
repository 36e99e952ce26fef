"""Preemption trials: a job SIGTERMed the moment ``dcp.save`` returns; does the restart find that checkpoint?

    python tools/preempt_trials.py [--trials 50] [--mib 192] [--baseline 5] [--json out.json] [--dir DIR]

Each trial runs a fresh job (a process of its own, ``[local]`` only, fsync on): it saves
``step-000001`` (waited for), then ``step-000002`` of ``--mib`` MiB, and sends itself SIGTERM the
moment ``dcp.save`` returns (the capture has just been enqueued: nothing of step-000002 is
durable yet). Afterwards a restart asks ``tierckpt.latest`` and loads it, checking every byte.
With ``[job] on_sigterm = "drain"`` (the default) the target is step-000002 every time; the
``--baseline`` trials run with ``on_sigterm = "ignore"`` (Python's default action, the behaviour
before) for comparison. Prints a table (and writes JSON): per mode, trials, how often ``latest``
was step-000002 and loaded bit-exact, the exit statuses, the drain time the job logged and the time
from SIGTERM to the process's end; then the jobs' CPU seconds (user + system) and wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 1 << 20


def _state(step: int, mib: int) -> dict:
    import torch

    n = mib * MiB // 4
    return {"w": torch.arange(n, dtype=torch.float32).add_(step * 0.5), "step": step}


def _config(root: Path, mode: str) -> dict:
    return {
        "job": {"on_sigterm": mode, "log_level": "INFO"},
        "host": {"buffer_size": "256MiB", "chunk_size": "32MiB"},
        "local": {"path": str(root), "keep": 0, "fsync": True},
    }


def child(root: str, mode: str, mib: int) -> int:
    """The job: step-000001 saved and waited for, step-000002 saved, SIGTERM to itself at once."""
    import logging

    import torch.distributed.checkpoint as dcp

    from tierckpt import TieredWriter
    from tierckpt.config import config_from_dict

    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(created).3f %(name)s %(message)s")
    w = TieredWriter(config_from_dict(_config(Path(root), mode)))
    dcp.save(_state(1, mib), checkpoint_id="step-000001", storage_writer=w, no_dist=True)
    w.wait()
    s2 = _state(2, mib)
    dcp.save(s2, checkpoint_id="step-000002", storage_writer=w, no_dist=True)
    print(f"SIGTERM {time.time():.6f}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the moment dcp.save returned
    while True:  # the training loop goes on until the signal ends the process
        time.sleep(0.01)


def check(root: Path, mib: int) -> tuple[str | None, bool]:
    """The restart: ``latest`` and whether it loads bit-exact."""
    import torch
    import torch.distributed.checkpoint as dcp

    import tierckpt
    from tierckpt import TieredReader
    from tierckpt.chain.engine import close_all
    from tierckpt.config import config_from_dict

    cfg = config_from_dict(_config(root, "drain"))
    cid = tierckpt.latest(cfg)
    if cid is None:
        return None, False
    step = int(cid.rsplit("-", 1)[1])
    out = {"w": torch.empty(mib * MiB // 4), "step": -1}
    try:
        dcp.load(out, checkpoint_id=cid, storage_reader=TieredReader(cfg), no_dist=True)
    except BaseException:  # noqa: BLE001 - counted as not loading
        return cid, False
    finally:
        close_all()
    return cid, out["step"] == step and torch.equal(out["w"], _state(step, mib)["w"])


def trial(work: Path, mode: str, mib: int, i: int) -> dict:
    root = work / f"{mode}-{i:03d}"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    p = subprocess.Popen(
        [sys.executable, __file__, "--child", str(root), mode, str(mib)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    _, err = p.communicate(timeout=600)
    ended = time.time()
    rc = p.returncode
    sent = re.search(r"SIGTERM (\d+\.\d+)", err)
    drain = re.search(r"drain done in ([\d.]+) s", err)
    cid, exact = check(root, mib)
    shutil.rmtree(root, ignore_errors=True)
    return {
        "mode": mode,
        "trial": i,
        "rc": rc,
        "latest": cid,
        "bit_exact": exact,
        "drain_s": float(drain.group(1)) if drain else None,
        "term_to_exit_s": ended - float(sent.group(1)) if sent else None,
        "wall_s": ended - t0,
        "log": "" if cid == "step-000002" or mode == "ignore" else err[-2000:],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[2], int(argv[3]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=50, help="trials with on_sigterm = drain")
    ap.add_argument("--baseline", type=int, default=5, help="trials with on_sigterm = ignore (the default action)")
    ap.add_argument("--mib", type=int, default=192, help="MiB of state per save")
    ap.add_argument("--json", default="", help="write every trial here")
    ap.add_argument("--dir", default="", help="work directory (default: a temporary one)")
    args = ap.parse_args(argv)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tierckpt-preempt-"))
    work.mkdir(parents=True, exist_ok=True)
    usage0 = os.times()
    rows: list[dict] = []
    plan = ["drain"] * args.trials + ["ignore"] * args.baseline
    for i, mode in enumerate(plan):
        r = trial(work, mode, args.mib, i)
        rows.append(r)
        print(
            f"[preempt] {mode} #{i}: exit {r['rc']}, latest {r['latest']}, bit-exact {r['bit_exact']}, "
            f"drain {r['drain_s']} s, SIGTERM to exit {r['term_to_exit_s']:.2f} s",
            flush=True,
        )
        if r["log"]:
            print(r["log"], flush=True)
    usage1 = os.times()
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"{args.mib} MiB per save, [local] only (fsync), SIGTERM the moment dcp.save returned")
    print(
        "mode   | trials | latest = step-000002, bit-exact | exit statuses | drain s (median / max) | "
        "SIGTERM to exit s (median / max)"
    )
    summary = {}
    for mode in ("drain", "ignore"):
        rs = [r for r in rows if r["mode"] == mode]
        if not rs:
            continue
        ok = sum(1 for r in rs if r["latest"] == "step-000002" and r["bit_exact"])
        codes: dict[int, int] = {}
        for r in rs:
            codes[r["rc"]] = codes.get(r["rc"], 0) + 1
        drains = [r["drain_s"] for r in rs if r["drain_s"] is not None]
        exits = [r["term_to_exit_s"] for r in rs if r["term_to_exit_s"] is not None]
        med = lambda xs: f"{statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"  # noqa: E731
        print(f"{mode:6} | {len(rs):6} | {ok:>2} / {len(rs):<27} | {codes} | {med(drains):22} | {med(exits)}")
        summary[mode] = {"trials": len(rs), "latest_is_step2": ok, "exit_codes": codes}
    cpu = (usage1.children_user - usage0.children_user) + (usage1.children_system - usage0.children_system)
    print(
        f"\nCPU seconds of the jobs (user + system): {cpu:.1f}; their wall time {sum(r['wall_s'] for r in rows):.1f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"mib": args.mib, "summary": summary, "trials": rows}, indent=2))
    d = summary.get("drain")
    return 0 if d is None or d["latest_is_step2"] == d["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
