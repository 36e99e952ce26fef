"""A hop's backlog: checkpoints committed on its source tier that its destination lacks (a hop
that failed, a job that restarted, a node that came back), copied before the next new one.

Every rank runs the same pass at the same point (before a copy, or at start without a process
group); the coordinator decides from every rank's listing which checkpoints are owed, and each
is copied and committed by the same commit protocol as a new one (:mod:`.commit`). A checkpoint
whose files are on no live rank's first tier is dropped from what is owed, with a warning; one
deleted on the first tier while the pass copies it (retention, a framework's ``save_top_k``) is
dropped too, logged at INFO (its deletion removes what the pass copied: see
:mod:`tierckpt.integrations.deletions`).
:class:`BacklogPasses` is a base of :class:`~tierckpt.chain.replicate.Replicator`; it runs on the
hop's thread.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from typing import TYPE_CHECKING, Any, Protocol

from ..capture.ranksave import RankSave
from ..catalog import lease as leases
from ..catalog.listing import committed_headers, committed_in_order
from ..codec import add_stored
from ..config import Config
from ..errors import CheckpointBeingDeleted, CheckpointNotFound, CommitConflict, TierckptError
from ..format.layout import data_key, is_data_file, metadata_key
from ..format.metadata import metadata_from_json, parse_metadata
from ..tiers.base import Tier
from .commit import Channel, LocalChannel, Round
from .encodedhop import EncodedCopies

__all__ = ["BacklogPasses", "BacklogOwner"]

_LOST = "is on no live rank's first tier"
_GONE = "was deleted on the first tier meanwhile"

log = logging.getLogger("tierckpt.replicate")


class BacklogOwner(Protocol):
    """What a backlog pass needs from whoever runs the hop (the engine; see ``HopOwner``)."""

    cfg: Config

    def channel(self, job: RankSave) -> Channel:
        """The rendezvous of ``job``'s ranks."""

    def retain(self, tier: Tier, protect: set[str], *, owed: set[str] = ..., need_bytes: int = 0) -> None:
        """Apply ``tier``'s retention now, sparing ``protect`` and saves in flight."""


class BacklogPasses:
    """The backlog passes of a hop (see the module docstring); the hop's state is the Replicator's."""

    owner: BacklogOwner
    name: str
    hop: str
    settled: bool
    started: threading.Event
    _lock: threading.Lock
    _need_pass: bool
    _owed: set[str]
    _pending: set[str]
    failing: BaseException | None
    _encoded: EncodedCopies

    if TYPE_CHECKING:  # the Replicator's own, named for the type checker

        @property
        def src(self) -> Tier: ...

        @property
        def dst(self) -> Tier: ...

    # -- the backlog ----------------------------------------------------------------------
    def _startup_pass(self) -> None:
        """Without a process group (one process is the whole job) the backlog is copied at once,
        not only before the first copy: a job that resumes and never saves still replicates it.
        With a process group the ranks meet at their first copy (see :meth:`_backlog_step`)."""
        import torch.distributed as dist

        try:
            if dist.is_available() and dist.is_initialized():
                return
            rnd = Round(
                LocalChannel(),
                f"startup-{uuid.uuid4().hex}",
                f"backlog-{self.hop}",
                0,
                1,
                self.owner.cfg.job.commit_timeout,
                f"copying the checkpoints still missing on {self.name} (left by an earlier job or an outage) at start",
            )
            try:
                self._backlog_pass(rnd, None, "")
            except BaseException as e:  # noqa: BLE001 - retried before the first copy
                log.warning(
                    "copying the checkpoints still missing on %s at start failed; they stay committed on the first tier, "
                    "and the copy is retried before the next checkpoint's copy: %s",
                    self.name,
                    e,
                )
                return
            finally:
                rnd.finish()
            self.settled = True
        finally:
            self.started.set()

    def _backlog_step(self, job: RankSave) -> None:
        """Before copying ``job``: the coordinator decides whether a backlog pass runs (first copy
        of this process, or something is owed); every rank follows. Never raises."""
        a = job.assign
        rnd = Round(
            self.owner.channel(job),
            a.token,
            f"backlog-{self.hop}",
            a.rank,
            a.world,
            self.owner.cfg.job.commit_timeout,
            f"copying the checkpoints still missing on {self.name} before {job.id}",
        )
        try:
            if a.rank == 0:
                with self._lock:
                    go = self._need_pass
                rnd.put_shared("go", b"1" if go else b"0")
            else:
                go = rnd.get_shared("go", "backlog decision") == b"1"
            if go:
                self._backlog_pass(rnd, job.seq, job.id)
        except BaseException as e:  # noqa: BLE001 - the backlog is retried before the next copy
            # While the tier is failing, the copy's own failure is the one WARNING of this checkpoint.
            log.log(
                logging.INFO if self.failing is not None else logging.WARNING,
                "replicating the backlog to %s before %s failed (retried before the next copy): %s",
                self.name,
                job.id,
                e,
            )
            with self._lock:
                self._need_pass = True
                self._owed |= self._src_older(job)
        finally:
            rnd.finish()
            self.settled = True

    def _src_older(self, job: RankSave) -> set[str]:
        try:
            return {c.checkpoint_id for c in committed_in_order(self.src) if c.header and c.header.seq < job.seq}
        except TierckptError:
            return set()

    def _backlog_pass(self, rnd: Round, below_seq: int | None, exclude: str) -> dict[str, Any]:
        """One backlog pass on this rank (see the module docstring); every rank of the job runs it
        in the same round. ``below_seq``: only checkpoints committed before this one (the one
        about to be copied normally); None: all. Returns what it found and did: ``needed`` (ids
        owed to ``dst``, oldest first), ``promoted`` (committed there by this pass) and ``failed``
        (id -> why it stays owed); raises when the pass itself failed (``dst`` not listable)."""
        src, dst = self.src, self.dst
        rank = rnd.rank
        # 1. what this rank holds: committed on src, older than the job
        mine: dict[str, dict[str, Any]] = {}
        with self._lock:
            queued = set(self._pending)  # copied normally, soon
        for c in committed_in_order(src):
            assert c.header is not None
            if (
                (below_seq is None or c.header.seq < below_seq)
                and c.checkpoint_id != exclude
                and c.checkpoint_id not in queued
            ):
                files = {n: o.size for n, o in c.objects.items() if is_data_file(n)}
                mine[c.checkpoint_id] = {"seq": c.header.seq, "step": c.step, "files": files}
        rnd.put_mine(f"have{rank}", json.dumps(mine).encode())
        # 2. the coordinator's plan
        if rank == 0:
            plan = self._plan_backlog([json.loads(v) for v in rnd.gather_values("have")], rnd.world)
            rnd.put_shared("plan", json.dumps(plan).encode())
        else:
            plan = json.loads(rnd.get_shared("plan", "plan"))
        needed: list[str] = plan["needed"]
        if not needed:
            with self._lock:
                self._owed -= set(mine)
                if rank == 0:
                    self._need_pass = False
            return {"needed": [], "promoted": [], "failed": {}}
        log.info(
            "%s: %d checkpoint(s) committed on %s are missing on %s: %s",
            rnd.what,
            len(needed),
            src.url,
            dst.url,
            ", ".join(needed),
        )
        # 3. copies of the files assigned to this rank (each under a writer's lease on dst, held
        #    until the coordinator committed: see tierckpt.lease); the metadata from its designated rank
        results: dict[str, str] = {}
        stored: dict[str, dict] = {}  # cid -> file -> stored index (an encoding dst)
        held: list[leases.Lease] = []
        try:
            if not dst.node_local:
                self._job_lease(rnd, held, *needed)
            for cid in needed:
                p = plan["plan"][cid]
                try:
                    todo = [f for f, (r, _size) in p["files"].items() if r == rank]
                    if todo and dst.node_local:
                        held.append(
                            leases.acquire_for_write(
                                dst, cid, purpose=f"backlog replication to {self.name} by rank {rank}"
                            )
                        )
                    if todo or p["md_rank"] == rank:
                        with leases.acquire(src, cid, purpose=f"backlog replication to {self.name} by rank {rank}"):
                            doc = (
                                parse_metadata(src.get(metadata_key(cid)), f"{src.url}/{metadata_key(cid)}")
                                if dst.encoding is not None and todo
                                else None
                            )
                            for f in todo:
                                if doc is None or not p["files"][f][1]:
                                    dst.copy_from(src, data_key(cid, f))
                                else:
                                    stored.setdefault(cid, {})[f] = self._encoded.copy(src, dst, doc, f)[0].to_json()
                            if p["md_rank"] == rank:
                                rnd.ch.publish(rnd.key(f"md/{cid}"), self._checked_metadata(cid, p["files"]))
                    lapsed = [lease.checkpoint_id for lease in held if lease.checkpoint_id == cid and lease.lapsed]
                    results[cid] = f"rank {rank}: its lease on {dst.url} lapsed" if lapsed else "ok"
                except (CheckpointNotFound, CheckpointBeingDeleted) as e:
                    # Retention or the training framework (save_top_k) deleted it on src since it was
                    # listed: nothing is owed any more (not a failure to retry).
                    gone = isinstance(e, CheckpointBeingDeleted) or not _committed(src, cid)
                    why = f"{type(e).__name__}: {e}"
                    results[cid] = f"rank {rank}: {_GONE}: {why}" if gone else f"rank {rank}: {why}"
                except BaseException as e:  # noqa: BLE001 - reported to the coordinator
                    results[cid] = f"rank {rank}: {type(e).__name__}: {e}"
            rnd.put_mine(f"done{rank}", json.dumps({"results": results, "stored": stored}).encode())
            # 4. commits, oldest first, by the coordinator
            if rank == 0:
                outcome = self._commit_backlog(rnd, needed)
                rnd.put_shared("outcome", b"M" + json.dumps(outcome).encode())
            out = rnd.outcome()
        finally:
            for lease in held:
                lease.release()
        assert out is not None
        outcome = json.loads(out)
        with self._lock:
            self._owed -= set(mine)
            self._owed |= set(outcome["failed"])
            if rank == 0:
                self._need_pass = bool(outcome["failed"])
        if rank == 0 and outcome["promoted"]:
            try:
                self.owner.retain(dst, set(outcome["promoted"]))
            except Exception as e:  # noqa: BLE001
                log.warning(
                    "deleting old checkpoints on %s (retention) after copying the missing ones failed: %s", dst.url, e
                )
        return {"needed": needed, "promoted": outcome["promoted"], "failed": outcome["failed"]}

    def _job_lease(self, rnd: Round, held: list, *ids: str) -> None:
        """On a shared ``dst``: the coordinator takes the writer's lease on each of ``ids`` (one per
        job, not one per rank: :func:`tierckpt.lease.acquire_for_write`) and publishes that it
        holds them; every other rank waits for that before it writes. The coordinator checks the
        leases once more before it commits (``before_put``), so a deletion that removed any rank's
        copy can never be followed by the commit."""
        if rnd.rank == 0:
            try:
                for cid in ids:
                    held.append(leases.acquire_for_write(self.dst, cid, purpose=f"replication to {self.name} (job)"))
            except BaseException as e:
                rnd.put_shared("lease", b"E" + f"{type(e).__name__}: {e}".encode(errors="replace"))
                raise
            rnd.put_shared("lease", b"OK")
            return
        got = rnd.get_shared("lease", f"the coordinator's lease on {self.dst.url}")
        if got != b"OK":
            raise TierckptError(
                f"{rnd.what}: the coordinator could not lease it on {self.dst.url}: {got[1:].decode(errors='replace')}"
            )

    def _plan_backlog(self, have: list[dict], world: int) -> dict:
        """Coordinator: union the ranks' holdings, compare with ``dst``, assign every file to one rank."""
        dst = self.dst
        on_dst = committed_headers(dst)  # an object store: one listing + one header read per checkpoint
        dst_ids = set(on_dst)
        dst_newest = max((h.seq for h, _size in on_dst.values()), default=0)
        every = dst.keep_every
        info: dict[str, dict] = {}
        for h in have:
            for cid, d in h.items():
                info.setdefault(cid, d)
        needed = sorted(
            (
                cid
                for cid, d in info.items()
                if cid not in dst_ids
                and (d["seq"] > dst_newest or (every and d["step"] is not None and d["step"] % every == 0))
            ),
            key=lambda cid: info[cid]["seq"],
        )
        plan: dict[str, dict] = {}
        load = [0] * world
        for cid in needed:
            files: dict[str, list[int]] = {}
            holders = [r for r in range(world) if cid in have[r]]
            for r in holders:
                for f, size in have[r][cid]["files"].items():
                    if f not in files:
                        best = min((q for q in holders if f in have[q][cid]["files"]), key=lambda q: (load[q], q))
                        files[f] = [best, size]
                        load[best] += size
            plan[cid] = {"files": files, "md_rank": holders[0]}
        return {"needed": needed, "plan": plan}

    def _checked_metadata(self, cid: str, files: dict[str, list[int]]) -> bytes:
        """The metadata of ``cid`` from this rank's ``src``, after checking that every data file it
        names was found on some rank with its recorded size."""
        src = self.src
        raw = src.get(metadata_key(cid))
        _md, man = metadata_from_json(raw, f"{src.url}/{metadata_key(cid)}")
        for f, size in man.files.items():
            if size and (f not in files or files[f][1] != size):
                raise TierckptError(f"checkpoint {cid}: data file {f} ({size} bytes) {_LOST}")
        return raw

    def _commit_backlog(self, rnd: Round, needed: list[str]) -> dict:
        dst = self.dst
        errors: dict[str, str] = {}
        stored: dict[str, dict] = {}
        for raw in rnd.gather_values("done"):
            done = json.loads(raw)
            for cid, res in done["results"].items():
                if res != "ok":
                    errors.setdefault(cid, res)
            for cid, files in done["stored"].items():
                stored.setdefault(cid, {}).update(files)
        promoted, failed = [], {}
        for cid in needed:
            md = rnd.ch.try_get(rnd.key(f"md/{cid}"))
            rnd.ch.delete(rnd.key(f"md/{cid}"))
            if cid in errors or md is None:
                why = errors.get(cid, "no metadata")
                if _GONE in why:
                    log.info("%s: %s is not copied to %s: %s", rnd.what, cid, dst.url, why)
                elif _LOST in why:
                    log.warning(
                        "%s: %s cannot be copied to %s (it stays on %s only): %s",
                        rnd.what,
                        cid,
                        dst.url,
                        self.src.url,
                        why,
                    )
                else:
                    failed[cid] = why
                    log.warning(
                        "%s: %s is not on %s yet (it stays committed on the first tier; the copy is retried later): %s",
                        rnd.what,
                        cid,
                        dst.url,
                        why,
                    )
                continue
            if cid in stored:
                md = add_stored(md, stored[cid])
            try:
                dst.put(metadata_key(cid), md, if_absent=True)
            except CommitConflict:
                pass  # committed meanwhile (another process): it is there
            except TierckptError as e:
                failed[cid] = str(e)
                log.warning("%s: committing %s on %s failed: %s", rnd.what, cid, dst.url, e)
                continue
            promoted.append(cid)
            if cid in stored:
                self._encoded.committed(cid, stored[cid])
            log.info("%s: %s replicated to %s", rnd.what, cid, dst.url)
        return {"promoted": promoted, "failed": failed}


def _committed(tier: Tier, cid: str) -> bool:
    """Whether ``tier`` still holds ``cid`` committed (True when that cannot be told)."""
    try:
        return tier.exists(metadata_key(cid))
    except TierckptError:
        return True
