"""Ranks of the ``peer`` bench section (``tools/benchlib/peer.py``), started by
:func:`tierckpt.testing.run_world`: saves with timings, and the resume after a lost node."""

from __future__ import annotations

import resource
import time

import torch
import torch.distributed.checkpoint as dcp

from tierckpt import TieredReader, TieredWriter
from tierckpt.config import config_from_dict
from tierckpt.testing import bits, compare, serve


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def state(rank: int, step: int, mib: int) -> dict:
    n = mib * (1 << 20) // 4 // 8
    out: dict = {f"rank{rank}.w{i}": bits((n,), torch.float32, seed=1000 * step + 10 * rank + i) for i in range(8)}
    out["shared"] = bits((1024,), torch.float32, seed=step)
    out["step"] = step
    return out


def save_steps(args: dict, rank: int, world: int) -> dict:
    """Save ``steps`` (each: dcp.save, then wait() for every hop): blocked and total seconds, CPU s."""
    cfg = config_from_dict(args["config"])
    w = TieredWriter(cfg)
    out: dict = {"blocked_s": [], "total_s": [], "cpu_s": []}
    for step in args["steps"]:
        sd = state(rank, step, args["mib"])
        c0, t0 = _cpu(), time.perf_counter()
        dcp.save(sd, checkpoint_id=f"step-{step}", storage_writer=w)
        t1 = time.perf_counter()
        w.wait()
        out["blocked_s"].append(t1 - t0)
        out["total_s"].append(time.perf_counter() - t0)
        out["cpu_s"].append(_cpu() - c0)
    w.engine.close()
    return out


def train(args: dict, rank: int, world: int) -> dict:
    """A training loop: ``iters`` iterations of single-threaded matmuls (the "step"), a ``dcp.save``
    every ``every`` of them that nobody waits for; seconds for the loop (what training feels), then
    for the final ``wait()``, and CPU seconds of the whole process."""
    torch.set_num_threads(1)
    cfg = config_from_dict(args["config"])
    w = TieredWriter(cfg)
    a = torch.randn(args["n"], args["n"], generator=torch.Generator().manual_seed(rank))
    b = torch.randn(args["n"], args["n"], generator=torch.Generator().manual_seed(rank + 100)) / args["n"] ** 0.5
    sd = state(rank, 0, args["mib"])
    dcp.save(sd, checkpoint_id="step-0", storage_writer=w)  # warm-up: process groups, pool, plans
    w.wait()
    c0, t0 = _cpu(), time.perf_counter()
    for it in range(1, args["iters"] + 1):
        for _ in range(args["reps"]):
            a = torch.tanh(a @ b)
        if it % args["every"] == 0:
            sd["step"] = it
            dcp.save(sd, checkpoint_id=f"step-{it}", storage_writer=w)
    loop = time.perf_counter() - t0
    w.wait()
    out = {"loop_s": loop, "drain_s": time.perf_counter() - t0 - loop, "cpu_s": _cpu() - c0}
    w.engine.close()
    return out


def save_and_lose(args: dict, rank: int, world: int) -> dict:
    """Save ``steps`` as training does (never waiting for the background hops, ``interval`` seconds of
    "compute" between saves), then die as a lost node does the moment the newest checkpoint has
    reached its first safe place: its peer copies committed (``replicas >= 1``) or its local commit
    (``replicas = 0``)."""
    from pathlib import Path

    from tierckpt.config import node_name

    cfg = config_from_dict(args["config"])
    w = TieredWriter(cfg)
    for step in args["steps"]:
        dcp.save(state(rank, step, args["mib"]), checkpoint_id=f"step-{step}", storage_writer=w)
        time.sleep(args["interval"])
    last = f"step-{args['steps'][-1]}"
    mark = (
        Path(cfg.local.path.format(node=node_name())) / last / ("peers.json" if cfg.peer.replicas else "metadata.json")
    )
    deadline = time.monotonic() + 600
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    return {"safe": mark.exists()}


def resume(args: dict, rank: int, world: int) -> dict:
    """What a restarted rank loads (its own tensors, the shared ones): seconds, and bit-exactness."""
    cfg = config_from_dict(args["config"])
    want = state(rank, args["step"], args["mib"])
    got = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in want.items()}
    reader = TieredReader(cfg)
    t0 = time.perf_counter()
    dcp.load(got, checkpoint_id="latest", storage_reader=reader)
    return {
        "load_s": time.perf_counter() - t0,
        "id": reader.resolved_id,
        "bad": compare(want, got),
        "from_peers": sum(reader.from_peers.values()),
        "served": reader.served,
    }


def resume_latest(args: dict, rank: int, world: int) -> dict:
    """Load ``latest``, whatever step it is, and check it bit-exact against that step's state."""
    cfg = config_from_dict(args["config"])
    reader = TieredReader(cfg)
    t0 = time.perf_counter()
    probe = {"step": -1}
    dcp.load(probe, checkpoint_id="latest", storage_reader=reader)
    want = state(rank, probe["step"], args["mib"])
    got = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in want.items()}
    dcp.load(got, checkpoint_id=reader.resolved_id, storage_reader=TieredReader(cfg))
    return {"load_s": time.perf_counter() - t0, "id": reader.resolved_id, "bad": compare(want, got)}


if __name__ == "__main__":
    serve(
        {
            "save_steps": save_steps,
            "save_and_lose": save_and_lose,
            "resume": resume,
            "resume_latest": resume_latest,
            "train": train,
        }
    )
