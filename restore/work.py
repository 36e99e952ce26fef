"""Small shared machinery: progress bars, worker counts under a memory budget, a cancellable pool."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from tqdm import tqdm

from tierckpt.load.readback import BUFFER_BUDGET, workers
from tierckpt.tiers.base import Tier

__all__ = ["BUFFER_BUDGET", "progress_bar", "run_all", "workers_for"]

T = TypeVar("T")


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "B") -> tqdm:
    """A tqdm bar on stderr. ``enabled=True`` shows it on a terminal only; False never."""
    kw: dict[str, Any] = dict(unit_scale=True, unit_divisor=1024) if unit == "B" else {}
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=None if enabled else True,
        dynamic_ncols=True,
        leave=False,
        **kw,
    )


def workers_for(tier: Tier, range_size: int, budget: int = BUFFER_BUDGET) -> int:
    """Parallel range reads on ``tier``: its ``read_concurrency`` (``[s3] concurrency``,
    ``[local] flush_threads``), capped so that ``workers * range_size`` stays within ``budget``
    bytes (:func:`tierckpt.readback.workers`)."""
    return workers(tier, range_size, budget)


def run_all(
    fn: Callable[[T], Any],
    tasks: Iterable[T],
    workers: int,
    on_done: Callable[[T, Any], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Run ``fn(task)`` for every task on ``workers`` threads; ``on_done(task, result)`` in this thread.

    The first exception (``KeyboardInterrupt`` in this thread included) sets ``stop``, cancels the
    tasks not started, waits for the running ones, and propagates. Tasks should check ``stop``.
    """
    stop = stop or threading.Event()
    tasks = list(tasks)
    if not tasks:
        return
    ex = ThreadPoolExecutor(max_workers=max(1, min(workers, len(tasks))), thread_name_prefix="tierckpt-restore")
    futs: dict[Future, T] = {}
    try:
        futs = {ex.submit(fn, t): t for t in tasks}
        pending = set(futs)
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
            for f in done:
                res = f.result()  # raises the task's error
                if on_done is not None:
                    on_done(futs[f], res)
    except BaseException:
        stop.set()
        for f in futs:
            f.cancel()
        ex.shutdown(wait=True, cancel_futures=True)
        raise
    ex.shutdown(wait=True)
