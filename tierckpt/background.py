"""Background threads: lowered priority and a small FIFO worker pool that survives interpreter shutdown."""

from __future__ import annotations

import logging
import os
import queue
import threading

__all__ = ["lower_priority", "Workers"]

log = logging.getLogger("tierckpt")


def lower_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's niceness (Linux: per thread); no-op elsewhere."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:
        log.debug("cannot lower the priority of %s: %s", threading.current_thread().name, e)


class Workers:
    """A fixed set of daemon threads running submitted calls in FIFO order.

    Unlike ``ThreadPoolExecutor`` it keeps accepting work during interpreter shutdown, so the
    ``atexit`` handler can still drain checkpoints the user did not wait for.
    """

    def __init__(self, n: int, name: str, nice: int = 0) -> None:
        self._q: queue.Queue = queue.Queue()
        self._nice = nice
        self._lock = threading.Lock()
        self._stopped = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args) -> None:
        with self._lock:
            if not self._stopped:
                self._q.put((fn, args))
                return
        fn(*args)  # after shutdown: run here, so that the task's slot is still released

    def _run(self) -> None:
        lower_priority(self._nice)
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args = item
            fn(*args)  # callers catch their own errors (see Engine._flush_chunk)

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout=10)
