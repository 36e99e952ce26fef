"""The telemetry thread: where everything telemetry does that may block runs, off the checkpoint's path.

The checkpoint's threads (the commit thread, capture and flush workers, hop threads, a fill's
commit, the training thread in ``read_data``) never export a span, write a history file or call
an application's OpenTelemetry provider themselves: they hand a small record (a callable and its
arguments, built from what the save already measured) to :meth:`TelemetryQueue.post`, which never
blocks. One daemon thread per process (``tierckpt-telemetry``, started on the first record) runs
the records in order. An exporter that blocks (a ``SimpleSpanProcessor`` in front of a collector
that never answers) stalls that thread only: commits, ``writer.wait()`` and a SIGTERM drain go on.

**Bounded.** At most :data:`QUEUE_SIZE` records wait. When the queue is full a record is dropped
and counted (:func:`dropped`; the OpenTelemetry counter ``tierckpt.telemetry.dropped``); the
first drop logs a WARNING naming the count, and :meth:`TelemetryQueue.drain` logs the total when
records were dropped since it last said so. A record is a few hundred bytes of references (a
save's ``SaveStats``, its history record), never a buffer.

**Closing.** ``Engine.close`` (and :func:`tierckpt.telemetry.hub.flush_history`) waits for the
records posted so far with :meth:`TelemetryQueue.drain`, at most :data:`CLOSE_WAIT` seconds: a
stuck exporter delays an exit by that much once (later drains see the same record still running
and return at once); what is still queued is lost with the process, as a span in a
``BatchSpanProcessor``'s buffer would be. A record that raises is logged once and skipped.

The queue is per process; a forked child starts with an empty one.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["CLOSE_WAIT", "QUEUE_SIZE", "TelemetryQueue", "dropped", "telemetry_queue", "use_queue"]

log = logging.getLogger("tierckpt")

QUEUE_SIZE = 1024
"""Records waiting for the telemetry thread at most (one or two per settled save and rank)."""
CLOSE_WAIT = 5.0
"""Seconds ``Engine.close`` waits at most for the telemetry records posted before it."""


class TelemetryQueue:
    """One bounded queue and the thread that runs its records (see the module docstring).
    Thread-safe; :meth:`post` never blocks and never raises."""

    def __init__(self, capacity: int = QUEUE_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"telemetry queue capacity: at least 1, got {capacity}")
        self.capacity = capacity
        self._items: deque[tuple[str, Callable[..., Any], tuple]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._posted = 0
        self._done = 0
        self._dropped = 0
        self._told = 0  # the dropped count last logged
        self._stuck_at = -1  # the record (by number) a drain last gave up waiting for
        self._failed: set[str] = set()  # kinds of record that raised (logged once each)

    @property
    def dropped(self) -> int:
        """Records dropped because the queue was full, since this queue was made."""
        with self._cond:
            return self._dropped

    @property
    def waiting(self) -> int:
        """Records posted and not run yet (the one running included)."""
        with self._cond:
            return self._posted - self._done

    def post(self, what: str, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on the telemetry thread; ``what`` names the record in logs (``"spans
        of step-20"``). Returns False when the queue was full and the record was dropped."""
        with self._cond:
            if len(self._items) >= self.capacity:
                self._dropped += 1
                n, first = self._dropped, self._told == 0
                if first:
                    self._told = n
            else:
                self._items.append((what, fn, args))
                self._posted += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="tierckpt-telemetry", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
                return True
        if first:
            log.warning(
                "telemetry queue full (%d records waiting: an exporter is slow or stuck): dropped %d telemetry "
                "record (%s); checkpoints are not affected. Later drops are counted (tierckpt.telemetry.dropped()) "
                "and their total logged when the engine closes",
                self.capacity,
                n,
                what,
            )
        return False

    def drain(self, timeout: float = CLOSE_WAIT) -> bool:
        """Wait until every record posted before this call has run, at most ``timeout`` seconds.
        Returns whether they all did. Logs how many records were left behind, and the records
        dropped since the last such line. Returns at once when the record a previous drain gave
        up on is still running (a stuck exporter is waited for once)."""
        with self._cond:
            target = self._posted
            if self._done < target and self._stuck_at != self._done:
                if not self._cond.wait_for(lambda: self._done >= target, timeout):
                    self._stuck_at = self._done
            ok = self._done >= target
            left = target - self._done
            drops = self._dropped - self._told if self._dropped > self._told else 0
            if drops:
                self._told = self._dropped
            total = self._dropped
        if not ok:
            log.warning(
                "%d telemetry records (spans, history writes) were still waiting after %.0f s (an exporter is "
                "slow or stuck); checkpoints are not affected",
                left,
                timeout,
            )
        if drops:
            log.warning("%d telemetry records were dropped in all, the queue being full", total)
        return ok

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                what, fn, args = self._items.popleft()
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - telemetry never fails a checkpoint; logged once per kind
                kind = what.split(" ", 1)[0]
                if kind not in self._failed:
                    self._failed.add(kind)
                    log.warning("telemetry failed (%s; checkpoints are not affected): %s", what, e)
            finally:
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()


_queue: TelemetryQueue | None = None
_queue_lock = threading.Lock()
_dropped_before = 0  # by the queues use_queue replaced


def telemetry_queue() -> TelemetryQueue:
    """This process's queue (made on first use)."""
    global _queue
    with _queue_lock:
        if _queue is None:
            _queue = TelemetryQueue()
        return _queue


def use_queue(capacity: int = QUEUE_SIZE) -> TelemetryQueue:
    """Replace this process's queue with an empty one of ``capacity`` records, from the next record
    on (tests; an application that wants a deeper queue). Records of the old one still run."""
    global _queue, _dropped_before
    q = TelemetryQueue(capacity)
    with _queue_lock:
        if _queue is not None:
            _dropped_before += _queue.dropped
        _queue = q
    return q


def dropped() -> int:
    """Telemetry records this process dropped because the queue was full, in all."""
    with _queue_lock:
        q, before = _queue, _dropped_before
    return before + (0 if q is None else q.dropped)


def _forget_in_child() -> None:
    global _queue, _queue_lock, _dropped_before
    _queue, _queue_lock, _dropped_before = None, threading.Lock(), 0  # the parent's thread does not exist here


os.register_at_fork(after_in_child=_forget_in_child)
