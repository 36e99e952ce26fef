"""Run a scenario in N real processes joined by a gloo process group (no mocks).

``run_world(world, scenario, args, workdir)`` is :func:`tierckpt.testing.launch.run_world` with
``tests/dist_worker.py`` as the default worker script; ``node_of(rank)`` gives groups of ranks
different ``TIERCKPT_NODE`` values, i.e. simulated nodes with their own local tier.

A scenario's ``args["config"]`` without ``[host] buffer_size`` gets :data:`POOL` bytes: the
default pool (1 GiB per rank, touched once) is sized for GPUs' state, and 16 ranks touching 16 GiB
on a 24 GiB test host spent most of a test in page faults and compaction.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierckpt.testing.launch import free_port
from tierckpt.testing.launch import run_world as _run_world

__all__ = ["free_port", "run_world"]

HERE = Path(__file__).resolve().parent
POOL = "32MiB"


def small_pool(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with ``config.host.buffer_size`` set to :data:`POOL` where the test left it out."""
    cfg = args.get("config")
    if not isinstance(cfg, dict) or "buffer_size" in cfg.get("host", {}):
        return args
    return {**args, "config": {**cfg, "host": {**cfg.get("host", {}), "buffer_size": POOL}}}


def run_world(
    world: int,
    scenario: str,
    args: dict[str, Any],
    workdir: Path,
    *,
    node_of: Callable[[int], str] | None = None,
    timeout: float = 180.0,
    expect_ok: bool = True,
    extra_env: dict[str, str] | None = None,
    script: Path | None = None,
    agent_store: bool = False,
    prefix_of: Callable[[int], list[str]] | None = None,
    hide_of: Callable[[int], list[str]] | None = None,
) -> list[dict]:
    """Run ``scenario`` on ``world`` ranks; return their results.

    ``script`` is the worker module (default tests/dist_worker.py); it is run as
    ``python SCRIPT SCENARIO ARGS_JSON RESULT_PATH``.
    """
    return _run_world(
        world,
        scenario,
        small_pool(args),
        workdir,
        script=script or HERE / "dist_worker.py",
        node_of=node_of,
        timeout=timeout,
        expect_ok=expect_ok,
        extra_env=extra_env,
        agent_store=agent_store,
        prefix_of=prefix_of,
        hide_of=hide_of,
    )
