"""The multi-rank launcher: N real processes joined by a gloo process group (no mocks).

Parent side (imports neither torch nor pytest)::

    results = run_world(2, "save_and_load", {"id": "c1", ...}, workdir, script=Path("scenarios.py"))

starts ``python SCRIPT SCENARIO ARGS_JSON RESULT_PATH`` once per rank with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` (a free loopback port) set, waits
for all of them and returns each rank's JSON result. Worker side, the script ends with
``serve(SCENARIOS)``: it joins the process group, runs ``SCENARIOS[name](args, rank, world)`` and
writes what it returns as JSON. :func:`launch_ranks` is the bare launch for workers with their own
command line (benchmarks).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

__all__ = ["free_port", "rank_env", "launch_ranks", "run_world", "serve", "can_hide_paths", "hide_paths"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def can_hide_paths() -> bool:
    """Whether :func:`hide_paths` works here: root, with ``unshare`` and a private mount namespace."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


def hide_paths(paths: list[str]) -> list[str]:
    """A command prefix that runs the command in its own mount namespace where each of ``paths``
    (existing directories) is covered by an empty tmpfs: the process cannot see what they hold,
    as on another machine (simulated nodes that must not read each other's disks). Needs
    :func:`can_hide_paths`."""
    import shlex

    mounts = " && ".join(f"mount -t tmpfs tmpfs {shlex.quote(p)}" for p in paths)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh"]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment variables torchrun would give ``rank`` of ``world`` on one loopback node."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def launch_ranks(world: int, argv: Callable[[int], list[str]], workdir: Path, *, timeout: float,
                 env_of: Callable[[int], dict[str, str]] | None = None,
                 prefix_of: Callable[[int], list[str]] | None = None,
                 agent_store: bool = False) -> tuple[list[int | None], dict[int, str]]:
    """Start ``argv(rank)`` for every rank (environment: ours + :func:`rank_env` + ``env_of(rank)``;
    command prefixed by ``prefix_of(rank)``, e.g. :func:`hide_paths`), output to
    ``workdir/rank<r>.log``; wait for all of them.

    ``agent_store``: this process hosts the job's TCPStore, as torchrun's agent does, so the
    store outlives any rank (rank 0 included); otherwise rank 0's process hosts it.

    Returns (exit codes, None for a rank still running after ``timeout`` seconds, which is killed;
    the log of every rank). Every process has exited when it returns.
    """
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    procs = []
    store = None
    if agent_store:
        import datetime

        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))
    try:
        for r in range(world):
            env = dict(os.environ)
            env.update(rank_env(r, world, port))
            if agent_store:
                env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
            env.update(env_of(r) if env_of else {})
            out = open(workdir / f"rank{r}.log", "w")
            procs.append((subprocess.Popen((prefix_of(r) if prefix_of else []) + argv(r), env=env, stdout=out, stderr=subprocess.STDOUT), out))
        codes: list[int | None] = []
        for p, _ in procs:
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
        del store
    logs = {r: (workdir / f"rank{r}.log").read_text() for r in range(world)}
    return codes, logs


def run_world(world: int, scenario: str, args: dict[str, Any], workdir: Path, *, script: Path,
              node_of: Callable[[int], str] | None = None, timeout: float = 180.0, expect_ok: bool = True,
              extra_env: dict[str, str] | None = None, prefix_of: Callable[[int], list[str]] | None = None,
              agent_store: bool = False) -> list[dict]:
    """Run ``scenario`` of the worker module ``script`` on ``world`` ranks; return their results.

    ``node_of(rank)`` sets ``TIERCKPT_NODE`` per rank (default ``"node0"``): groups of ranks with
    different values are simulated nodes with their own ``[local] path = ".../{node}"``.
    With ``expect_ok``, any rank exiting non-zero (or timing out) raises AssertionError with every
    rank's log tail; otherwise a rank without a result gives ``{"exit": code, "log": tail}``.
    ``agent_store``: see :func:`launch_ranks`.
    """
    def env_of(r: int) -> dict[str, str]:
        return {"TIERCKPT_NODE": node_of(r) if node_of else "node0"} | (extra_env or {})

    codes, full_logs = launch_ranks(
        world, lambda r: [sys.executable, str(script), scenario, json.dumps(args), str(workdir / f"result{r}.json")],
        workdir, timeout=timeout, env_of=env_of, prefix_of=prefix_of, agent_store=agent_store)
    logs = {r: text[-4000:] for r, text in full_logs.items()}
    if expect_ok and any(c != 0 for c in codes):
        raise AssertionError(f"scenario {scenario} failed: exit codes {codes}\n" + "\n".join(f"--- rank {r}\n{l}" for r, l in logs.items()))
    results = []
    for r in range(world):
        f = workdir / f"result{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else {"exit": codes[r], "log": logs[r]})
    return results


def serve(scenarios: dict[str, Callable[[dict, int, int], dict]], *, report_errors: bool = False) -> None:
    """Worker side of :func:`run_world`: run the scenario named by ``sys.argv`` in a gloo process
    group, write its result to ``sys.argv[3]``, and exit 0 without running atexit handlers.

    ``report_errors``: a scenario that raises gives ``{"errors": ["scenario crashed: ..."]}`` as
    its result (the test sees the error as text); otherwise the process dies with it.
    """
    import torch.distributed as dist

    from .errors import err_text

    name, args_json, result_path = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = scenarios[name](json.loads(args_json), rank, world)
    except BaseException as e:  # noqa: BLE001 - the test gets the error as text
        if not report_errors:
            raise
        result = {"errors": [f"scenario crashed: {err_text(e, 3000)}\n{traceback.format_exc()[-3000:]}"]}
    Path(result_path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip the atexit drain: every scenario waits for its own work
