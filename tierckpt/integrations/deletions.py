"""Deleting whole checkpoints on every tier, as a framework asks (Lightning's ``save_top_k``,
Accelerate's ``total_limit``): lease-guarded, in the background, never under a save in flight.

::

    dels = Deletions(writer)
    dels.delete("epoch=0-step=4.ckpt", after=job.replicated)  # now, or after that save settles
    ...
    dels.wait()      # every deletion asked for so far has run; raises the first failure

Each deletion waits for ``after`` (the save of that id in this process, if it is still in flight:
its :attr:`~tierckpt.save.RankSave.replicated` future, success or failure; in the background
then, else at once on the caller's thread), then runs, tier by
tier of the writer's chain (fastest first), :func:`tierckpt.lease.guarded_delete` over
:func:`tierckpt.retention.delete_checkpoint`: the metadata goes first (the checkpoint stops
being committed there), then exactly the objects listed.

This process's own work on the checkpoint never keeps it: a load, a fetch, or a hop of the
writer's engine copying it (a restarted job's backlog replicates checkpoints its predecessor
committed on the first tier only, possibly one the framework deletes meanwhile) holds leases
on it; the deletion waits until this process holds none (in the background when one is held
when it is asked for), deletes, and tries again on a tier that such a lease kept, after it is
released (so a copy committed meanwhile is deleted too), at most :data:`OWN_ROUNDS` times, each
wait at most ``[job] commit_timeout``. A tier where another process's live lease holds the
checkpoint (a reader loading it elsewhere, a fetch) keeps it: that is logged and counted in
:attr:`Deletions.skipped`, and tierckpt's retention or ``tierckpt-restore gc`` may remove it
later. Copies that the peer hop made on other nodes are left to those nodes' retention.

Called by one rank (the one the framework deletes on). One daemon thread per instance, started
on first use; it issues no collective.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait

from ..catalog import lease as leases
from ..catalog.lease import guarded_delete
from ..chain.retention import delete_checkpoint
from ..errors import TierckptError
from ..save.writer import TieredWriter

__all__ = ["Deletions"]

log = logging.getLogger("tierckpt")

OWN_ROUNDS = 3
"""Rounds of a deletion on the tiers where a lease of this process (its own load or hop of the
checkpoint) kept it: each waits for this process's leases on the checkpoint to be released."""


class Deletions:
    """Background, lease-guarded deletions of whole checkpoints on every tier of ``writer``'s chain."""

    def __init__(self, writer: TieredWriter) -> None:
        self.writer = writer
        self._q: queue.SimpleQueue[tuple[str, Future | None, bool, Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending: list[Future] = []
        self.deleted: list[str] = []
        """Ids deleted on every tier."""
        self.skipped: dict[str, list[str]] = {}
        """Id -> the tiers (section names) where a live lease kept it."""

    def delete(self, checkpoint_id: str, after: Future | None = None, *, unless_failed: bool = False) -> Future:
        """Delete ``checkpoint_id`` on every tier once ``after`` is done (with ``unless_failed``:
        only if ``after`` succeeded; a checkpoint being replaced stays when its replacement failed).

        With ``after`` done (or ``None``) the deletion runs now, on the calling thread, as the
        framework's own file deletion would (a job killed right after still has it done);
        otherwise, or while this process holds a lease on the checkpoint (its own load or hop
        of it: waited for, see the module docstring), in the background. Never raises: returns a future of the deletion (``True``:
        gone from every tier; ``False``: kept somewhere, see :attr:`skipped`), and :meth:`wait`
        raises a failure."""
        done: Future = Future()
        with self._lock:
            self._pending.append(done)
        if (after is None or after.done()) and not leases.held_here(checkpoint_id):
            self._run_one(checkpoint_id, after, unless_failed, done)
            return done
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tierckpt-deletions", daemon=True)
                self._thread.start()
        self._q.put((checkpoint_id, after, unless_failed, done))
        return done

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            self._run_one(*job)

    def _run_one(self, cid: str, after: Future | None, unless_failed: bool, done: Future) -> None:
        try:
            if after is not None:
                futures_wait([after])
                if unless_failed and after.exception() is not None:
                    log.warning("keeping checkpoint %s: the save meant to replace it failed", cid)
                    done.set_result(False)
                    return
            done.set_result(self._delete_now(cid))
        except BaseException as e:  # noqa: BLE001 - wait() raises it
            log.error("deleting checkpoint %s failed: %s", cid, e)
            done.set_exception(e)

    def _delete_now(self, cid: str) -> bool:
        chain = self.writer.engine.chain
        timeout = self.writer.engine.cfg.job.commit_timeout
        kept: list[str] = []
        todo = list(range(len(chain)))
        for _ in range(OWN_ROUNDS):
            if not leases.wait_released_here(cid, timeout):
                log.warning(
                    "checkpoint %s: this process still uses it after %.0f s; deleting what it can", cid, timeout
                )
            again = []
            for i in todo:
                tier = chain[i]
                if guarded_delete(
                    tier, cid, lambda t=tier: delete_checkpoint(t, cid), reason="deleted by the training framework"
                ):
                    continue
                if self._ours(tier, cid):
                    again.append(i)  # this process's own load or hop of it: once that is done
                else:
                    kept.append(chain.names[i])
            todo = again
            if not todo:
                break
        kept += [chain.names[i] for i in todo]
        if kept:
            self.skipped[cid] = kept
            log.warning(
                "checkpoint %s was not deleted on %s: in use there (a live lease); retention may remove it later",
                cid,
                ", ".join(kept),
            )
            return False
        self.deleted.append(cid)
        log.info("deleted checkpoint %s on every tier", cid)
        return True

    @staticmethod
    def _ours(tier, cid: str) -> bool:  # noqa: ANN001 - a Tier
        """Whether what kept ``cid`` on ``tier`` is this process's doing: it holds a lease on
        ``cid`` now, or no live lease of another process is there (ours was released since)."""
        if leases.held_here(cid):
            return True
        try:
            live = leases.live_leases(tier, cid).get(cid, [])
        except TierckptError:
            return False
        return not [li for li in live if li.owner != leases.owner()]

    def wait(self, timeout: float | None = None) -> None:
        """Block until every deletion queued so far has run; raise the first that failed."""
        with self._lock:
            pending, self._pending = self._pending, []
        done, not_done = futures_wait(pending, timeout=timeout)
        if not_done:
            with self._lock:
                self._pending = list(not_done) + self._pending
            raise TierckptError(f"{len(not_done)} checkpoint deletion(s) still running after {timeout}s")
        for f in pending:
            e = f.exception()
            if e is not None:
                raise e
