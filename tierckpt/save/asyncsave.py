"""``dcp.async_save`` support: tickets that make ``wait_captured`` wait for saves that DCP's save
thread has not planned yet.

``dcp.async_save(..., storage_writer=TieredWriter(cfg))`` calls ``TieredWriter.stage`` (the
writer is its own ``AsyncStager``) on the caller's thread, then runs ``dcp.save`` on a thread of
its own. Until that thread reaches ``write_data`` (which reads the tensors' version counters and
enqueues their capture) the state must not change, so ``stage`` opens a ticket
(:meth:`AsyncTickets.open`) and ``wait_captured``/the optimizer pre-step hook wait for every open
ticket (:meth:`AsyncTickets.wait`).

A ticket is bound to DCP's save thread by the first ``StorageWriter`` call of the save on a
thread other than the one that staged it (``reset`` or ``set_up_storage_writer``, both public
protocol, :meth:`AsyncTickets.bind`), and it ends when

* ``write_data`` runs on that thread (:meth:`AsyncTickets.captured`): the capture is enqueued;
* that thread ends first (a save that failed in planning; DCP's future holds the error); a
  watcher thread per ticket ``join()``\\ s it (``threading.Thread.join``, no thread names);
* the same thread starts another save first (an executor that reuses its thread); or
* no writer call binds it within :data:`BIND_TIMEOUT` (DCP failed before it called the writer,
  or ran the save in another process): logged as a warning.

**Process-based async** (``AsyncCheckpointerType.PROCESS``): DCP pickles the staged state dict
and sends it to its checkpoint process. The dict ``stage`` returns is a :class:`LiveState`: in
this process it is the live state dict, but pickling it copies every tensor first (DCP's own
``DefaultStager``, into shared memory, a fresh copy per save) and pickles the copy; its ticket
ends once the copy is made, so the pre-step hook waits for the copy, never for the other process.

Nothing here depends on how DCP names or manages its threads (torch 2.11-2.14 create one
``ThreadPoolExecutor`` per save and shut it down afterwards; a reused thread is handled too).
A synchronous ``dcp.save`` on the staging thread never binds a ticket.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

__all__ = ["AsyncTickets", "BIND_TIMEOUT", "LiveState"]

log = logging.getLogger("tierckpt")

BIND_TIMEOUT = 30.0
"""Seconds an ``async_save`` may take to make its first writer call before its ticket is given up."""


class _Ticket:
    """One ``stage`` call: which thread staged it, which save thread (and save) it is bound to."""

    def __init__(self, staged_by: int) -> None:
        self.staged_by = staged_by
        self.future: Future = Future()  # result: the RankSave, or None when the save ended without one
        self.thread: threading.Thread | None = None
        self.save: object | None = None  # the save (its per-thread context) that bound it
        self.bound = threading.Event()

    def end(self, job: Any = None) -> None:
        if not self.future.done():
            try:
                self.future.set_result(job)
            except Exception:  # noqa: BLE001 - ended concurrently by another path
                pass


class AsyncTickets:
    """A writer's open ``async_save`` tickets. Thread-safe; see the module docstring for who calls
    what. Only :meth:`wait` blocks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[_Ticket] = []

    def open(self) -> _Ticket:
        """``stage`` (the caller's thread): a save is about to be planned on DCP's thread."""
        t = _Ticket(threading.get_ident())
        with self._lock:
            self._open.append(t)
        threading.Thread(target=self._watch, args=(t,), name="tierckpt-async-ticket", daemon=True).start()
        return t

    def shipped(self, t: _Ticket) -> None:
        """:class:`LiveState` pickled for another process: its copy is made, the ticket ends."""
        self._forget(t)

    def bind(self, save: object) -> None:
        """A save's first writer calls (``reset``, ``set_up_storage_writer``), on its thread;
        ``save`` identifies the save (its context). Binds the oldest unbound ticket staged on
        another thread to this thread, unless this save already holds one; a ticket this thread
        held for an earlier save ends (that save is over)."""
        me = threading.current_thread()
        ended: list[_Ticket] = []
        with self._lock:
            mine = [t for t in self._open if t.thread is me]
            if any(t.save is save for t in mine):
                return
            ended = mine
            for t in self._open:
                if t.thread is None and t.staged_by != me.ident:
                    t.thread, t.save = me, save
                    t.bound.set()
                    break
            self._open = [t for t in self._open if t not in ended]
        for t in ended:
            t.end()

    def pending(self) -> list[Future]:
        """The futures of the open tickets (each completes once its save's capture is enqueued or
        the save ended): a preemption drain waits for them.

        Takes no lock (copying the list is atomic in CPython): the drain runs while a signal
        handler stops the main thread, which may hold ``_lock``."""
        return [t.future for t in list(self._open)]

    def bound_here(self) -> bool:
        """Whether a ticket (a ``stage`` call of this writer) is bound to the calling thread's save."""
        me = threading.current_thread()
        with self._lock:
            return any(t.thread is me for t in self._open)

    def captured(self, job: Any) -> None:
        """``write_data`` on a save's thread: the capture of its save is enqueued."""
        me = threading.current_thread()
        with self._lock:
            done = [t for t in self._open if t.thread is me]
            self._open = [t for t in self._open if t.thread is not me]
        for t in done:
            t.end(job)

    def wait(self) -> None:
        """Block until every ticket open now has ended (``wait_captured``, the pre-step hook)."""
        with self._lock:
            pending = [t.future for t in self._open]
        for f in pending:
            f.result()

    def _forget(self, t: _Ticket) -> None:
        with self._lock:
            if t in self._open:
                self._open.remove(t)
        t.end()

    def _watch(self, t: _Ticket) -> None:
        if not t.bound.wait(BIND_TIMEOUT):
            if t.future.done():  # shipped to another process (LiveState) meanwhile
                return
            if not t.future.done():
                log.warning(
                    "dcp.async_save made no call to TieredWriter within %.0fs of stage(); no longer "
                    "waiting for it before optimizer steps",
                    BIND_TIMEOUT,
                )
            self._forget(t)
            return
        thread = t.thread
        assert thread is not None
        while not t.future.done():
            thread.join(timeout=1.0)
            if not thread.is_alive():
                self._forget(t)
                return


class LiveState(dict):
    """The state dict ``TieredWriter.stage`` returns: the live state dict (a shallow copy of its
    top level), which DCP's save thread reads directly (the capture is lazy).

    Pickled (only ``AsyncCheckpointerType.PROCESS`` does that, on DCP's executor thread), it
    first copies every tensor with DCP's ``DefaultStager`` (shared memory, no cache: a fresh
    copy per save, so an overlapping save never overwrites it), ends the save's ticket (the
    state may change from then on) and pickles as the copy, a plain dict. The copy costs what
    DCP's own process-mode staging costs; the training thread's pre-step hook waits for it.
    """

    def __init__(self, state_dict: dict, ticket: _Ticket | None = None, tickets: AsyncTickets | None = None) -> None:
        super().__init__(state_dict)
        self._ticket = ticket
        self._tickets = tickets

    def __reduce__(self) -> tuple:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False, use_shared_memory=True, use_async_staging=False, use_non_blocking_copy=False
            )
        )
        try:
            copy = stager.stage(dict(self))
        finally:
            stager.close()
            if self._ticket is not None:
                if self._tickets is not None:
                    self._tickets.shipped(self._ticket)
                else:
                    self._ticket.end()
        return (dict, (copy,))
