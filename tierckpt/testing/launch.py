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
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _hide_here(paths: list[str]) -> None:
    """In a freshly forked, single-threaded rank: what :func:`hide_paths` does for an exec'd one,
    without exec (so the rank keeps the fork server's imported torch): a private mount namespace
    of its own (``unshare(CLONE_NEWNS)``, as ``unshare --mount --propagation private`` does), then
    an empty tmpfs over each of ``paths``. Raises OSError when the kernel refuses."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    for cmd in (["mount", "--make-rprivate", "/"], *(["mount", "-t", "tmpfs", "tmpfs", p] for p in paths)):
        subprocess.run(cmd, check=True, capture_output=True)


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment variables torchrun would give ``rank`` of ``world`` on one loopback node."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


def launch_ranks(
    world: int,
    argv: Callable[[int], list[str]],
    workdir: Path,
    *,
    timeout: float,
    env_of: Callable[[int], dict[str, str]] | None = None,
    prefix_of: Callable[[int], list[str]] | None = None,
    agent_store: bool = False,
    hide_of: Callable[[int], list[str]] | None = None,
) -> tuple[list[int | None], dict[int, str]]:
    """Start ``argv(rank)`` for every rank (environment: ours + :func:`rank_env` + ``env_of(rank)``;
    command prefixed by ``prefix_of(rank)``), output to ``workdir/rank<r>.log``; wait for all of them.

    ``hide_of(rank)``: directories that rank must not see (another machine's disks), covered as
    :func:`hide_paths` does (needs :func:`can_hide_paths`): in the forked rank itself, or through
    the :func:`hide_paths` prefix when the rank is exec'd.

    ``agent_store``: this process hosts the job's TCPStore, as torchrun's agent does, so the
    store outlives any rank (rank 0 included); otherwise rank 0's process hosts it.

    Returns (exit codes, None for a rank still running after ``timeout`` seconds, which is killed;
    the log of every rank). Every process has exited when it returns.
    """
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    procs: list[_Forked | _Exec] = []
    store = None
    if agent_store:
        import datetime

        from torch.distributed import TCPStore

        store = TCPStore(
            "127.0.0.1",
            port,
            world,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
    deadline = time.monotonic() + timeout
    try:
        for r in range(world):
            env = dict(os.environ)
            env.update(rank_env(r, world, port))
            if agent_store:
                env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
            env.update(env_of(r) if env_of else {})
            cmd, log = argv(r), workdir / f"rank{r}.log"
            hide = hide_of(r) if hide_of else []
            if prefix_of is None and _forkable(cmd):
                procs.append(_Forked(cmd, env, log, hide))
            else:
                prefix = (prefix_of(r) if prefix_of else []) + (hide_paths(hide) if hide else [])
                procs.append(_Exec(prefix + cmd, env, log))
        codes = [p.wait(max(0.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            p.stop()
        del store
    logs = {r: (workdir / f"rank{r}.log").read_text() for r in range(world)}
    return codes, logs


# -- starting the ranks ---------------------------------------------------------------------------
# Importing torch costs a new Python process about 4 CPU-seconds; a 16-rank job started with plain
# exec spends a minute of CPU before its first line of work. Python scripts are therefore started
# through multiprocessing's fork server, which imports torch once (see _PRELOAD) and forks every rank
# from there (hiding directories in the rank itself). Anything else (a command prefix, another program) is exec'd, as
# is everything when TIERCKPT_LAUNCH=exec.

_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint"]
_ctx: Any = None


def _forkable(cmd: list[str]) -> bool:
    return (
        os.environ.get("TIERCKPT_LAUNCH", "fork") != "exec"
        and len(cmd) >= 2
        and cmd[0] == sys.executable
        and cmd[1].endswith(".py")
        and not cmd[1].startswith("-")
    )


def _fork_context() -> Any:
    global _ctx
    if _ctx is None:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _ctx = ctx
    return _ctx


def _run_script(cmd: list[str], env: dict[str, str], log: str, hide: list[str]) -> None:
    """In a rank forked from the fork server: what ``python SCRIPT ARGS...`` would do, with ``env``
    as the whole environment, stdout and stderr going (unbuffered) to ``log``, and the
    directories ``hide`` covered (:func:`_hide_here`)."""
    import faulthandler
    import io
    import runpy
    import signal

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(open(1, "wb", 0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), write_through=True)
    os.environ.clear()
    os.environ.update(env)
    if hide:
        _hide_here(hide)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # _Forked.stop: stacks of a hung rank
    if env.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    script = os.path.abspath(cmd[1])
    sys.argv = [script, *cmd[2:]]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


class _Forked:
    """A rank forked from the fork server."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, hide: list[str]) -> None:
        self.p = _fork_context().Process(target=_run_script, args=(cmd, env, str(log), hide))
        self.p.start()

    def wait(self, timeout: float) -> int | None:
        self.p.join(timeout)
        return self.p.exitcode

    def stop(self) -> None:
        if self.p.exitcode is None:
            _dump_stacks(self.p.pid)
            self.p.kill()
            self.p.join()


def _dump_stacks(pid: int | None) -> None:
    """Ask a rank that ran past its timeout to write every thread's Python stack to its log
    (faulthandler on SIGUSR1, registered by :func:`_run_script`), so a hang says where it is."""
    import signal

    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return
    time.sleep(1.0)


class _Exec:
    """A rank started with exec (``subprocess.Popen``)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.out = open(log, "w")
        self.p = subprocess.Popen(cmd, env=env, stdout=self.out, stderr=subprocess.STDOUT)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self.out.close()


def run_world(
    world: int,
    scenario: str,
    args: dict[str, Any],
    workdir: Path,
    *,
    script: Path,
    node_of: Callable[[int], str] | None = None,
    timeout: float = 180.0,
    expect_ok: bool = True,
    extra_env: dict[str, str] | None = None,
    prefix_of: Callable[[int], list[str]] | None = None,
    agent_store: bool = False,
    hide_of: Callable[[int], list[str]] | None = None,
) -> list[dict]:
    """Run ``scenario`` of the worker module ``script`` on ``world`` ranks; return their results.

    ``node_of(rank)`` sets ``TIERCKPT_NODE`` per rank (default ``"node0"``): groups of ranks with
    different values are simulated nodes with their own ``[local] path = ".../{node}"``.
    With ``expect_ok``, any rank exiting non-zero (or timing out) raises AssertionError with every
    rank's log tail; otherwise a rank without a result gives ``{"exit": code, "log": tail}``.
    ``agent_store``, ``prefix_of``, ``hide_of``: see :func:`launch_ranks`.
    """

    def env_of(r: int) -> dict[str, str]:
        return {"TIERCKPT_NODE": node_of(r) if node_of else "node0"} | (extra_env or {})

    codes, full_logs = launch_ranks(
        world,
        lambda r: [sys.executable, str(script), scenario, json.dumps(args), str(workdir / f"result{r}.json")],
        workdir,
        timeout=timeout,
        env_of=env_of,
        prefix_of=prefix_of,
        agent_store=agent_store,
        hide_of=hide_of,
    )
    logs = {r: text[-4000:] for r, text in full_logs.items()}
    if expect_ok and any(c != 0 for c in codes):
        raise AssertionError(
            f"scenario {scenario} failed: exit codes {codes}\n"
            + "\n".join(f"--- rank {r}\n{l}" for r, l in logs.items())
        )
    results = []
    for r in range(world):
        f = workdir / f"result{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else {"exit": codes[r], "log": logs[r]})
    return results


def serve(scenarios: dict[str, Callable[[dict, int, int], dict]], *, report_errors: bool = False) -> None:
    """Worker side of :func:`run_world`: run the scenario named by ``sys.argv`` in a gloo process
    group, write its result to ``sys.argv[3]``, and exit 0 without running atexit handlers.

    ``report_errors``: a scenario that raises gives ``{"errors": ["scenario crashed: ..."]}`` as
    its result (the test sees the error as text); otherwise the process dies with it. A scenario
    that kills ranks names them in its result's ``dead_ranks``: the others do not wait for them.
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
            _done(1, world)  # counted as arrived (rank 0 waits for no one): the failure ends the run
            raise
        result = {"errors": [f"scenario crashed: {err_text(e, 3000)}\n{traceback.format_exc()[-3000:]}"]}
    Path(result_path).write_text(json.dumps(result))
    _done(rank, world - len(result.get("dead_ranks", ())) if isinstance(result, dict) else world)
    os._exit(0)  # skip the atexit drain: every scenario waits for its own work


def _done(rank: int, alive: int) -> None:
    """The end of :func:`serve`: rank 0, when it hosts the job's store, stays until the ``alive``
    ranks (the world less the ``dead_ranks`` a scenario names) have written their results; the
    others go at once. Through the store, not a gloo barrier: that would wait its full timeout for
    a rank a scenario killed. (Rank 0 must not linger otherwise: ranks still blocked in a gloo
    collective with it fail only when it goes.)"""
    from torch.distributed import distributed_c10d as c10d

    try:
        store = c10d._get_default_store()
        store.add("tierckpt-serve/done", 1)
        deadline = time.monotonic() + 300
        host = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # else the launcher hosts it
        while rank == 0 and host and store.add("tierckpt-serve/done", 0) < alive and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store's host died (a scenario killed it): nothing to wait for
        pass
