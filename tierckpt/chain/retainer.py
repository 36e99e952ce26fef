"""First-tier retention off the commit path: one thread per engine, one pass for many commits.

Retention is a sweep of the whole tier (list every checkpoint, read every lease, walk for the
leftovers of dead writers): its cost grows with what the tier holds, and so with the checkpoints
saved but not committed yet. Run by the commit thread after each commit, as it was, a job saving
faster than one sweep took fell behind for good: each commit waited for a sweep, each sweep
found more uncommitted saves to list (the leases of 1,000 saves in flight, read at every commit),
and commits slowed further (14 MB saved 90 times a second: 31 commits in the first 2 s, then 3
per second).

So the commit thread only commits (milliseconds on a local disk), then hands the job here with
what to do once first-tier retention has run after its commit (settle it, so that
``writer.wait()`` returning still means retention ran; or nothing, when a hop takes the job on).
A pass starts at once when the thread is idle; requests that arrive while one runs are served
together by the next pass, which sees every commit made before it started. Passes and callbacks
run in request order. Who calls: :class:`~tierckpt.chain.engine.Engine` (its commit thread after
a commit, its hop threads after a hop) and ``Engine.close``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from ..capture.ranksave import RankSave
from ..catalog.lease import live_leases
from ..config import Config
from ..tiers import Chain
from ..tiers.base import Tier
from .retention import enforce

__all__ = ["FirstTierRetention", "Retainer"]

log = logging.getLogger("tierckpt")


class Retainer:
    """Runs ``sweep(jobs)`` (first-tier retention after ``jobs`` committed, oldest first; best
    effort, never raises into the caller's job) on a thread of its own, coalescing requests."""

    def __init__(self, sweep: Callable[[list[Any]], None], name: str = "tierckpt-retain") -> None:
        self._sweep = sweep
        self._q: queue.SimpleQueue[tuple[Any, Callable[[Any], None] | None] | None] = queue.SimpleQueue()
        self.passes = 0  # sweeps run (tests and the benchmark read it)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def after(self, job: Any, then: Callable[[Any], None] | None = None) -> None:
        """Retention after ``job`` committed, then ``then(job)`` (any thread; returns at once)."""
        self._q.put((job, then))

    def close(self) -> None:
        """Serve what is queued, then stop the thread (``Engine.close``, after its ``wait``)."""
        self._q.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            batch = [self._q.get()]
            while True:  # everything requested meanwhile goes into this one pass
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            todo = [x for x in batch if x is not None]
            if todo:
                self._serve(todo)
            if stop:
                return

    def _serve(self, todo: list[tuple[Any, Callable[[Any], None] | None]]) -> None:
        try:
            self._sweep([job for job, _then in todo])
        except Exception as e:  # noqa: BLE001 - the sweep logs its own failures; this is a bug guard
            log.warning(
                "retention after committing %s failed (will retry after the next commit): %s", _name(todo[-1][0]), e
            )
        self.passes += 1
        for job, then in todo:
            if then is None:
                continue
            try:
                then(job)
            except Exception:  # noqa: BLE001 - never lose the thread (every later job would hang)
                log.exception("settling checkpoint %s after retention failed", _name(job))


def _name(job: Any) -> str:
    return str(getattr(job, "id", job))


class FirstTierRetention:
    """The :class:`~tierckpt.chain.engine.Engine`'s retention calls (a base class of it): the pass
    that :class:`Retainer` runs after commits and hops, and :meth:`retain`, which hops and the
    backlog pass call for their own tier. Runs on the retention thread or a hop thread, never on
    the commit path."""

    cfg: Config
    chain: Chain
    hops: list[Any]
    in_flight_ids: Callable[[], set[str]]  # the Engine's: ids of the saves not done yet (spared)

    def _retain_after(self, jobs: list[RankSave]) -> None:
        """The retention thread: release the save leases of ``jobs`` (committed, oldest first), then
        one first-tier pass for the newest of them this rank writes the metadata of (the pass
        sees the others too)."""
        for j in jobs:
            j.release_lease()
        mine = [j for j in jobs if j.assign.meta_writer_rank == j.assign.rank and _ok(j.committed)]
        if mine:
            self.retain_first_tier(mine[-1])

    def retain_first_tier(self, job: RankSave) -> None:
        """Retention on the first tier after ``job`` committed there (its metadata writer only;
        called by the retention thread after the commit, and again after each hop).

        Best effort: a failure is logged and never fails the committed checkpoint; the next
        commit retries. Checkpoints still owed to a later tier are protected (and nothing is
        deleted before every hop has looked for a backlog left by an earlier run).
        """
        if job.assign.meta_writer_rank != job.assign.rank:
            return
        tier = self.chain.first
        try:
            owed: set[str] = set()
            for hop in self.hops:
                if not hop.settled:
                    log.debug("retention on %s after %s waits for the backlog check of %s", tier.url, job.id, hop.name)
                    return
                owed |= hop.owed()
            self.retain(tier, {job.id}, owed=owed, need_bytes=2 * job.size)
        except Exception as e:  # noqa: BLE001 - see docstring
            log.warning("retention after committing %s failed (will retry after the next commit): %s", job.id, e)

    def retain(
        self, tier: Tier, protect: set[str], *, owed: set[str] | frozenset[str] = frozenset(), need_bytes: int = 0
    ) -> None:
        """``tier``'s retention (its ``keep``/``keep_every``) now, sparing ``protect``, saves in flight
        and (unless the disk would fill) ``owed``; then remove the leftovers of interrupted writes
        (:meth:`Tier.abort_stale`: multipart uploads, half-written files of dead processes)."""
        enforce(tier, tier.keep, tier.keep_every, self.in_flight_ids() | protect, owed=owed, need_bytes=need_bytes)
        aborted = tier.abort_stale(self.cfg.job.commit_timeout, lambda: set(live_leases(tier)) | self.in_flight_ids())
        if aborted:
            log.info("removed %d leftovers of interrupted writes on %s", aborted, tier.url)


def _ok(fut: Any) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None
