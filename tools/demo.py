"""The tierckpt failure story, end to end, on one CPU machine (the README's first command).

    python tools/demo.py [--s3 moto|seaweedfs] [--steps 30] [--ckpt-every 3] [--seed N] [--keep]

1. Starts an S3 server on loopback (moto by default; SeaweedFS with ``--s3 seaweedfs``) and writes
   a tier configuration: host pool -> local tier -> S3.
2. Reference: trains a small GPT-style model without interruption, checkpointing with DCP's default
   ``FileSystemWriter`` (its blocked time per checkpoint and its losses are the baseline).
3. Trains the same model with ``TieredWriter`` (a checkpoint every few steps through all tiers)
   and kills it with SIGKILL at a random moment (during capture, flush, commit or promotion).
4. Deletes the local tier (the node is lost), runs ``tierckpt-restore fetch latest`` to rebuild it
   from S3, and resumes training from ``latest`` in a new process.
5. Two simulated nodes (one rank each, ``[peer] replicas = 1``) train and checkpoint; node n1's
   disk is lost, and the job resumes ``latest`` from n1's peer copy on n0, with no S3 download.
6. Prints a report: blocked milliseconds per checkpoint vs DCP's default writer, bytes and time per
   tier, restore time from S3 and from the peer copy, whether each resumed state equals the saved
   one bit for bit, and whether the resumed run's losses equal the uninterrupted run's. Exit status
   0 only if all hold.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import s3servers  # noqa: E402
from train_gpt import read_events as events  # noqa: E402

from tierckpt import load_config  # noqa: E402
from tierckpt.catalog.listing import list_checkpoints  # noqa: E402
from tierckpt.tiers import make_local, make_s3  # noqa: E402

BUCKET = "tierckpt-demo"


def write_config(work: Path, endpoint: str, name: str = "tiers", peer: int = 0) -> Path:
    cfg = work / f"{name}.toml"
    cfg.write_text(f"""
[peer]
replicas = {peer}

[job]
commit_timeout = 60

[host]
buffer_size = "64MiB"
chunk_size = "4MiB"

[local]
path = "{work / f"local-{name}" / "{node}"}"
flush_threads = 2
keep = 2

[s3]
bucket = "{BUCKET}"
prefix = "demo-{name}"
endpoint_url = "{endpoint}"
part_size = "5MiB"
concurrency = 4
keep = 3
""")
    return cfg


def trainer(args: argparse.Namespace, cfg: Path, log: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(HERE / "train_gpt.py"),
        "--config",
        str(cfg),
        "--steps",
        str(args.steps),
        "--ckpt-every",
        str(args.ckpt_every),
        "--log",
        str(log),
        "--seed",
        str(args.seed),
        "--d-model",
        str(args.d_model),
        "--layers",
        str(args.layers),
        *extra,
    ]


def tier_state(cfg_path: Path) -> dict[str, list[str]]:
    cfg = load_config(cfg_path)
    out = {}
    for tier in (make_local(cfg), make_s3(cfg)):
        if tier is not None:
            out[tier.name] = [f"{c.checkpoint_id}{'' if c.committed else ' (partial)'}" for c in list_checkpoints(tier)]
    return out


def peer_story(args: argparse.Namespace, work: Path, endpoint: str, env: dict) -> dict:
    """Two simulated nodes, one rank each, a peer copy of every file: node n1 is lost (its directory
    deleted, as its disk would be) and the job resumes ``latest`` from n1's copy on n0."""
    from tierckpt.testing import launch_ranks

    cfg = write_config(work, endpoint, "peers", peer=1)
    env = dict(env, TIERCKPT_CONFIG=str(cfg))
    say("two nodes (n0, n1), one rank each, [peer] replicas = 1: training with checkpoints")
    log = work / "peers-run.jsonl"

    def job(*extra: str, what: str) -> list:
        codes, logs = launch_ranks(
            2,
            lambda r: trainer(args, cfg, log, "--digests", *extra),
            work / f"peers-{what}",
            timeout=600,
            env_of=lambda r: dict(env, TIERCKPT_NODE=f"n{r}"),
        )
        if any(c != 0 for c in codes):
            raise RuntimeError(f"two-node {what} failed: exit codes {codes}\n{logs[0][-2000:]}\n{logs[1][-2000:]}")
        return events(log)

    run = job(what="train")
    saved = {e["checkpoint"]: e["digest"] for e in run if e.get("event") == "save"}
    newest = list(saved)[-1]  # the job waited for every checkpoint before it ended
    newest_s3 = ([c for c in tier_state(cfg).get("s3", []) if "partial" not in c] or ["none"])[-1]
    shutil.rmtree(work / "local-peers" / "n1")
    say("node n1 lost (its directory deleted); resuming both ranks from latest, n1 with an empty disk")
    log.unlink()
    t0 = time.perf_counter()
    back = next(e for e in job("--resume", what="resume") if e.get("event") == "resumed")
    resume_s = time.perf_counter() - t0
    return {
        "newest": newest,
        "newest_s3": newest_s3,
        "resume_s": resume_s,
        "load_s": back["load_s"],
        "from_peers": back.get("from_peers", 0),
        "identical": saved.get(back["checkpoint"]) == back["digest"],
    }


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def fetch_summary(out: str) -> str:
    """One line from ``tierckpt-restore fetch --json``'s output: what came from where (the whole
    document is in the JSON report), never a JSON text cut in the middle."""
    try:
        doc = json.loads(out)
    except ValueError:
        return out.strip().splitlines()[-1] if out.strip() else "(no output)"
    sources = sorted(set(doc.get("sources", {}).values()))
    return (
        f"{doc.get('checkpoint_id')}: {len(doc.get('files', []))} file(s), "
        f"{doc.get('bytes_downloaded', 0) / 2**20:.1f} MiB downloaded from {', '.join(sources) or '-'} "
        f"into {doc.get('local_url')}, committed: {'yes' if doc.get('committed') else 'NO'}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--s3", choices=["moto", "seaweedfs"], default="moto")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ckpt-every", type=int, default=3)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 1000)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    ap.add_argument("--json", default="", help="also write the report as JSON here")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="tierckpt-demo-"))
    s3servers.ensure_dummy_credentials()
    say(f"working in {work}; seed {args.seed}")
    if args.s3 == "moto":
        endpoint, stop = s3servers.start_moto()
    else:
        endpoint, stop = s3servers.start_seaweedfs(work / "seaweedfs")
    say(f"S3 ({args.s3}) at {endpoint}")
    report: dict = {"s3": args.s3, "seed": args.seed}
    try:
        s3servers.make_bucket(endpoint, BUCKET)
        cfg = write_config(work, endpoint)
        env = dict(os.environ, TIERCKPT_CONFIG=str(cfg), PYTHONUNBUFFERED="1")

        say("reference run: uninterrupted, DCP FileSystemWriter checkpoints")
        ref_log = work / "reference.jsonl"
        subprocess.run(
            trainer(args, cfg, ref_log, "--writer", "dcp", "--dcp-dir", str(work / "dcp"), "--digests"),
            env=env,
            check=True,
            stderr=subprocess.DEVNULL,
        )
        ref = events(ref_log)

        kill_step = rng.randrange(2 * args.ckpt_every + 1, args.steps - 1)
        delay = rng.uniform(0.0, 0.4)
        say(f"tiered run: will be killed with SIGKILL after step {kill_step} (+{delay:.2f} s)")
        run_log = work / "run1.jsonl"
        proc = subprocess.Popen(trainer(args, cfg, run_log), env=env, stderr=subprocess.DEVNULL)
        while proc.poll() is None:
            if any(e.get("event") == "step" and e["step"] >= kill_step for e in events(run_log)):
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        proc.wait()
        run1 = events(run_log)
        last = max((e["step"] for e in run1 if e.get("event") == "step"), default=0)
        say(f"killed at step {last} (exit {proc.returncode}); on the tiers: {tier_state(cfg)}")

        shutil.rmtree(work / "local-tiers", ignore_errors=True)
        say("node lost: local tier deleted; restoring with `tierckpt-restore fetch latest`")
        t0 = time.perf_counter()
        fetched = subprocess.run(
            [sys.executable, "-m", "restore", "fetch", "latest", "--quiet", "--json"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        restore_s = time.perf_counter() - t0
        if fetched.returncode != 0:
            say(f"fetch failed: {fetched.stderr.strip()}")
            return 1
        say(f"fetched in {restore_s:.2f} s: {fetch_summary(fetched.stdout)}")
        try:
            report["fetch"] = json.loads(fetched.stdout)  # the whole document, in the --json report
        except ValueError:
            pass

        say("resuming from latest in a new process")
        run2_log = work / "run2.jsonl"
        subprocess.run(trainer(args, cfg, run2_log, "--resume"), env=env, check=True, stderr=subprocess.DEVNULL)
        run2 = events(run2_log)

        peer = peer_story(args, work, endpoint, env)
    finally:
        stop()

    resumed = next(e for e in run2 if e.get("event") == "resumed")
    ref_digest = {e["step"]: e["digest"] for e in ref if e.get("event") == "save"}
    ref_loss = {e["step"]: e["loss"] for e in ref if e.get("event") == "step"}
    new_loss = {e["step"]: e["loss"] for e in run2 if e.get("event") == "step"}
    identical = ref_digest.get(resumed["step"]) == resumed["digest"]
    same_losses = bool(new_loss) and all(ref_loss[s] == v for s, v in new_loss.items())
    final_same = (
        next(e for e in run2 if e.get("event") == "done")["digest"]
        == next(e for e in ref if e.get("event") == "done")["digest"]
    )
    hist = next((e["history"] for e in run2 if e.get("event") == "stats"), [])
    dcp_blocked = [e["save_s"] for e in ref if e.get("event") == "save"]
    save_call = {e["checkpoint"]: e["save_s"] for e in run2 if e.get("event") == "save"}
    # blocked = the whole dcp.save call (measured around it) + the optimizer pre-step wait it caused
    tiered_blocked = [
        save_call[h["checkpoint_id"]] + h["prestep_wait_s"] for h in hist if h["checkpoint_id"] in save_call
    ]
    saves2 = list(save_call.values())

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    mib = (hist[0]["bytes"] / 2**20) if hist else 0.0
    rows = [
        ("checkpoint size", f"{mib:.1f} MiB per checkpoint, every {args.ckpt_every} steps"),
        (
            "blocked per checkpoint, DCP FileSystemWriter",
            f"{med(dcp_blocked) * 1e3:.1f} ms (median of {len(dcp_blocked)})",
        ),
        (
            "blocked per checkpoint, tierckpt",
            f"{med(tiered_blocked) * 1e3:.1f} ms (save {med(saves2) * 1e3:.1f} ms + pre-step wait)",
        ),
        ("speed-up of the training loop's stall", f"{med(dcp_blocked) / max(med(tiered_blocked), 1e-9):.0f}x"),
        ("host capture (median)", f"{med([h['capture_s'] for h in hist if h['capture_s']]) * 1e3:.1f} ms"),
        ("local flush+fsync (median)", f"{med([h['flush_s'] for h in hist if h['flush_s']]) * 1e3:.1f} ms"),
        ("local commit (median)", f"{med([h['commit_s'] for h in hist if h['commit_s']]) * 1e3:.1f} ms"),
        (f"promotion to S3 ({args.s3}, median)", f"{med([h['promote_s'] for h in hist if h['promote_s']]):.2f} s"),
        ("killed after step", str(last)),
        (
            "restore from S3 (fetch latest + load)",
            f"{restore_s + resumed['load_s']:.2f} s (fetch {restore_s:.2f} s + load {resumed['load_s']:.2f} s)",
        ),
        ("resumed from", f"{resumed['checkpoint']} (step {resumed['step']})"),
        ("resumed state identical", "yes" if identical else "NO"),
        ("losses after resume = uninterrupted run", f"yes ({len(new_loss)} steps)" if same_losses else "NO"),
        ("final state = uninterrupted run", "yes" if final_same else "NO"),
        ("2 nodes, [peer] replicas = 1: node lost at", f"{peer['newest']} (newest on S3: {peer['newest_s3']})"),
        (
            "restore from the peer copy (load, no fetch)",
            f"{peer['load_s']:.2f} s ({peer['from_peers'] / 2**20:.1f} MiB "
            f"over the transport; job restart {peer['resume_s']:.1f} s)",
        ),
        ("resumed state identical (peer copy)", "yes" if peer["identical"] else "NO"),
    ]
    print()
    print("tierckpt demo report")
    print("-" * 78)
    for k, v in rows:
        print(f"{k:42s} {v}")
    print("-" * 78)
    report.update({k: v for k, v in rows})
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.keep:
        say(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if identical and same_losses and final_same and peer["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
