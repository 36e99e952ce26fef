"""Extra multi-rank scenarios for tests/dist_worker.py (``SCENARIOS``: name -> fn(args, rank, world) -> dict).

Run by ``distrun.run_world`` in real processes joined by a gloo process group. Every scenario
returns JSON-able facts (mismatching keys, errors as text); the assertions live in the tests.
The state is rebuilt from seeds in each process, so the test process can rebuild it too.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierckpt import TieredReader, TieredWriter  # noqa: E402
from tierckpt.config import config_from_dict  # noqa: E402
from tierckpt.testing import bits, compare, placeholder  # noqa: E402,F401 - re-exported to the tests
from tierckpt.testing.errors import err_text as _err  # noqa: E402

MiB = 1 << 20


# -- deterministic state (shared with the tests) ----------------------------------------------


def rank_state(rank: int, seed: int) -> dict:
    s = seed * 1000 + rank * 10
    return {
        "f32": bits((300 + rank, 17), torch.float32, s),
        "bf16": bits((65, 3 + rank), torch.bfloat16, s + 1),
        "f16": bits((129,), torch.float16, s + 2),
        "i64": bits((40, 2), torch.int64, s + 3),
        "u8": bits((1000 + 7 * rank,), torch.uint8, s + 4),
        "bool": bits((77,), torch.uint8, s + 5) > 127,
        "c64": bits((9, 2), torch.complex64, s + 6),
        "scalar": torch.tensor(float(rank) + 0.25),
        "empty": torch.empty(0, 3),
        "big": bits((MiB // 8 * 3 + rank,), torch.float32, s + 7),  # 1.5 MiB: spans 1 MiB chunks
        "meta": {"rank": rank, "seed": seed, "tags": ["a", ("b", rank)]},
    }


def shared_state(seed: int) -> dict:
    return {"rep": bits((33, 5), torch.float32, seed * 7 + 1), "obj": {"seed": seed, "name": "shared"}}


def cfg_of(args: dict):
    return config_from_dict(args["config"])


# -- scenarios ------------------------------------------------------------------------------------


def save_load_exact(args: dict, rank: int, world: int) -> dict:
    """Each rank saves its own keys plus replicated ones, waits, then loads ``args['load']``.

    load: "own" (its own keys), "peer" (the next rank's keys and the replicated ones: reads files
    written by other ranks).
    """
    cfg = cfg_of(args)
    seed = args.get("seed", 0)
    sd = {f"r{rank}": rank_state(rank, seed), "shared": shared_state(seed), "world": world}
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id=args["id"], storage_writer=w)
    w.wait()
    peer = (rank + 1) % world if args.get("load", "own") == "peer" else rank
    expected = {f"r{peer}": rank_state(peer, seed)}
    if args.get("load") == "peer":
        expected |= {"shared": shared_state(seed), "world": world}
    target = placeholder(expected)
    if "world" in target:
        target["world"] = 0
    r = TieredReader(cfg)
    dcp.load(target, checkpoint_id=args.get("load_id", "latest"), storage_reader=r)
    return {
        "mismatches": compare(expected, target),
        "resolved": r.resolved_id,
        "peer": peer,
        "saved_id": w.stats.checkpoint_id if w.stats else None,
    }


def generated_ids(args: dict, rank: int, world: int) -> dict:
    """One writer instance, several saves without checkpoint_id (and one with an explicit id)."""
    cfg = cfg_of(args)
    w = TieredWriter(cfg)
    out: dict = {"errors": [], "ids": []}
    plan = [None, None, "step-x", None]
    for i, cid in enumerate(plan):
        sd = {f"r{rank}": {"t": torch.full((5,), float(i))}, "i": i}
        try:
            if cid is None:
                dcp.save(sd, storage_writer=w)
            else:
                dcp.save(sd, checkpoint_id=cid, storage_writer=w)
            w.wait()
            out["ids"].append(w.stats.checkpoint_id if w.stats else None)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out["errors"].append(f"save {i}: {_err(e)}")
    return out


def dtensor_full(seed: int) -> dict:
    return {
        "a": bits((10, 7), torch.float32, seed + 1),  # 10 rows on 4 ranks: 3, 3, 3, 1
        "b": bits((3, 5), torch.bfloat16, seed + 2),  # 3 rows on 4 ranks: one rank holds nothing
        "c": bits((17, 6), torch.int64, seed + 3),
        "d": bits((8, 6), torch.float32, seed + 4),  # divisible
        "e": bits((2, 9), torch.float16, seed + 5),
        "v": bits((13,), torch.float32, seed + 6),  # 1-d
    }


def dtensor_save(args: dict, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    cfg = cfg_of(args)
    mesh = init_device_mesh("cpu", (world,))
    full = dtensor_full(args.get("seed", 0))
    model = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()}
    model["rep"] = distribute_tensor(full["d"] + 1, mesh, [Replicate()], src_data_rank=None)
    model["plain"] = full["e"].clone()  # an ordinary tensor, identical on every rank
    w = TieredWriter(cfg)
    dcp.save({"model": model, "step": 10}, checkpoint_id=args["id"], storage_writer=w)
    w.wait()
    return {"local_rows": {k: int(v.to_local().shape[0]) for k, v in model.items() if k not in ("rep", "plain")}}


def dtensor_load(args: dict, rank: int, world: int) -> dict:
    """Load a sharded checkpoint resharded: Shard(1) for matrices (Shard(0) for vectors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    cfg = cfg_of(args)
    mesh = init_device_mesh("cpu", (world,))
    full = dtensor_full(args.get("seed", 0))
    full["rep"] = full["d"] + 1
    full["plain"] = full["e"].clone()

    def placement(t):
        return [Shard(1) if t.dim() > 1 else Shard(0)]

    target = {
        k: distribute_tensor(torch.zeros_like(v), mesh, placement(v), src_data_rank=None) for k, v in full.items()
    }
    expected = {k: distribute_tensor(v, mesh, placement(v), src_data_rank=None).to_local() for k, v in full.items()}
    state = {"model": target, "step": 0}
    dcp.load(state, checkpoint_id=args["id"], storage_reader=TieredReader(cfg))
    got = {k: v.to_local() for k, v in target.items()}
    # every rank also checks the reassembled global tensors (float types only: gloo gathers)
    whole = {k: target[k].full_tensor() for k in ("a", "d", "v", "rep")}
    return {
        "mismatches": compare(expected, got),
        "step": state["step"],
        "whole_mismatches": compare({k: full[k] for k in whole}, whole),
    }


def commit_then_die(args: dict, rank: int, world: int) -> None:
    """Commit ``step-1``; then start ``step-2`` (large state, tiny pool) and die right after dcp.save."""
    cfg = cfg_of(args)
    seed = args.get("seed", 0)
    w = TieredWriter(cfg)
    dcp.save({f"r{rank}": rank_state(rank, seed), "step": 1}, checkpoint_id="step-1", storage_writer=w)
    w.wait()
    n = args.get("big_mib", 16) * MiB // 4 // 8
    big = {f"r{rank}": {f"t{i}": torch.arange(n, dtype=torch.float32) + i for i in range(8)}, "step": 2}
    dcp.save(big, checkpoint_id="step-2", storage_writer=w)
    # The capture starts once dcp.save is done with the process: let it open its file first, so
    # that the kill leaves a partial step-2 behind (the pool is far too small for it to complete).
    import time

    deadline = time.monotonic() + 60
    while w.last is not None and w.last.sink is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(9)  # killed: no wait, no atexit drain, no barrier


def error_report(args: dict, rank: int, world: int) -> dict:
    """Run another scenario and report its exception as text instead of failing the process."""
    try:
        return {"ok": True, "result": SCENARIOS[args["inner"]](args, rank, world)}
    except BaseException as e:  # noqa: BLE001
        return {"ok": False, "error": _err(e), "tb": traceback.format_exc()[-3000:]}


SCENARIOS = {
    f.__name__: f for f in [save_load_exact, generated_ids, dtensor_save, dtensor_load, commit_then_die, error_report]
}


# -- many ranks: waits are bounded and name who is missing --------------------------------------


def _small_state(rank: int, seed: int) -> dict:
    return {
        f"r{rank}": {"w": bits((64, 4), torch.float32, seed * 100 + rank)},
        "rep": shared_state(seed)["rep"],
        "step": seed,
    }


def staggered_load(args: dict, rank: int, world: int) -> dict:
    """Save ``step-1``, then enter ``dcp.load`` ``rank * stagger`` seconds after rank 0."""
    import time

    cfg = cfg_of(args)
    w = TieredWriter(cfg)
    dcp.save(_small_state(rank, 1), checkpoint_id="step-1", storage_writer=w)
    w.wait()
    time.sleep(rank * args.get("stagger", 0.3))
    expected = _small_state(rank, 1)
    target = placeholder(expected)
    target["step"] = 0
    r = TieredReader(cfg)
    dcp.load(target, checkpoint_id="latest", storage_reader=r)
    return {"mismatches": compare(expected, target), "resolved": r.resolved_id}


def _die_at(victim: int, rank: int, phase: str) -> None:
    """In rank ``victim`` only: make it die (``os._exit(9)``: no cleanup, no atexit) at ``phase`` of
    ``step-2``, by wrapping the library function that runs that phase in this process."""
    if rank != victim:
        return
    from tierckpt.chain import commit, peercopy, peers, replicate
    from tierckpt.save import writer

    def dead(*_a, **_k):
        os._exit(9)

    if phase == "plan":  # inside dcp.save, on entering prepare_local_plan: before it checks in
        # (its check-in is the last thing prepare_local_plan does), so before its plan reaches the coordinator
        writer.TieredWriter.prepare_local_plan = dead
    elif phase == "commit":  # right after this rank reported its file durable, before the outcome
        report = commit.Round.report

        def report_then_die(self, ok, **fields):
            report(self, ok, **fields)
            if "step-2" in self.what:
                os._exit(9)

        commit.Round.report = report_then_die
    elif phase == "hop":  # in the middle of its copy to the second tier (S3)
        replicate.Replicator._replicate = lambda self, job: dead() if job.id == "step-2" else None
    elif phase == "peer":  # in the save's peer exchange (copying its file to its partner node)
        peercopy.PeerHop._exchange = dead
    elif phase == "exchange":  # in the load's exchange, serving files to a node that lost its disk
        peers.PeerGroup.exchange = dead


def _error_log() -> list[str]:
    """The messages of ERROR records logged by tierckpt from now on in this process (a list the
    scenario returns: what a rank logged besides what it raised)."""
    import logging

    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                logged.append(record.getMessage())

    logging.getLogger("tierckpt").addHandler(Keep())
    return logged


def die_in_phase(args: dict, rank: int, world: int) -> dict:
    """Commit ``step-1``; then rank ``victim`` dies in ``phase`` and the other ranks report the
    error they got (and the tierckpt errors they logged). Phases of ``step-2``'s save: ``plan``
    (in DCP's planning), ``save`` (right after ``dcp.save`` returns: its file is being written),
    ``commit`` (right after its report), ``hop`` (copying to the second tier), ``peer`` (the peer
    copies). Phases of a load of ``step-1``: ``load`` (instead of entering ``dcp.load``),
    ``exchange`` (serving files to the ranks of node ``args['wiped']``, whose disk is wiped first)."""
    import shutil
    import time

    import torch.distributed as dist

    cfg = cfg_of(args)
    victim, phase = args["victim"], args["phase"]
    logged = _error_log()
    w = TieredWriter(cfg)
    dcp.save(_small_state(rank, 1), checkpoint_id="step-1", storage_writer=w)
    w.wait()
    _die_at(victim, rank, phase)
    t0 = time.monotonic()
    try:
        if phase in ("plan", "save", "commit", "hop", "peer"):
            dcp.save(_small_state(rank, 2), checkpoint_id="step-2", storage_writer=w)
            if rank == victim and phase == "save":
                os._exit(9)
            w.wait()
        else:
            if phase == "exchange":
                dist.barrier()  # every rank is done with step-1 before a node's disk goes
                if os.environ.get("TIERCKPT_NODE") == args["wiped"] and rank % 2 == 0:
                    for child in Path(args["config"]["local"]["path"].replace("{node}", args["wiped"])).iterdir():
                        shutil.rmtree(child) if child.is_dir() else child.unlink()
                dist.barrier()
            if rank == victim and phase == "load":
                os._exit(9)
            target = placeholder(_small_state(rank, 1))
            dcp.load(target, checkpoint_id="latest", storage_reader=TieredReader(cfg))
        return {"error": None, "seconds": time.monotonic() - t0, "logged": logged, "dead_ranks": [victim]}
    except BaseException as e:  # noqa: BLE001 - the error is the result
        return {
            "dead_ranks": [victim],
            "error": _err(e),
            "seconds": time.monotonic() - t0,
            "logged": logged,
            "tb": traceback.format_exc()[-2500:],
        }


def check_in_cases(args: dict, rank: int, world: int) -> dict:
    """The save's check-in (tierckpt.chain.checkin), on real ranks: ``step-1`` with rank 1 entering
    ``dcp.save`` ``args['slow']`` seconds late; ``step-2`` with rank ``args['skipper']``'s planning
    raising before it checks in (every rank reports the error it got and what it logged); ``step-2``
    again (a retry under the same id); ``step-3``. Reports which check-in keys the store still holds."""
    import time

    from torch.distributed import distributed_c10d as c10d

    from tierckpt.chain.checkin import Group, check_in, prefix_of
    from tierckpt.save import writer
    from tierckpt.testing.counting import install

    counters = install()
    with counters.phase("check_in"):  # the check-in alone, as every save does it: its store operations
        check_in("probe-1", Group("default", world, rank, 0), 60)
    out: dict = {"ops": counters.dump()["check_in"]["store"]}
    logged = _error_log()
    w = TieredWriter(cfg_of(args))
    if rank == 1:
        time.sleep(args["slow"])
    t0 = time.monotonic()
    dcp.save(_small_state(rank, 1), checkpoint_id="step-1", storage_writer=w)
    out["slow_s"] = time.monotonic() - t0
    w.wait()
    orig = writer.TieredWriter.prepare_local_plan
    if rank == args["skipper"]:

        def broken(self, plan):
            raise RuntimeError(f"planning broke on rank {rank}")

        writer.TieredWriter.prepare_local_plan = broken  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        dcp.save(_small_state(rank, 2), checkpoint_id="step-2", storage_writer=w)
        out["error"] = None
    except BaseException as e:  # noqa: BLE001 - the error is the result
        out["error"] = _err(e)
        fails = getattr(e, "failures", None) or {}  # DCP's CheckpointException: each rank's error
        out["failures"] = {str(r): str(v[0] if isinstance(v, tuple) else v)[:400] for r, v in fails.items()}
    out["failed_s"] = time.monotonic() - t0
    out["logged"] = list(logged)
    writer.TieredWriter.prepare_local_plan = orig  # type: ignore[method-assign]
    dcp.save(_small_state(rank, 2), checkpoint_id="step-2", storage_writer=w)
    dcp.save(_small_state(rank, 3), checkpoint_id="step-3", storage_writer=w)
    w.wait()
    w.close()
    store = c10d._get_default_store()
    names = [f"in{r}" for r in range(world)] + ["v", "read"]
    out["left"] = [
        f"{cid}/{n}"
        for cid in ("probe-1", "step-1", "step-2", "step-3")
        for n in names
        if store.check([f"{prefix_of('default', cid)}/{n}"])
    ]
    return out


def store_threads(args: dict, rank: int, world: int) -> dict:
    """A thread blocked in the job's store ``wait`` does not hold up another thread's operations:
    the main thread waits for a key that this rank's background thread sets, then the other way
    round (on one shared TCPStore client, each ``set`` would queue behind the ``wait`` until it timed
    out). Each wait is bounded by ``args["timeout"]``; the result says which ones timed out."""
    import datetime
    import threading
    import time

    from tierckpt.chain import jobstore
    from tierckpt.chain.jobstore import JobStore, thread_client

    store, timeout = JobStore(), datetime.timedelta(seconds=args["timeout"])
    out: dict = {"timed_out": []}

    def wait(key: str) -> None:
        try:
            store.wait([key], timeout)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["timed_out"].append(f"{key}: {e}"[:200])

    clients: list = []

    def background(set_first: bool) -> None:
        clients.extend([thread_client(), thread_client()])
        if set_first:
            store.set(f"t/{rank}/main", b"1")  # the main thread is waiting for it
        else:
            wait(f"t/{rank}/bg")

    first = threading.Thread(target=background, args=(True,))
    first.start()
    wait(f"t/{rank}/main")
    first.join()
    # an ended thread's client is not freed by that thread as it ends (see jobstore: freed by the
    # next thread that makes a client, never during interpreter shutdown by a dying thread)
    out["kept_after_end"] = first in jobstore._clients
    t = threading.Thread(target=background, args=(False,))
    t.start()
    time.sleep(0.5)  # let it block in its wait first
    store.set(f"t/{rank}/bg", b"1")
    t.join()
    out["freed_later"] = first not in jobstore._clients
    main = thread_client()
    out["own_clients"] = clients[0] is clients[1] and clients[0] is not main and clients[2] is not clients[0]
    return out


def visible(args: dict, rank: int, world: int) -> dict:
    """What this rank sees in each of ``args["dirs"]`` (file names, sorted)."""
    return {"seen": {d: sorted(os.listdir(d)) for d in args["dirs"]}}


SCENARIOS.update({f.__name__: f for f in [staggered_load, die_in_phase, check_in_cases, store_threads, visible]})
