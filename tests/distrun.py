"""Run a scenario in N real processes joined by a gloo process group (no mocks).

``run_world(world, scenario, args, workdir)`` starts ``python tests/dist_worker.py`` once per
rank with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set (a free loopback port),
waits for all of them, and returns each rank's JSON result. ``node_of(rank)`` lets a test give
groups of ranks different ``TIERCKPT_NODE`` values, i.e. simulated nodes with their own local tier.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, scenario: str, args: dict[str, Any], workdir: Path, *,
              node_of: Callable[[int], str] | None = None, timeout: float = 180.0,
              expect_ok: bool = True, extra_env: dict[str, str] | None = None,
              script: Path | None = None) -> list[dict]:
    """Run ``scenario`` on ``world`` ranks; return their results.

    ``script`` is the worker module (default tests/dist_worker.py); it is run as
    ``python SCRIPT SCENARIO ARGS_JSON RESULT_PATH``.
    """
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    procs = []
    for r in range(world):
        env = dict(os.environ)
        env.update({"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "TIERCKPT_NODE": node_of(r) if node_of else "node0"})
        env.update(extra_env or {})
        out = open(workdir / f"rank{r}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(script or HERE / "dist_worker.py"), scenario, json.dumps(args),
                                        str(workdir / f"result{r}.json")], env=env, stdout=out, stderr=subprocess.STDOUT), out))
    codes = []
    try:
        for p, out in procs:
            try:
                codes.append(p.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close()
    logs = {r: (workdir / f"rank{r}.log").read_text()[-4000:] for r in range(world)}
    if expect_ok and any(c != 0 for c in codes):
        raise AssertionError(f"scenario {scenario} failed: exit codes {codes}\n" + "\n".join(f"--- rank {r}\n{l}" for r, l in logs.items()))
    results = []
    for r in range(world):
        f = workdir / f"result{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else {"exit": codes[r], "log": logs[r]})
    return results
