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
inside tierckpt or ``dcp.save`` while a lock is held; so the drain runs on a thread of its own
and the handler waits for it at most ``drain_timeout`` (plus a second): a drain that needs a lock
the interrupted code holds gives up instead of deadlocking. While the handler waits, the main
thread (training) is stopped, so nothing mutates the state being captured.
"""

from __future__ import annotations

import logging
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


_lock = threading.Lock()
_previous: dict[int, Any] = {}  # signal -> the handler that was installed before tierckpt's
_timeout = 0.0  # the largest [job] drain_timeout of the writers that installed the handler
_writers: weakref.WeakSet[_Writer] = weakref.WeakSet()  # their dcp.async_save tickets are drained
_busy = threading.Event()  # a handler is draining
_cut = threading.Event()  # a second signal handed over while the first was draining
_said_off_main = False


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

    Any thread; blocks for at most ``timeout`` seconds (default: the installed ``[job]
    drain_timeout``, else 20). The training thread must not change the state being captured
    meanwhile (a signal handler stops it; a job's own handler calling this does too).
    ``seen``: jobs already counted by the caller (engine id -> jobs); they are reported even when
    they finish before the drain looks (the handler counts them, then starts the drain thread).
    """
    t0 = time.monotonic()
    deadline = t0 + (timeout if timeout is not None else (_timeout or 20.0))
    release_all()  # captures held back until dcp.save is done with the CPU start now
    tickets = [f for w in list(_writers) for f in w._tickets.pending()]
    if tickets:
        futures_wait(tickets, timeout=max(0.0, deadline - time.monotonic()))
    out: list[DrainedCheckpoint] = []
    timed_out = False
    for eng in live_engines():
        peer = next((h for h in eng.hops if isinstance(h, PeerHop)), None)
        later = [h.name for h in eng.hops if h is not peer]
        jobs = list((seen or {}).get(id(eng), []))
        jobs += [j for j in eng.pending() if all(j is not k for k in jobs)]
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
    """The signal handler (main thread): drain on a thread of its own, log, hand over."""
    name = signal.Signals(signum).name
    if _busy.is_set():  # a second signal while draining: no more waiting
        log.warning("%s again while draining: handing over now", name)
        _cut.set()
        _hand_over(signum, frame)
        return
    _busy.set()
    _cut.clear()
    try:
        timeout = _timeout or 20.0
        seen = {id(e): e.pending() for e in live_engines()}
        n = sum(len(v) for v in seen.values())
        log.warning("%s: draining %d checkpoint(s) in flight (up to %.0f s) before handing over", name, n, timeout)
        box: list[DrainReport] = []
        t = threading.Thread(target=lambda: box.append(drain(timeout, seen=seen)), name="tierckpt-drain", daemon=True)
        t.start()
        end = time.monotonic() + timeout + 1.0
        while t.is_alive() and not _cut.is_set() and time.monotonic() < end:
            t.join(min(0.05, max(0.0, end - time.monotonic())))
        if _cut.is_set():
            return  # the second signal already handed over (and its handler returned)
        if not box:
            log.warning(
                "%s: the drain did not finish within %.0f s (the interrupted code may hold a lock it "
                "needs): what was in flight may not be committed",
                name,
                timeout,
            )
        else:
            rep = box[0]
            for c in rep.checkpoints:
                log.warning("%s: %s", name, c.line())
            log.warning(
                "%s: drain done in %.2f s: %d committed, %d not committed%s",
                name,
                rep.seconds,
                len(rep.committed),
                len(rep.lost),
                " (drain timeout reached)" if rep.timed_out else "",
            )
        _hand_over(signum, frame)
    finally:
        _busy.clear()


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
