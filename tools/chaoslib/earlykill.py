"""Case ``earlykill``: SIGKILL at a random moment in the first seconds of a save-every-step loop
(issue #32, item 8).

A child process saves a ~14 MiB state every step (``dcp.save`` + ``wait_captured()``, one local
tier, ``keep = 3``, fsync off, the default host pool of 1 GiB: captures can run far ahead of
commits), logging each step when it is captured and when its data file is durable. It is
SIGKILLed at a random moment 1 to 3 s after it created its ``TieredWriter`` (torch is imported
before: the zygote's). Then the job must resume:
``latest`` names a committed checkpoint and loads bit-exact the state of its step (the state is a
function of the step). Commits must also have kept up with the disk: the resumed step may trail
the newest step whose data file (and every earlier one) was durable by at most
:data:`LAG_LIMIT` steps. A kill before the first data file was durable (a machine so loaded that
the loop had not saved yet) leaves nothing to commit: noted, not counted lost. Before the fix, commits waited for a retention sweep whose cost grew
with the saves in flight: they fell hundreds of steps behind; and the first save waited for the
touch of the whole host pool (4-8 s per GiB on a loaded 2-core VM), so a kill in the first
seconds found nothing committed.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from chaoslib.core import CaseResult, short, toml_text
from chaoslib.env import Env, tail, wait_proc
from tierckpt import TieredReader, TieredWriter
from tierckpt.config import config_from_dict
from tierckpt.errors import CheckpointNotFound
from tierckpt.format.layout import step_of
from tierckpt.testing import bits

MiB = 1 << 20
LAG_LIMIT = 16  # steps a resume may trail the durable saves (commits take milliseconds)
KILL_AFTER = (1.0, 3.0)  # seconds after the writer was created


def state_of(step: int) -> dict:
    """The loop's state at ``step``: 6 fixed 2 MiB tensors, one int32 tensor that is the base plus
    ``step`` (updated in place every step, so a save that mixed steps would show), the step."""
    sd: dict = {f"w{i}": bits((MiB // 2,), torch.float32, seed=i) for i in range(6)}
    sd["moving"] = torch.arange(MiB // 2, dtype=torch.int32) + step
    sd["step"] = step
    return sd


def _saver_child(payload: dict) -> int:
    """Zygote child: the save-every-step loop (until killed). Log lines ``{"start": 0}`` when
    it creates its writer, ``{"c": step, "t": s}`` when a save is captured and ``{"d": step}``
    when its data file is durable."""
    torch.set_num_threads(1)
    cfg = config_from_dict(payload["cfg"])
    sd = state_of(0)
    log = open(payload["log"], "a", buffering=1)
    log.write(json.dumps({"start": 0}) + "\n")
    w = TieredWriter(cfg)
    t0 = time.monotonic()
    step = 0
    while True:
        step += 1
        sd["moving"].add_(1)
        sd["step"] = step
        dcp.save(sd, checkpoint_id=f"step-{step:06d}", storage_writer=w, no_dist=True)
        w.wait_captured()
        log.write(json.dumps({"c": step, "t": time.monotonic() - t0}) + "\n")
        w.last.durable.add_done_callback(_durable_logger(log, step))


def _durable_logger(log: Any, step: int) -> Any:
    """A callback for a save's ``durable`` future: log ``{"d": step}`` when it succeeded."""

    def done(f: Any) -> None:
        if f.exception() is None:
            log.write(json.dumps({"d": step}) + "\n")

    return done


def _same(a: object, b: object) -> bool:
    """Bit-exact equality (random bit patterns include NaNs, which ``torch.equal`` calls different)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a == b


def _started(path: Path) -> bool:
    """Whether the child logged that it creates its writer."""
    return path.exists() and path.read_text().startswith('{"start"')


def _events(path: Path) -> tuple[list[int], set[int]]:
    """Captured steps (in order) and durable steps from the child's log (a torn last line skipped)."""
    captured: list[int] = []
    durable: set[int] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "c" in e:
                captured.append(int(e["c"]))
            if "d" in e:
                durable.add(int(e["d"]))
    return captured, durable


def case_earlykill(env: Env, trials: int, seed: int) -> CaseResult:
    """Each trial: a fresh save-every-step loop SIGKILLed 1-3 s after it created its writer; then
    ``latest`` must exist (else ``lost``: the job has nothing to resume from), load bit-exact
    the state of its step (else ``lost``), and trail the durable saves by at most
    :data:`LAG_LIMIT` steps (else a failure: commits fell behind the disk). Notes: the steps
    captured before the kill and how far the resume trailed."""
    res = CaseResult("earlykill")
    t0 = time.perf_counter()
    rng = random.Random(f"{seed}-earlykill")
    lags: list[int] = []
    for j in range(trials):
        trial = f"#{j}"
        d = env.fresh("earlykill")
        # fsync off: a SIGKILL keeps the page cache, and the lag then measures the commit path, not
        # the latency of a loaded disk's fsync (which a commit must pay once per checkpoint)
        cfgd = env.config(d, s3=False, local_keep=3, buffer="1GiB", chunk="32MiB", fsync=False)  # the default pool
        (d / "tiers.toml").write_text(toml_text(cfgd))
        log, out = d / "steps.jsonl", d / "saver.out"
        p = env.spawn("earlykill-saver", {"cfg": cfgd, "log": str(log)}, out)
        deadline = time.monotonic() + 120
        while not _started(log) and p.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not _started(log):
            res.fail(trial, f"the loop did not start within 120 s (exit {p.exitcode}): {tail(out)}")
            p.kill()
            wait_proc(p, 30)
            continue
        time.sleep(rng.uniform(*KILL_AFTER))
        alive = p.is_alive()
        p.kill()
        wait_proc(p, 30)
        res.trials += 1
        if not alive:
            res.fail(trial, f"the loop exited by itself (exit {p.exitcode}) before the kill: {tail(out)}")
            continue
        captured, durable = _events(log)
        run = 0  # the newest step whose data file and every earlier one's were durable
        while run + 1 in durable:
            run += 1
        res.note("steps captured before the kill", len(captured))
        cfg = config_from_dict(cfgd)
        try:
            reader = TieredReader(cfg)
            cid = reader.resolve()
        except CheckpointNotFound:
            if run == 0:  # killed before any data file was durable: nothing could be committed yet
                res.note("killed before the first save was durable", 1)
            else:
                res.lose(trial, f"nothing committed after {len(captured)} saves captured ({run} durable): no resume")
            env.cleanup(d)
            continue
        except Exception as e:  # noqa: BLE001
            res.fail(trial, f"latest: {short(e)}")
            env.cleanup(d)
            continue
        step = step_of(cid) or 0
        want = state_of(step)
        got = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in want.items()}
        got["step"] = -1
        try:
            dcp.load(got, checkpoint_id=cid, storage_reader=reader, no_dist=True)
        except Exception as e:  # noqa: BLE001
            res.lose(trial, f"latest ({cid}) does not load: {short(e)}")
            env.cleanup(d)
            continue
        bad = [k for k, v in want.items() if not _same(got[k], v)]
        if bad:
            res.lose(trial, f"latest ({cid}) loaded other bytes for {bad}")
        lag = max(0, run - step)
        lags.append(lag)
        if lag > LAG_LIMIT:
            res.fail(
                trial,
                f"resumed from step {step} while steps 1-{run} were durable ({len(captured)} captured): "
                f"commits fell {lag} steps behind the disk (limit {LAG_LIMIT})",
            )
        env.cleanup(d)
    if lags:
        res.note("resume trailed the durable saves by at most (steps)", max(lags))
    res.seconds = time.perf_counter() - t0
    return res


CHILDREN = {"earlykill-saver": _saver_child}
