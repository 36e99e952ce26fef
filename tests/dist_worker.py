"""Scenarios run by tests/distrun.py: ``python tests/dist_worker.py SCENARIO ARGS_JSON RESULT_PATH``.

Each scenario is a function ``name(args: dict, rank: int, world: int) -> dict`` run after the
gloo process group is up; its return value is written as JSON to RESULT_PATH.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierckpt import TierConfig, TieredReader, TieredWriter  # noqa: E402
from tierckpt.config import config_from_dict  # noqa: E402
from tierckpt.testing.launch import serve  # noqa: E402,F401 - also the entry point of other scenario modules


def make_cfg(args: dict) -> TierConfig:
    return config_from_dict(args["config"])


def state(rank: int, seed: int, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return {f"w{i}": torch.randn(64 + i, 33, generator=g) for i in range(n)} | {"meta": {"rank": rank, "seed": seed}}


def save_and_load(args: dict, rank: int, world: int) -> dict:
    """Every rank saves its own tensors (rank-prefixed keys), then loads and compares."""
    cfg = make_cfg(args)
    sd = {f"r{rank}": state(rank, args.get("seed", 0))}
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id=args["id"], storage_writer=w)
    w.wait()
    out = {
        f"r{rank}": {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"rank": None, "seed": None}
            for k, v in sd[f"r{rank}"].items()
        }
    }
    dcp.load(out, checkpoint_id=args.get("load_id", "latest"), storage_reader=TieredReader(cfg))
    same = all(torch.equal(sd[f"r{rank}"][k], out[f"r{rank}"][k]) for k in sd[f"r{rank}"] if k != "meta")
    return {"same": same, "meta": out[f"r{rank}"]["meta"], "stats": w.stats.to_json()}


SCENARIOS = {f.__name__: f for f in [save_and_load]}


def main() -> None:
    try:
        import dist_scenarios  # noqa: F401 - optional extra scenarios registered by tests

        SCENARIOS.update(getattr(dist_scenarios, "SCENARIOS", {}))
    except ImportError:
        pass
    serve(SCENARIOS)


if __name__ == "__main__":
    main()
