"""Multi-rank scenarios for plan caching and plan reuse across restarts.

Run by ``distrun.run_world(..., script=tests/plan_scenarios.py)``:
``python tests/plan_scenarios.py SCENARIO ARGS_JSON RESULT_PATH`` in every rank after the gloo
process group is up. Each scenario returns JSON-able facts; the assertions live in
tests/test_plan_caching.py.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierckpt import TieredReader, TieredWriter
from tierckpt.capture.planning import layout_cache  # noqa: E402
from tierckpt.config import config_from_dict  # noqa: E402
from tierckpt.save import plancache  # noqa: E402
from tierckpt.testing.errors import err_text  # noqa: E402


def _err(e: BaseException) -> str:
    return err_text(e, 3000)


class CachingPlanner(DefaultSavePlanner):
    """DCP's default planner with plan caching (its own class: DCP's plan cache is keyed by it)."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


def model_state(rank: int, version: dict, step: int) -> dict:
    """Rank-own tensors (as sharded state is), shaped and typed by ``version``; values by ``step``."""
    n = version.get("n", 40)
    shapes = {int(k): v for k, v in version.get("shapes", {}).items()}
    dtypes = {int(k): getattr(torch, v) for k, v in version.get("dtypes", {}).items()}
    g = torch.Generator().manual_seed(step * 100 + rank)
    model = {}
    for i in range(n):
        shape = tuple(shapes.get(i, (5 + i % 7, 3 + rank)))
        t = torch.randn(shape, generator=g)
        model[f"r{rank}.layer{i}.w"] = t.to(dtypes.get(i, torch.float32))
    return {"model": model, "step": step, "note": "x" * (step % 5)}


def _version_for(args: dict, rank: int, save: int) -> dict:
    """The last of ``args['versions']`` that applies to ``rank`` from save number ``save`` on."""
    cur: dict = {}
    for v in args.get("versions", []):
        if v["from"] <= save and rank in v.get("ranks", [rank]):
            cur = v
    return cur


def _load_back(cfg, rank: int, cid: str, sd: dict) -> list[str]:
    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": -1, "note": None}
    dcp.load(target, checkpoint_id=cid, storage_reader=TieredReader(cfg))
    bad = [
        k
        for k, v in sd["model"].items()
        if target["model"][k].dtype != v.dtype
        or target["model"][k].shape != v.shape
        or not torch.equal(target["model"][k], v)
    ]
    if target["step"] != sd["step"] or target["note"] != sd["note"]:
        bad.append("step/note")
    return bad


def _watch_cached_plans(w: TieredWriter) -> list[bool]:
    """Record, per write_data call on this rank, whether DCP handed over a plan from its cache
    (one whose storage data is not this save's decision: the writer then reads it from the store)."""
    import tierckpt.save.writer as tw

    seen: list[bool] = []
    orig = w.write_data

    def write_data(plan, planner):
        ctx = w._ctx()
        sd = plan.storage_data
        seen.append(not (isinstance(sd, tw._PlanAssign) and ctx.info is not None and sd.seq == ctx.info.seq))
        return orig(plan, planner)

    w.write_data = write_data  # type: ignore[method-assign]
    return seen


def cached_saves(args: dict, rank: int, world: int) -> dict:
    """``args['saves']`` saves through one writer with a caching planner; each one waited for and
    loaded back. ``args['versions']``: per save range and ranks, the model's keys/shapes/dtypes.
    ``mode``: "sync" (dcp.save) or "async" (dcp.async_save, thread executor)."""
    cfg = config_from_dict(args["config"])
    w = TieredWriter(cfg)
    served = _watch_cached_plans(w)
    out: dict = {"saves": [], "errors": [], "served_from_cache": served}
    builds0 = layout_cache(w.engine.chunk_size).builds
    for s in range(args["saves"]):
        sd = model_state(rank, _version_for(args, rank, s), s)
        cid = None if args.get("generated") else f"step-{s:03d}"
        try:
            if args.get("mode") == "async":
                fut = dcp.async_save(sd, checkpoint_id=cid, storage_writer=w, planner=CachingPlanner())
                fut.result()
            else:
                dcp.save(sd, checkpoint_id=cid, storage_writer=w, planner=CachingPlanner())
            w.wait()
            saved = w.stats.checkpoint_id
            out["saves"].append(
                {
                    "id": saved,
                    "bad": _load_back(cfg, rank, saved, sd),
                    "builds": layout_cache(w.engine.chunk_size).builds - builds0,
                }
            )
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out["errors"].append(f"save {s}: {_err(e)}")
            out["saves"].append(None)
    out["channel"] = __import__("tierckpt.save.writer", fromlist=["_session"])._session.channel
    return out


def refusals(args: dict, rank: int, world: int) -> dict:
    """Cached saves that must be refused (an id already committed; ranks passing different ids),
    each followed by a save that must succeed."""
    cfg = config_from_dict(args["config"])
    w = TieredWriter(cfg)
    out: dict = {"steps": []}
    plan = [
        ("step-0", None),
        ("step-1", None),
        ("step-1", "conflict"),
        ("step-2", None),
        (f"step-3-r{rank}" if rank == world - 1 else "step-3", "ids"),
        ("step-4", None),
    ]
    for i, (cid, _expect) in enumerate(plan):
        sd = model_state(rank, {}, i)
        try:
            dcp.save(sd, checkpoint_id=cid, storage_writer=w, planner=CachingPlanner())
            w.wait()
            out["steps"].append({"id": cid, "ok": True, "bad": _load_back(cfg, rank, cid, sd)})
        except BaseException as e:  # noqa: BLE001
            out["steps"].append({"id": cid, "ok": False, "error": _err(e)})
    return out


def restart_save(args: dict, rank: int, world: int) -> dict:
    """A fresh process on an existing local tier: one save with a caching planner (first of the
    process), waited for and loaded back; reports whether the persisted plans were reused."""
    cfg = config_from_dict(args["config"])
    w = TieredWriter(cfg)
    version = args.get("version_by_rank", {}).get(str(rank), args.get("version", {}))
    sd = model_state(rank, version, args.get("step", 50))
    out: dict = {}
    try:
        dcp.save(sd, checkpoint_id=args["id"], storage_writer=w, planner=CachingPlanner())
        w.wait()
        st = plancache.status()
        out = {"seeded": st.seeded, "reason": st.reason, "bad": _load_back(cfg, rank, args["id"], sd)}
        # a second save in the same process: DCP's (seeded or fresh) cache serves it
        sd2 = model_state(rank, version, args.get("step", 50) + 1)
        dcp.save(sd2, checkpoint_id=args["id"] + "-b", storage_writer=w, planner=CachingPlanner())
        w.wait()
        out["bad2"] = _load_back(cfg, rank, args["id"] + "-b", sd2)
    except BaseException as e:  # noqa: BLE001
        out["error"] = _err(e)
        out["tb"] = traceback.format_exc()[-3000:]
    return out


SCENARIOS = {f.__name__: f for f in [cached_saves, refusals, restart_save]}


if __name__ == "__main__":
    from tierckpt.testing.launch import serve

    serve(SCENARIOS)
