"""Small shared machinery: progress bars, worker counts under a memory budget, a cancellable pool."""

from __future__ import annotations

import os
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


FALLBACK_COLUMNS = 80
"""The bar's width on a terminal that reports no size (0 columns)."""


def _columns(stream: Any) -> int:
    """The width of the terminal ``stream`` writes to; 0 when it reports none."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "B") -> tqdm:
    """A tqdm bar on stderr (done so far, percentage, rate, time left). ``enabled=True`` shows it
    when stderr is a terminal, never otherwise (a pipe, a file: logs stay clean); False never
    (``-q``). A terminal that reports no size (0 columns: terminals opened by ``docker exec -t``,
    ``script`` and many CI runners) gets a bar of :data:`FALLBACK_COLUMNS` columns: tqdm would
    draw nothing at all there."""
    kw: dict[str, Any] = dict(unit_scale=True, unit_divisor=1024) if unit == "B" else {}
    stream = sys.stderr
    tty = enabled and hasattr(stream, "isatty") and stream.isatty()
    if tty and _columns(stream) <= 0:
        kw["ncols"], kw["nrows"] = FALLBACK_COLUMNS, 24  # tqdm takes the reported 0 x 0 as -1 x -1: nothing drawn
    else:
        kw["dynamic_ncols"] = True
    return tqdm(
        total=total,
        desc=desc,
        unit="iB" if unit == "B" else unit,  # binary multiples: MiB/s
        file=stream,
        disable=not tty,
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
