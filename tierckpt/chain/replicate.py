"""One hop of the tier chain: committed checkpoints are copied from one tier to the next and
committed there.

A :class:`Replicator` ``(src, dst)`` runs one background thread per engine (per process), fed in
commit order. For each checkpoint, on every rank: copy this rank's data file from ``src`` to
``dst`` (:meth:`Tier.copy_from`: parallel ranged reads into ranged writes, CRC32C per part where
``dst`` checks it) while holding a read lease on it in ``src`` and a writer's lease on it in
``dst`` (taken before the copy, held until committed there: a deletion on ``dst`` by another
process, such as ``tierckpt-restore gc``, never removes a copy about to be committed; see
:func:`tierckpt.lease.acquire_for_write`), then run the commit protocol
(:func:`tierckpt.commit.run_commit`) for ``dst``: rank reports, the coordinator's outcome, then
the metadata writer of ``dst`` (rank 0 for a shared tier) writes ``ID/metadata.json`` with
create-if-absent. ``latest`` on ``dst`` therefore moves only after every rank's copy completed.
After the commit the writer applies ``dst``'s retention and aborts stale uploads.

**The backlog.** A job killed after a commit on ``src`` but before the copy leaves checkpoints
that exist on no later tier. Before its first copy (and again after any failed one) the hop runs
a *backlog pass* on every rank, led by the coordinator:

1. every rank reports the checkpoints committed on its ``src`` that are older than the one about
   to be copied, with the data files it holds;
2. the coordinator lists ``dst`` and picks what it should have but lacks: everything newer than
   its newest, and ``dst.keep_every`` milestones; it assigns each data file to one rank holding it;
3. the ranks copy their files (under read leases); the lowest rank holding the metadata checks
   that every data file the metadata names was assigned, and publishes the metadata;
4. the coordinator commits each complete checkpoint on ``dst`` (metadata last, create-if-absent),
   oldest first, and publishes what was copied and what is still owed.

Until the first pass has run, retention on ``src`` deletes nothing (:attr:`Replicator.settled`);
afterwards it never deletes a checkpoint still owed to ``dst`` unless the disk would otherwise
fill (then with a warning naming it).

A failure (outage past the tier's retries, a rank that died) fails the replication of *that*
checkpoint: it is logged at once, raised by the next ``writer.wait()``, the copy on ``dst``
stays uncommitted (never loaded), training and ``src`` go on, and the next copy first retries it
through a backlog pass. Replication never blocks training: only ``wait()`` waits for it.

The engine is the hop's *owner* (:class:`HopOwner`); this module never imports it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..background import lower_priority
from ..capture.ranksave import RankSave
from ..catalog import lease as leases
from ..codec import add_stored
from ..errors import TierckptError
from ..format.layout import data_key, metadata_key
from ..format.metadata import parse_metadata
from ..tiers.base import Tier
from .backlog import BacklogOwner, BacklogPasses
from .commit import Round, run_commit
from .encodedhop import EncodedCopies

__all__ = ["Replicator", "HopOwner"]


log = logging.getLogger("tierckpt.replicate")


class HopOwner(BacklogOwner, Protocol):
    """What a hop needs from whoever runs it (the engine)."""

    def fail(self, job: RankSave, exc: BaseException, stage: str) -> None:
        """Fail ``job`` (its error reaches the next ``wait``)."""

    def hop_done(self, hop: Replicator, job: RankSave) -> None:
        """``job`` left this hop (committed on ``dst``, or failed): pass it on or settle it."""


class Replicator(BacklogPasses):
    """Copies checkpoints committed on ``src`` to ``dst`` and commits them there (one hop).

    Created by the engine for each tier after the first; ``index`` is ``dst``'s place in the
    chain (it names the hop's keys). Every rank of the job runs the same hops in the same order.
    """

    owner: HopOwner

    def __init__(
        self, owner: HopOwner, src: Callable[[], Tier], dst: Callable[[], Tier], index: int, name: str
    ) -> None:
        self.owner = owner
        self._src, self._dst = src, dst
        self.index = index
        self.name = name
        self.hop = f"{index}-{name}"
        self._q: queue.Queue[RankSave | None] = queue.Queue()
        self._pending: set[str] = set()
        self._owed: set[str] = set()  # committed on src, known missing on dst (backlog, failed copies)
        self._need_pass = True  # coordinator: run a backlog pass before the next copy
        self.settled = False  # a backlog pass (or a failed attempt at one) has run in this process
        self.started = threading.Event()  # the start-up pass (single-process jobs) is over
        self.tried = 0  # copies attempted so far (done or failed): a drain tells a new failure by it
        self.failing: BaseException | None = None  # the last copy's error; None once one succeeds
        self._copied: set[str] = set()  # copied to dst by this hop in this process (see lacking)
        self._lock = threading.Lock()
        self._encoded = EncodedCopies(owner.cfg.job.background_nice)
        self._thread = threading.Thread(target=self._loop, name=f"tierckpt-replicate-{name}", daemon=True)
        self._thread.start()

    @property
    def src(self) -> Tier:
        return self._src()

    @property
    def dst(self) -> Tier:
        return self._dst()

    def submit(self, job: RankSave) -> None:
        """Queue a checkpoint committed on ``src`` (engine threads)."""
        with self._lock:
            self._pending.add(job.id)
        self._q.put(job)

    def owed(self) -> set[str]:
        """Checkpoints committed on ``src`` that ``dst`` should get and does not have yet."""
        with self._lock:
            return self._pending | self._owed

    def lacking(self) -> set[str]:
        """What :meth:`owed` holds less the checkpoints this hop copied to ``dst`` in this process:
        the checkpoints known to be pending there (a backlog pass that failed marks every older
        checkpoint owed, since it could not list ``dst``; those copied before are not pending).
        What the user is told (``wait()``'s :class:`~tierckpt.errors.CopiesPending`, the WARNING
        of a failed copy)."""
        with self._lock:
            return (self._pending | self._owed) - self._copied

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        lower_priority(self.owner.cfg.job.background_nice)
        try:
            self.dst  # noqa: B018 - build the tier (an S3 client) now, not during the first copy
        except Exception as e:  # noqa: BLE001 - reported by the first copy that needs it
            log.warning("tier %s not ready yet: %s", self.name, e)
        self._startup_pass()
        while True:
            job = self._q.get()
            if job is None:
                return
            if job.failed:  # an earlier hop failed: committed on the first tier, owed here too
                with self._lock:
                    self._owed.add(job.id)
                    self._need_pass = True
            else:
                self._backlog_step(job)
                t0 = time.perf_counter()
                try:
                    self._replicate(job)
                    self.failing = None
                    with self._lock:
                        self._copied.add(job.id)
                    job.stats.promote_s = (job.stats.promote_s or 0.0) + time.perf_counter() - t0
                    job.stats.phases.add(f"hop:{self.name}", t0)
                    log.info(
                        "checkpoint %s replicated to %s (rank %d, %.1f MiB in %.2f s)",
                        job.id,
                        self.dst.url,
                        job.assign.rank,
                        job.size / 2**20,
                        time.perf_counter() - t0,
                    )
                except BaseException as e:  # noqa: BLE001 - every failure must reach the user
                    job.stats.phases.add(f"hop:{self.name}", t0, error=str(e))
                    with self._lock:
                        self._owed.add(job.id)
                        self._need_pass = True
                    self.failing = e
                    self.owner.fail(job, e, f"replication to {self.name}")
                finally:
                    self.tried += 1
            with self._lock:
                self._pending.discard(job.id)
            self.owner.hop_done(self, job)

    def _writer(self, job: RankSave) -> int:
        """The rank that writes the metadata on ``dst`` for ``job``'s rank."""
        return job.assign.meta_writer_rank if self.dst.node_local else 0

    def _replicate(self, job: RankSave) -> None:
        src, dst = self.src, self.dst
        a = job.assign
        rnd = Round(
            self.owner.channel(job),
            a.token,
            self.hop,
            a.rank,
            a.world,
            self.owner.cfg.job.commit_timeout,
            f"checkpoint {a.checkpoint_id} ({self.name})",
        )

        held: list[leases.Lease] = []

        def check() -> None:
            if any(lease.lapsed for lease in held):
                raise TierckptError(
                    f"checkpoint {a.checkpoint_id}: rank {a.rank}: its lease on {dst.url} lapsed (not "
                    "renewed in time); a deletion there may have removed the copy: not committed"
                )

        def work() -> dict:
            out: dict[str, Any] = {"size": job.size}
            if not dst.node_local:
                # A shared tier: one writer's lease for the whole job, the coordinator's (it writes
                # the metadata there), taken before any rank copies a byte (they wait for it).
                self._job_lease(rnd, held, a.checkpoint_id)
            if job.size:
                if dst.node_local:
                    held.append(
                        leases.acquire_for_write(
                            dst, a.checkpoint_id, purpose=f"replication to {self.name} by rank {a.rank}"
                        )
                    )
                with leases.acquire(src, a.checkpoint_id, purpose=f"replication to {self.name} by rank {a.rank}"):
                    if dst.encoding is None:
                        dst.copy_from(src, data_key(a.checkpoint_id, a.file))
                    else:
                        out["stored"] = {a.file: self._copy_encoded(job, src, dst)}
                check()
            return out

        def merge(reports: list[dict]) -> bytes | None:
            stored = {f: d for rep in reports for f, d in (rep.get("stored") or {}).items()}
            assert job.metadata_json is not None  # a hop runs after the first tier's commit
            return add_stored(job.metadata_json, stored) if stored else None

        writer = self._writer(job)
        try:
            md = run_commit(
                rnd,
                dst,
                metadata_key(a.checkpoint_id),
                work=work,
                writer=writer,
                merge=merge,
                metadata=job.metadata_json,
                same_ok=True,
                before_put=check,
            )
        finally:
            for lease in held:
                lease.release()
        if dst.encoding is not None:
            self._remember(a.checkpoint_id, md)
        if writer == a.rank:
            try:
                self.owner.retain(dst, {job.id})
            except Exception as e:  # noqa: BLE001 - the checkpoint is committed; the next commit retries
                log.warning(
                    "retention on %s after replicating %s failed (will retry after the next one): %s",
                    dst.url,
                    job.id,
                    e,
                )

    def _copy_encoded(self, job: RankSave, src: Tier, dst: Tier) -> dict:
        """This rank's file of ``job`` copied encoded (:mod:`tierckpt.encodedhop`); its stored index."""
        mkey = metadata_key(job.id)
        if dst.exists(mkey):  # committed there already (the hop runs again): never rewrite its objects
            done = parse_metadata(dst.get(mkey), f"{dst.url}/{mkey}").manifest.stored.get(job.assign.file)
            if done is not None:
                return done.to_json()
        assert job.metadata_json is not None  # a hop runs after the first tier's commit
        doc = parse_metadata(job.metadata_json, f"metadata of {job.id}")
        idx, figs = self._encoded.copy(src, dst, doc, job.assign.file)
        st = job.stats
        st.add_cpu(compress_cpu_s=figs.compress_cpu_s)
        st.stored_bytes, st.uploaded_bytes, st.copied_bytes = figs.stored, figs.uploaded, figs.copied
        log.info(
            "checkpoint %s: %s stored on %s in %d of %d bytes (%.3fx), %d sent, %d copied by the server "
            "(%d read back to check the copies, %d copied frames refused)",
            job.id,
            job.assign.file,
            dst.url,
            figs.stored,
            figs.logical,
            figs.logical / max(1, figs.stored),
            figs.uploaded,
            figs.copied,
            figs.verified,
            figs.frames_refused,
        )
        return idx.to_json()

    def _remember(self, cid: str, md: bytes) -> None:
        """The stored index just committed on ``dst``: the next checkpoint copies unchanged parts from it."""
        try:
            doc = parse_metadata(md, f"metadata of {cid}")
            self._encoded.committed(cid, {f: s.to_json() for f, s in doc.manifest.stored.items()})
        except TierckptError as e:
            log.debug("checkpoint %s: stored index not remembered: %s", cid, e)
