"""The failure story, end to end, in real processes (the test twin of ``tools/demo.py``).

1. One process trains a small GPT (``tools/train_gpt.py``) with ``TieredWriter``: a checkpoint every
   ``EVERY`` steps through host pool -> local tier -> background promotion to S3 (moto on loopback).
   It is killed with SIGKILL at a seeded random moment (a step at or after the third checkpoint,
   plus a random delay), the local tier is deleted (the node is lost), ``python -m restore fetch
   latest`` rebuilds it from S3, and a new process resumes from ``latest``. The resumed state must
   equal, bit for bit, the reference run's state at that checkpoint's step; the resumed run's
   losses must equal the uninterrupted reference run's, and so must its final state. The reference
   is an uninterrupted run with DCP's own ``FileSystemWriter`` (``--writer dcp --digests``), started
   once per module in the background.
2. The same story across world sizes: a 2-rank DDP run (one local tier per simulated node) is killed
   (both ranks at once, one process group) after checkpoints were committed on S3, both local tiers
   are deleted, ``fetch latest`` runs, and ONE process resumes: its state must equal the digest the
   2-rank run logged for that step (rank 0 logs it; DDP keeps the replicated state identical on all
   ranks), and training must go on to the end.

Where each kill landed (inside ``dcp.save``, capture/flush/local commit, promotion, or between
checkpoints) is worked out from the trainer's events and what each tier holds right after the
kill; it is printed (``pytest -s``) and stored as the test's ``kill_phase`` property.
Behaviour only: no timing assertions.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import s3servers  # tools/ (conftest puts it on sys.path)
from train_gpt import read_events as events  # tools/ (conftest puts it on sys.path)

from tierckpt.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "tools" / "train_gpt.py"

STEPS = 16
EVERY = 2
MODEL = ["--d-model", "64", "--layers", "2"]
TRAIN_SEED = 3  # the model/data seed: the same for every run, so every run is comparable
WAIT_S = 240.0  # bound on any one subprocess (the machine may be heavily shared)
DIST_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "NODE_RANK",
    "TORCHELASTIC_RUN_ID",
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    # about 15-30 s per test on 2 idle cores; several times that on a shared, loaded machine
    pytest.mark.timeout(900),
]


# -- helpers --------------------------------------------------------------------------------------


def of(evs: list[dict], kind: str) -> list[dict]:
    return [e for e in evs if e.get("event") == kind]


def last_step(evs: list[dict]) -> int:
    return max((e["step"] for e in of(evs, "step")), default=0)


def cid(step: int) -> str:
    return f"step-{step:06d}"


def base_env(**extra: str) -> dict[str, str]:
    s3servers.ensure_dummy_credentials()
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.update(extra)
    return env


def trainer(log: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(TRAIN),
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(EVERY),
        "--seed",
        str(TRAIN_SEED),
        *MODEL,
        "--log",
        str(log),
        *extra,
    ]


def run_ok(cmd: list[str], env: dict[str, str], what: str, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=WAIT_S, **kw)
    assert p.returncode == 0, (
        f"{what} failed (exit {p.returncode})\nstdout: {p.stdout[-3000:]}\nstderr: {p.stderr[-3000:]}"
    )
    return p


class Story:
    """One bucket + prefix, one TOML config, one working directory."""

    def __init__(self, work: Path, endpoint: str) -> None:
        self.work = work
        self.endpoint = endpoint
        self.bucket = f"tierckpt-story-{uuid.uuid4().hex[:10]}"
        self.prefix = "run"
        s3servers.make_bucket(endpoint, self.bucket)
        self.local = work / "local"
        self.config = work / "tiers.toml"
        self.config.write_text(f"""
[job]
commit_timeout = 60
log_level = "WARNING"

[host]
buffer_size = "8MiB"
chunk_size = "1MiB"

[local]
path = "{self.local / "{node}"}"
flush_threads = 2
keep = 2

[s3]
bucket = "{self.bucket}"
prefix = "{self.prefix}"
endpoint_url = "{endpoint}"
part_size = "5MiB"
concurrency = 4
keep = 3
max_attempts = 3
connect_timeout = 2.0
read_timeout = 10.0
""")

    def env(self, node: str = "node0", **extra: str) -> dict[str, str]:
        return base_env(TIERCKPT_CONFIG=str(self.config), TIERCKPT_NODE=node, **extra)

    # What the tiers hold, read directly (no tierckpt code in the judgement of the story).
    def s3_state(self) -> dict[str, str]:
        """checkpoint id -> "committed" | "partial" on S3 (multipart uploads in progress count)."""
        c = s3servers.s3_client(self.endpoint)
        out: dict[str, str] = {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/"):
            for obj in page.get("Contents", ()):
                parts = obj["Key"][len(self.prefix) + 1 :].split("/")
                if len(parts) == 2 and parts[0].startswith("step-"):
                    if parts[1] == "metadata.json":
                        out[parts[0]] = "committed"
                    else:
                        out.setdefault(parts[0], "partial")
        for up in c.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix + "/").get("Uploads", ()):
            parts = up["Key"][len(self.prefix) + 1 :].split("/")
            if parts and parts[0].startswith("step-"):
                out.setdefault(parts[0], "partial")
        return out

    def s3_committed(self) -> list[str]:
        return sorted(k for k, v in self.s3_state().items() if v == "committed")

    def local_state(self, node: str) -> dict[str, str]:
        """checkpoint id -> "committed" | "partial" in ``local/<node>``."""
        root = self.local / node
        out: dict[str, str] = {}
        if root.is_dir():
            for d in root.iterdir():
                if d.is_dir() and d.name.startswith("step-"):
                    out[d.name] = "committed" if (d / "metadata.json").exists() else "partial"
        return out


def kill_phase(evs: list[dict], story: Story, nodes: list[str]) -> dict:
    """Where the kill landed, from the trainer's events and what each tier holds after it."""
    last = last_step(evs)
    saved = {e["checkpoint"] for e in of(evs, "save")}
    newest = cid(last // EVERY * EVERY) if last >= EVERY else None
    local = {n: story.local_state(n) for n in nodes}
    s3 = story.s3_state()
    # committed locally, not (yet) on S3: the promotion backlog (promoted in commit order)
    pending = sorted(
        c for c in saved if s3.get(c) != "committed" and all(local[n].get(c) == "committed" for n in nodes)
    )
    backlog = ""
    if pending:
        head = pending[0]
        backlog = f"promotion backlog {pending[0]}..{pending[-1]} ({len(pending)}), promoting {head}: " + (
            "its upload had started" if s3.get(head) == "partial" else "nothing of it on S3 yet"
        )
    if newest is None:
        phase = "before the first checkpoint"
    elif newest not in saved:
        phase = f"inside dcp.save of {newest} (planning / enqueueing the capture)"
    elif any(local[n].get(newest) != "committed" for n in nodes):
        phase = f"capture / local flush / local commit of {newest}"
    elif pending:
        phase = "background promotion to S3 during " + ("the final writer.wait()" if last == STEPS else "training")
    else:
        phase = f"training between checkpoints ({newest} committed on every tier)"
    if backlog:
        phase += f"; {backlog}"
    return {
        "phase": phase,
        "last_step": last,
        "newest_checkpoint": newest,
        "not_yet_on_s3": pending,
        "local": local,
        "s3": s3,
    }


def start_group(cmds_envs: list[tuple[list[str], dict[str, str]]], logs: list[Path]) -> list[subprocess.Popen]:
    """Start processes in one new process group (the first one's), so one killpg kills them all."""
    procs: list[subprocess.Popen] = []
    for i, (cmd, env) in enumerate(cmds_envs):
        out = open(logs[i], "w")
        try:
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    process_group=0 if i == 0 else procs[0].pid,
                )
            )
        finally:
            out.close()
    return procs


def kill_when(
    procs: list[subprocess.Popen], log: Path, story: Story, *, at_step: int, delay: float, s3_min: int
) -> tuple[bool, int]:
    """SIGKILL the group once the trainer logged step ``at_step`` and S3 holds ``s3_min`` committed
    checkpoints (a lost node is only recoverable from what S3 committed), after ``delay`` seconds.
    Returns (killed, number of polls that waited only for S3)."""
    deadline = time.monotonic() + WAIT_S
    s3_waits = 0
    next_s3 = 0.0  # list S3 at most every 0.1 s: moto serves from this very process
    try:
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                return False, s3_waits
            if last_step(events(log)) >= at_step and time.monotonic() >= next_s3:
                if len(story.s3_committed()) >= s3_min:
                    time.sleep(delay)
                    os.killpg(procs[0].pid, signal.SIGKILL)
                    return True, s3_waits
                s3_waits += 1
                next_s3 = time.monotonic() + 0.1
            time.sleep(0.02)
        return False, s3_waits
    finally:
        if any(p.poll() is None for p in procs):  # timed out, or one rank died and the other hangs
            os.killpg(procs[0].pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=60)


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no output)"


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint():
    url, stop = s3servers.start_moto()
    try:
        yield url
    finally:
        stop()


class Reference:
    """The uninterrupted reference run (DCP FileSystemWriter, digests at every checkpoint), started in
    the background when first asked for so that it overlaps the first story's run."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.log = work / "reference.jsonl"
        self.out = work / "reference.out"
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(
                trainer(self.log, "--writer", "dcp", "--dcp-dir", str(work / "dcp"), "--digests"),
                env=base_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._evs: list[dict] | None = None

    def events(self) -> list[dict]:
        if self._evs is None:
            rc = self.proc.wait(timeout=WAIT_S)
            assert rc == 0, f"reference run failed (exit {rc}): {tail(self.out)}"
            self._evs = events(self.log)
        return self._evs

    def digests(self) -> dict[int, str]:
        return {e["step"]: e["digest"] for e in of(self.events(), "save")}

    def losses(self) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in of(self.events(), "step")}

    def final(self) -> str:
        return of(self.events(), "done")[-1]["digest"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = Reference(tmp_path_factory.mktemp("reference"))
    try:
        yield ref
    finally:
        ref.close()


def fetch_latest(story: Story, node: str = "node0") -> dict:
    p = run_ok(
        [sys.executable, "-m", "restore", "fetch", "latest", "--quiet", "--json"],
        story.env(node),
        "tierckpt-restore fetch latest",
        cwd=ROOT,
    )
    return json.loads(p.stdout)


# -- 1. one process: kill, lose the node, fetch, resume, compare bit for bit -------------------------


@pytest.mark.parametrize("seed", [11, 42])  # kill steps early and late (23 ran too: the suite neared 15 min)
def test_kill_lose_node_fetch_resume_single_process(seed, tmp_path, s3_endpoint, reference, record_property):
    rng = random.Random(seed)
    kill_step = rng.randrange(3 * EVERY, STEPS - 2)  # at or after the 3rd checkpoint's step
    delay = rng.uniform(0.0, 0.3)
    story = Story(tmp_path, s3_endpoint)

    log1 = tmp_path / "run1.jsonl"
    procs = start_group([(trainer(log1, "--digests"), story.env())], [tmp_path / "run1.out"])
    killed, s3_waits = kill_when(procs, log1, story, at_step=kill_step, delay=delay, s3_min=1)
    run1 = events(log1)
    assert killed, (
        f"the trainer ended (exit {procs[0].returncode}) before the kill at step {kill_step}: "
        f"{tail(tmp_path / 'run1.out')}"
    )
    assert procs[0].returncode == -signal.SIGKILL
    info = kill_phase(run1, story, ["node0"])
    info.update(seed=seed, kill_step=kill_step, delay=round(delay, 3), waited_for_s3=s3_waits > 0)
    print(
        f"\n[failure story, seed {seed}] kill planned after step {kill_step}{' (waited for S3)' if s3_waits else ''}, "
        f"landed after step {info['last_step']} (+{delay:.2f} s): {info['phase']}; "
        f"local {info['local']['node0']}, s3 {info['s3']}"
    )
    record_property("kill_phase", json.dumps(info))

    on_s3 = story.s3_committed()
    assert on_s3, "nothing committed on S3 at the kill"
    s3_latest = max(on_s3)  # ids are step-numbered and promoted in commit order

    # The node is lost: its local tier with it.
    shutil.rmtree(story.local)
    fetched = fetch_latest(story)
    assert fetched["checkpoint_id"] == s3_latest
    assert fetched["committed"] is True
    assert story.local_state("node0") == {s3_latest: "committed"}

    log2 = tmp_path / "run2.jsonl"
    run_ok(trainer(log2, "--resume", "--digests"), story.env(), "resumed run")
    run2 = events(log2)
    resumed = of(run2, "resumed")
    assert resumed, f"the resumed run did not load a checkpoint: {run2[:3]}"
    resumed = resumed[0]
    step = resumed["step"]
    assert resumed["checkpoint"] == s3_latest and step == int(s3_latest.split("-")[1])
    assert step <= info["last_step"]
    assert set(resumed["served"].values()) == {"local"}, (
        f"expected every file from the rebuilt local tier: {resumed['served']}"
    )

    # Bit for bit: the killed run's own digest at that step, and the uninterrupted reference's.
    killed_digest = {e["step"]: e.get("digest") for e in of(run1, "save")}
    if step in killed_digest:
        assert resumed["digest"] == killed_digest[step], "resumed state differs from what the killed run saved"
    ref_digest = reference.digests()
    assert resumed["digest"] == ref_digest[step], f"resumed state at step {step} differs from the reference's"

    new_losses = {e["step"]: e["loss"] for e in of(run2, "step")}
    assert sorted(new_losses) == list(range(step + 1, STEPS + 1))
    ref_losses = reference.losses()
    assert {s: ref_losses[s] for s in new_losses} == new_losses, (
        "losses after the resume differ from the uninterrupted run's"
    )
    assert of(run2, "done")[-1]["digest"] == reference.final(), "final state differs from the uninterrupted run's"
    # and every checkpoint the resumed run saved equals the reference's at its step
    for e in of(run2, "save"):
        assert e["digest"] == ref_digest[e["step"]], f"checkpoint at step {e['step']} differs from the reference's"
    # and the resumed run's checkpoints went through every tier again
    assert story.local_state("node0").get(cid(STEPS)) == "committed"
    assert cid(STEPS) in story.s3_committed()


# -- 2. two ranks, two nodes: kill both, lose both nodes, fetch, resume on ONE process ---------------


def test_two_ranks_killed_resume_on_one_process(tmp_path, s3_endpoint, record_property):
    rng = random.Random(7)
    kill_step = rng.randrange(3 * EVERY, STEPS - 4)
    delay = rng.uniform(0.0, 0.2)
    story = Story(tmp_path, s3_endpoint)
    port = free_port()
    log = tmp_path / "dist.jsonl"
    cmds = []
    for r in range(2):
        env = story.env(
            node=f"node{r}",
            RANK=str(r),
            WORLD_SIZE="2",
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        cmds.append((trainer(log, "--digests"), env))
    outs = [tmp_path / f"rank{r}.out" for r in range(2)]
    procs = start_group(cmds, outs)
    killed, s3_waits = kill_when(procs, log, story, at_step=kill_step, delay=delay, s3_min=2)
    run1 = events(log)
    assert killed, f"the 2-rank run ended (exits {[p.returncode for p in procs]}) before the kill: " + "\n".join(
        f"--- rank {r}\n{tail(o)}" for r, o in enumerate(outs)
    )
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
    assert of(run1, "start")[0]["world"] == 2
    info = kill_phase(run1, story, ["node0", "node1"])
    info.update(kill_step=kill_step, delay=round(delay, 3), waited_for_s3=s3_waits > 0)
    print(
        f"\n[failure story, 2 ranks] kill planned after step {kill_step}{' (waited for S3)' if s3_waits else ''}, "
        f"landed after step {info['last_step']} (+{delay:.2f} s): {info['phase']}; "
        f"local {info['local']}, s3 {info['s3']}"
    )
    record_property("kill_phase", json.dumps(info))

    on_s3 = story.s3_committed()
    assert len(on_s3) >= 2
    s3_latest = max(on_s3)
    logged = {e["step"]: e["digest"] for e in of(run1, "save")}

    shutil.rmtree(story.local)  # both nodes lost
    fetched = fetch_latest(story, "node0")
    assert fetched["checkpoint_id"] == s3_latest and fetched["committed"] is True
    assert len(fetched["files"]) == 2, f"a 2-rank checkpoint has one data file per rank: {fetched['files']}"

    log2 = tmp_path / "resume.jsonl"
    run_ok(trainer(log2, "--resume", "--digests"), story.env("node0"), "resumed run (1 process)")
    run2 = events(log2)
    assert of(run2, "start")[0]["world"] == 1
    resumed = of(run2, "resumed")
    assert resumed, f"the resumed run did not load a checkpoint: {run2[:3]}"
    resumed = resumed[0]
    step = resumed["step"]
    assert resumed["checkpoint"] == s3_latest and step == int(s3_latest.split("-")[1])
    assert step in logged, f"the 2-rank run logged no digest for step {step}: {sorted(logged)}"
    assert resumed["digest"] == logged[step], f"state resumed on 1 process differs from the 2-rank run's at step {step}"
    assert set(resumed["served"].values()) == {"local"}, resumed["served"]
    # training goes on, on the new world size, to the end
    assert sorted(e["step"] for e in of(run2, "step")) == list(range(step + 1, STEPS + 1))
    assert of(run2, "done")[-1]["step"] == STEPS
    assert cid(STEPS) in story.s3_committed()
