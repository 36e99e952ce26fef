"""Preemption: a SIGTERM costs no checkpoint that was already saved.

A spot reclaim, a Kubernetes eviction or torchelastic tearing down workers sends SIGTERM, then
SIGKILL after a grace period (typically 30 s). Python's default SIGTERM ends the process at once,
without ``atexit``: a checkpoint whose ``dcp.save`` had returned but that was not committed yet
would be lost. With ``[job] on_sigterm = "drain"`` (the default) tierckpt handles the signal:

1. **Drain** (:func:`drain`): captures still held back start at once; ``dcp.async_save`` calls not
   planned yet get their capture enqueued; then every checkpoint in flight in this process is
   waited for until committed on the first tier and, where a ``[peer]`` hop is configured and
   time allows, on the peer tier; all within ``[job] drain_timeout`` seconds (default 20) from
   the signal. Later hops (S3) are not waited for: a checkpoint committed on the first tier is
   promoted by the next job (its backlog).
2. **Log** what was and was not committed (WARNING lines of the ``tierckpt.preempt`` logger,
   which Python prints on stderr even where logging is not configured).
3. **Hand over**: to the handler that was installed before (called with the same arguments), or
   to the default action: the default disposition is restored and the signal raised again, so
   the process ends as killed by it (exit status 143; -15 to a parent). A second signal during
   the drain cuts it short and hands over at once.

**Who installs it, and when.** :func:`install` runs when a :class:`~tierckpt.TieredWriter` is
created; Python runs signal handlers on the main thread only and only the main thread may install
them, so a writer created on the main thread installs the handler (once per process, for SIGTERM,
and for SIGINT only while SIGINT still has Python's own handler, ``KeyboardInterrupt``). A writer
created on another thread installs nothing (logged once): then call ``tierckpt.preempt.install(cfg)``
from the main thread, or :func:`drain` from the job's own handler. A handler the job installs
*after* the writer replaces tierckpt's: such a job calls :func:`drain` in its handler (it may be
called from any thread, and is what tierckpt's handler calls). A handler that was installed
from C (``signal.getsignal`` returns ``None``) or SIG_IGN is left alone. SIGKILL cannot be
handled: what it interrupts stays uncommitted and invisible, as before.

**The handler on the main thread.** It interrupts the main thread between two bytecodes, maybe
inside tierckpt or ``dcp.save`` while one of its locks is held, maybe inside the handler itself
(a signal storm). So the handler takes no lock the main thread can hold: it snapshots what is in
flight without locks, hands the drain to the ``tierckpt-drain`` thread (started by
:func:`install`, outside any handler) through a :class:`queue.SimpleQueue` (reentrant: safe in a
signal handler), and waits for its report at most ``drain_timeout`` from the signal (plus half a
second); a drain that needs a lock the interrupted code holds gives up instead of deadlocking.
:func:`drain` called on the main thread (a job's own handler) does the same. While the handler
waits, the main thread (training) is stopped, so nothing mutates the state being captured.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import weakref
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..chain.engine import live_engines
from ..chain.peercopy import PeerHop
from .asyncsave import AsyncTickets
from .hold import release_all

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["DrainReport", "DrainedCheckpoint", "drain", "install", "installed"]

log = logging.getLogger("tierckpt.preempt")


class _Writer(Protocol):
    """What a drain needs of a :class:`~tierckpt.save.writer.TieredWriter`: its ``dcp.async_save``
    tickets (named here, not imported: the writer imports this module to install the handler)."""

    _tickets: AsyncTickets


_lock = threading.Lock()  # install() only (the main thread, never a handler)
_previous: dict[int, Any] = {}  # signal -> the handler that was installed before tierckpt's
_timeout = 0.0  # the largest [job] drain_timeout of the writers that installed the handler
_writers: weakref.WeakSet[_Writer] = weakref.WeakSet()  # their dcp.async_save tickets are drained
_said_off_main = False
# What a signal handler touches: plain values (handlers run on the main thread only, one at a time
# or nested, never in parallel) and SimpleQueues (reentrant), never a lock.
_handling = False  # tierckpt's handler is draining (on the main thread, maybe further up its stack)
_cut = False  # a second signal handed over while the first was draining
_handler_reply: queue.SimpleQueue[Any] | None = None  # where the draining handler waits for its report
_main_draining = False  # a drain() on the main thread waits for the drain thread
_CUT = object()  # put into a waiting handler's reply queue by the signal that cut it short
_requests: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (t0, deadline, seen, reply) for the drain thread
_worker_pid = 0  # the process whose drain thread serves _requests (none after a fork)
_SLACK = 0.5  # s the main thread waits past the drain's deadline for its report


@dataclass
class DrainedCheckpoint:
    """What a drain left of one checkpoint in flight on this rank."""

    checkpoint_id: str
    rank: int
    first_tier: str
    committed: bool  # on the first tier
    stage: str = ""  # where it stopped when not committed: capture, flush, commit (or "failed")
    error: str = ""  # its failure, if it failed
    peer: str = ""  # the peer hop: "done", "failed", "not within the drain timeout", "" (none configured)
    later: list[str] = field(default_factory=list)  # hops after those, not done (the next job's backlog)

    def line(self) -> str:
        if not self.committed:
            why = f"it failed: {self.error}" if self.error else f"still in {self.stage} when the drain ended"
            return f"{self.checkpoint_id} NOT committed (rank {self.rank}): {why}"
        parts = [f"{self.checkpoint_id} committed on {self.first_tier} (rank {self.rank})"]
        if self.peer:
            parts.append(f"peer copies: {self.peer}")
        if self.later:
            parts.append(f"not on {', '.join(self.later)} yet: the next job promotes it")
        return "; ".join(parts)


@dataclass
class DrainReport:
    """The outcome of a :func:`drain`: every checkpoint that was in flight, and how long it took."""

    seconds: float
    timed_out: bool
    checkpoints: list[DrainedCheckpoint] = field(default_factory=list)

    @property
    def committed(self) -> list[str]:
        return [c.checkpoint_id for c in self.checkpoints if c.committed]

    @property
    def lost(self) -> list[str]:
        """Ids in flight that the drain could not commit on the first tier."""
        return [c.checkpoint_id for c in self.checkpoints if not c.committed]


def drain(timeout: float | None = None, *, seen: dict[int, list[Any]] | None = None) -> DrainReport:
    """Commit what is in flight in this process before it goes (see the module docstring).

    Any thread; returns within ``timeout`` seconds (default: the installed ``[job]
    drain_timeout``, else 20), plus half a second on the main thread. The training thread must not
    change the state being captured meanwhile (a signal handler stops it; a job's own handler
    calling this does too). ``seen``: jobs already counted by the caller (engine id -> jobs); they
    are reported even when they finish before the drain looks.

    On the main thread (maybe in a signal handler that interrupted tierckpt holding a lock) the
    work runs on the ``tierckpt-drain`` thread and this waits for it without taking a lock; if
    the drain does not report in time, the report lists what is in flight as seen without locks,
    with ``timed_out`` set. A drain() on the main thread while another one waits there (a second
    signal reaching the job's handler) returns at once an empty report with ``timed_out`` set:
    the first one goes on.
    """
    global _main_draining
    t0 = time.monotonic()
    deadline = t0 + (timeout if timeout is not None else (_timeout or 20.0))
    if threading.current_thread() is not threading.main_thread():
        return _drain_body(t0, deadline, seen)
    if _main_draining:
        return DrainReport(seconds=0.0, timed_out=True)
    _main_draining = True
    try:
        reply: queue.SimpleQueue[Any] = queue.SimpleQueue()
        _submit(t0, deadline, seen, reply)
        got = _await(reply, deadline)
        if isinstance(got, DrainReport):
            return got
        if isinstance(got, BaseException):
            raise got
        return _snapshot(t0, seen)
    finally:
        _main_draining = False


def _submit(t0: float, deadline: float, seen: dict[int, list[Any]] | None, reply: queue.SimpleQueue[Any]) -> None:
    """Hand a drain to the drain thread (lock-free: from a signal handler too)."""
    if _worker_pid != os.getpid():
        _start_worker()  # install() normally started it, outside any handler
    _requests.put((t0, deadline, seen, reply))


def _await(reply: queue.SimpleQueue[Any], deadline: float) -> Any:
    """The drain thread's answer, or None when none came by ``deadline`` (+ ``_SLACK``)."""
    try:
        return reply.get(timeout=max(0.0, deadline - time.monotonic()) + _SLACK)
    except queue.Empty:
        return None


def _start_worker() -> None:
    """Start this process's drain thread (idempotent; again in a forked child, which has none)."""
    global _worker_pid, _requests
    if _worker_pid == os.getpid():
        return
    if _worker_pid:  # a forked child: the parent's queue may hold requests nobody serves here
        _requests = queue.SimpleQueue()
    _worker_pid = os.getpid()
    threading.Thread(target=_serve, args=(_requests,), name="tierckpt-drain", daemon=True).start()


def _serve(requests: queue.SimpleQueue[Any]) -> None:
    """The drain thread: run each drain handed to it, put its report (or error) in its reply queue."""
    while True:
        t0, deadline, seen, reply = requests.get()
        try:
            reply.put(_drain_body(t0, deadline, seen))
        except BaseException as e:  # noqa: BLE001 - the waiter raises it
            reply.put(e)


def _jobs_in_flight(seen: dict[int, list[Any]] | None) -> list[tuple[Any, list[Any]]]:
    """(engine, its jobs in flight): ``seen`` plus what the engines list now (no lock taken)."""
    out = []
    for eng in live_engines():
        jobs = list((seen or {}).get(id(eng), []))
        jobs += [j for j in eng.pending() if all(j is not k for k in jobs)]
        out.append((eng, jobs))
    return out


def _snapshot(t0: float, seen: dict[int, list[Any]] | None) -> DrainReport:
    """What is in flight as seen without locks, when the drain thread did not report in time."""
    out = []
    for eng, jobs in _jobs_in_flight(seen):
        for job in jobs:
            d = DrainedCheckpoint(job.id, job.assign.rank, eng.first_tier.name, False)
            if job.committed.done() and job.committed.exception() is None:
                d.committed = True
            else:
                d.stage = "capture" if not job.captured.done() else "flush" if not job.durable.done() else "commit"
            out.append(d)
    return DrainReport(seconds=time.monotonic() - t0, timed_out=True, checkpoints=out)


def _drain_body(t0: float, deadline: float, seen: dict[int, list[Any]] | None) -> DrainReport:
    """The drain itself (any thread but a signal handler's: it may take tierckpt's locks)."""
    for eng in live_engines():
        eng.hurry()  # a commit waits for no slower tier's answer any more
    release_all()  # captures held back until dcp.save is done with the CPU start now
    tickets = [f for w in list(_writers) for f in w._tickets.pending()]
    if tickets:
        futures_wait(tickets, timeout=max(0.0, deadline - time.monotonic()))
    out: list[DrainedCheckpoint] = []
    timed_out = False
    for eng, jobs in _jobs_in_flight(seen):
        peer = next((h for h in eng.hops if isinstance(h, PeerHop)), None)
        later = [h.name for h in eng.hops if h is not peer]
        for job in jobs:
            d = DrainedCheckpoint(job.id, job.assign.rank, eng.first_tier.name, False)
            try:
                job.committed.result(timeout=max(0.0, deadline - time.monotonic()))
                d.committed = True
            except TimeoutError:
                timed_out = True
                d.stage = "capture" if not job.captured.done() else "flush" if not job.durable.done() else "commit"
            except BaseException as e:  # noqa: BLE001 - its failure, reported
                d.stage, d.error = "failed", str(e)
            if d.committed and peer is not None:
                if job.hop_done(peer.name).wait(max(0.0, deadline - time.monotonic())):
                    d.peer = "failed" if job.failed else "done"
                else:
                    d.peer = "not within the drain timeout"
            if d.committed and not job.replicated.done():
                d.later = [n for n in later if not job.hop_done(n).is_set()]
            out.append(d)
    return DrainReport(seconds=time.monotonic() - t0, timed_out=timed_out, checkpoints=out)


def installed() -> list[int]:
    """The signals tierckpt's handler is installed for (tests, diagnostics)."""
    with _lock:
        return sorted(s for s in _previous if signal.getsignal(s) is _handler)


def install(cfg: Config, writer: _Writer | None = None) -> bool:
    """Install the drain handler for ``cfg`` (``[job] on_sigterm``); ``writer``'s pending
    ``dcp.async_save`` calls are drained too. Idempotent; on the main thread only (elsewhere it
    logs once and returns False). Returns whether tierckpt's handler is installed now."""
    global _timeout, _said_off_main
    if writer is not None:
        _writers.add(writer)
    _start_worker()  # here, never in a handler: starting a thread takes locks
    if cfg.job.on_sigterm != "drain":
        return False
    if threading.current_thread() is not threading.main_thread():
        if not _said_off_main and not installed():
            _said_off_main = True
            log.info(
                "a TieredWriter was created off the main thread: no SIGTERM handler installed (Python "
                "installs handlers from the main thread only); call tierckpt.preempt.install(cfg) there, "
                "or tierckpt.drain() from the job's own handler"
            )
        return bool(installed())
    with _lock:
        _timeout = max(_timeout, cfg.job.drain_timeout)
        for sig in (signal.SIGTERM, signal.SIGINT):
            cur = signal.getsignal(sig)
            if cur is _handler:
                continue
            if sig == signal.SIGINT and cur is not signal.default_int_handler:
                continue  # the job handles Ctrl-C itself (or ignores it): leave it alone
            if cur is None or cur == signal.SIG_IGN:
                continue  # installed from C, or ignored on purpose: nothing to chain to
            _previous[sig] = cur
            signal.signal(sig, _handler)
    return True


def _handler(signum: int, frame: Any) -> None:
    """The signal handler (main thread): drain on the drain thread, log, hand over. Takes no lock
    the interrupted main thread may hold (see the module docstring)."""
    global _handling, _cut, _handler_reply
    name = signal.Signals(signum).name
    if _handling:  # a second signal while draining: no more waiting
        log.warning("%s again while draining: handing over now", name)
        _cut = True
        waiting = _handler_reply
        if waiting is not None:
            waiting.put(_CUT)
        _hand_over(signum, frame)
        return
    _handling, _cut = True, False
    try:
        timeout = _timeout or 20.0
        t0 = time.monotonic()
        deadline = t0 + timeout
        seen = {id(e): e.pending() for e in live_engines()}
        n = sum(len(v) for v in seen.values())
        log.warning("%s: draining %d checkpoint(s) in flight (up to %.0f s) before handing over", name, n, timeout)
        reply: queue.SimpleQueue[Any] = queue.SimpleQueue()
        _handler_reply = reply
        got = None
        if not _cut:
            _submit(t0, deadline, seen, reply)
            got = _await(reply, deadline)
        if _cut or got is _CUT:
            return  # the second signal already handed over (and its handler returned)
        if not isinstance(got, DrainReport):
            log.warning(
                "%s: the drain did not finish within %.0f s (%s): what was in flight may not be committed",
                name,
                timeout,
                f"it failed: {got}"
                if isinstance(got, BaseException)
                else "the interrupted code may hold a lock it needs",
            )
        else:
            for c in got.checkpoints:
                log.warning("%s: %s", name, c.line())
            log.warning(
                "%s: drain done in %.2f s: %d committed, %d not committed%s",
                name,
                got.seconds,
                len(got.committed),
                len(got.lost),
                " (drain timeout reached)" if got.timed_out else "",
            )
        _hand_over(signum, frame)
    finally:
        _handling, _handler_reply = False, None


def _hand_over(signum: int, frame: Any) -> None:
    prev = _previous.get(signum, signal.SIG_DFL)
    name = signal.Signals(signum).name
    if callable(prev):
        log.warning(
            "%s: handing over to the handler installed before tierckpt's (%s)",
            name,
            getattr(prev, "__qualname__", repr(prev)),
        )
        prev(signum, frame)
        return
    log.warning("%s: handing over to the default action", name)
    for h in logging.getLogger("tierckpt").handlers + logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - the process is about to end
            pass
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)
