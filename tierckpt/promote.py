"""Background promotion: committed local checkpoints are uploaded to S3 and committed there.

One promoter thread per engine (per process), fed in commit order. For each checkpoint, on
every rank: upload this rank's data file (multipart, concurrent parts, CRC32C per part) while
holding a read lease on it locally, then run the same commit protocol as on the local tier
(:mod:`tierckpt.commit`) on a separate channel prefix: rank reports, the coordinator's outcome,
then rank 0 writes ``ID/metadata.json`` on S3 with ``If-None-Match`` (S3 is one shared root, so
one writer). ``latest`` on S3 therefore moves only after every rank's upload completed. After
the commit, rank 0 applies ``[s3] keep`` / ``keep_every`` and aborts stale multipart uploads.

**The backlog.** A job killed after a local commit but before the upload leaves checkpoints
that exist on no other tier. Before promoting its first checkpoint (and again after any failed
promotion) the promoter runs a *backlog pass* on every rank, led by the coordinator:

1. every rank reports the checkpoints committed on its local tier that are older than the one
   about to be promoted, with the data files it holds;
2. the coordinator lists S3 and picks what S3 should have but lacks: everything newer than S3's
   newest, and ``keep_every`` milestones; it assigns each data file to one rank holding it;
3. the ranks upload their files (under read leases); the lowest rank holding the metadata checks
   that every data file the metadata names was assigned, and publishes the metadata;
4. the coordinator commits each complete checkpoint on S3 (metadata last, create-if-absent),
   oldest first, and publishes what was promoted and what is still owed.

Until the first pass has run, local retention deletes nothing; afterwards it never deletes a
checkpoint still owed to S3 unless the disk would otherwise fill (then with a warning naming it).

A failure (outage past botocore's and our retries, a rank that died) fails the promotion of
*that* checkpoint: it is logged at once, raised by the next ``writer.wait()``, the S3 copy stays
uncommitted (never loaded), training and the local tier go on, and the next promotion first
retries it through a backlog pass. Promotion never blocks training: only ``wait()`` waits for it.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from . import lease as leases
from .catalog import committed_in_order
from .commit import Channel, encode_report, gather_reports
from .errors import CaptureError, CommitConflict, TierckptError
from .layout import data_key, metadata_key, metadata_from_json

if TYPE_CHECKING:
    from .pipeline import Engine, RankSave

__all__ = ["Promoter"]

_LOST = "is on no live rank's local tier"

log = logging.getLogger("tierckpt.promote")


class Promoter:
    """Uploads and commits checkpoints on S3 after their local commit. Created by the engine."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self._q: queue.Queue[RankSave | None] = queue.Queue()
        self._pending: set[str] = set()
        self._owed: set[str] = set()  # committed locally, known missing on S3 (backlog, failed promotions)
        self._need_pass = True  # coordinator: run a backlog pass before the next promotion
        self.settled = False  # a backlog pass (or a failed attempt at one) has run in this process
        self.started = threading.Event()  # the start-up pass (single-process jobs) is over
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="tierckpt-promote", daemon=True)
        self._thread.start()

    def submit(self, job: "RankSave") -> None:
        """Queue a locally committed checkpoint for promotion (commit thread)."""
        with self._lock:
            self._pending.add(job.id)
        self._q.put(job)

    def pending_ids(self) -> set[str]:
        with self._lock:
            return set(self._pending)

    def owed(self) -> set[str]:
        """Checkpoints committed locally that S3 should get and does not have yet."""
        with self._lock:
            return self._pending | self._owed

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        from .pipeline import lower_priority

        lower_priority(self.engine.cfg.job.background_nice)
        try:
            self.engine.s3_tier()  # build the client now, not during the first promotion
        except Exception as e:  # noqa: BLE001 - reported by the first promotion that needs it
            log.warning("S3 tier not ready yet: %s", e)
        self._startup_pass()
        while True:
            job = self._q.get()
            if job is None:
                return
            self._backlog_step(job)
            t0 = time.perf_counter()
            try:
                self._promote(job)
                job.stats.promote_s = time.perf_counter() - t0
                log.info("checkpoint %s promoted to %s (rank %d, %.1f MiB in %.2f s)", job.id,
                         self.engine.s3_tier().url, job.assign.rank, job.size / 2**20, job.stats.promote_s)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the user
                with self._lock:
                    self._owed.add(job.id)
                    self._need_pass = True
                self.engine._fail(job, e, "promotion to S3")
            with self._lock:
                self._pending.discard(job.id)
            self._local_retention(job)
            # Settled after retention, so that wait() returning means retention on both tiers ran;
            # retired last, so that a wait() in between still finds the job.
            if not job.failed and not job.promoted.done():
                job.promoted.set_result(None)
            self.engine._retire(job)

    def _local_retention(self, job: "RankSave") -> None:
        """Local retention skipped checkpoints still waiting for promotion: apply it again now."""
        if self.engine.local is None:
            return
        self.engine.retain_first_tier(job)  # committed locally, even if its promotion failed

    def _promote(self, job: "RankSave") -> None:
        eng = self.engine
        s3 = eng.s3_tier()
        local = eng.local
        assert local is not None and eng.cfg.s3 is not None
        a = job.assign
        ch = eng.channel(job)
        prefix = f"tierckpt/{a.token}/s3"
        timeout = eng.cfg.job.commit_timeout
        try:
            if job.size:
                with leases.acquire(local, a.checkpoint_id, purpose=f"promotion by rank {a.rank}"):
                    src = local.root / data_key(a.checkpoint_id, a.file)  # type: ignore[attr-defined]
                    s3.upload_file(data_key(a.checkpoint_id, a.file), str(src))
            ch.publish(f"{prefix}/rank{a.rank}", encode_report(True, size=job.size))
        except BaseException as e:
            ch.publish(f"{prefix}/rank{a.rank}", encode_report(False, error=f"{type(e).__name__}: {e}"))
            if a.rank == 0:
                ch.publish(f"{prefix}/outcome", b"E" + f"rank 0 failed: {e}".encode())
            raise
        if a.rank == 0:
            try:
                gather_reports(ch, prefix, a.world, timeout, f"checkpoint {a.checkpoint_id} (S3)")
                assert job.metadata_json is not None
                try:
                    s3.put(metadata_key(a.checkpoint_id), job.metadata_json, if_absent=True)
                except CommitConflict:
                    if s3.get(metadata_key(a.checkpoint_id)) != job.metadata_json:
                        raise  # another save's commit under this id: never overwritten
                ch.publish(f"{prefix}/outcome", b"OK")
            except BaseException as e:
                ch.publish(f"{prefix}/outcome", b"E" + str(e).encode())
                raise
            try:
                eng.retain_s3(job)
            except Exception as e:  # noqa: BLE001 - the checkpoint is committed; the next commit retries
                log.warning("S3 retention after promoting %s failed (will retry after the next one): %s", job.id, e)
        else:
            out = ch.wait_get(f"{prefix}/outcome", timeout + 30, f"checkpoint {a.checkpoint_id}: S3 commit outcome")
            if out != b"OK":
                raise CaptureError(f"checkpoint {a.checkpoint_id} was not committed on S3: {out[1:].decode(errors='replace')}")

    # -- the backlog ----------------------------------------------------------------------
    def _startup_pass(self) -> None:
        """Without a process group (one process is the whole job) the backlog is promoted at once,
        not only before the first promotion: a job that resumes and never saves still uploads it.
        With a process group the ranks meet at their first promotion (see :meth:`_backlog_step`)."""
        import uuid

        import torch.distributed as dist

        try:
            if dist.is_available() and dist.is_initialized():
                return
            from .commit import LocalChannel

            try:
                self._backlog_pass(0, 1, f"startup-{uuid.uuid4().hex}", None, "", LocalChannel())
            except BaseException as e:  # noqa: BLE001 - retried before the first promotion
                log.warning("promoting the backlog at start failed (retried before the first promotion): %s", e)
                return
            self.settled = True
        finally:
            self.started.set()

    def _backlog_step(self, job: "RankSave") -> None:
        """Before promoting ``job``: the coordinator decides whether a backlog pass runs (first
        promotion of this process, or something is owed); every rank follows. Never raises."""
        a = job.assign
        ch = self.engine.channel(job)
        prefix = f"tierckpt/{a.token}/backlog"
        timeout = self.engine.cfg.job.commit_timeout
        try:
            if a.rank == 0:
                with self._lock:
                    go = self._need_pass
                ch.publish(f"{prefix}/go", b"1" if go else b"0")
            else:
                go = ch.wait_get(f"{prefix}/go", timeout + 30, f"checkpoint {a.checkpoint_id}: backlog decision") == b"1"
            if go:
                self._backlog_pass(a.rank, a.world, a.token, job.seq, job.id, ch)
        except BaseException as e:  # noqa: BLE001 - the backlog is retried before the next promotion
            log.warning("promoting the backlog before %s failed (retried before the next promotion): %s", job.id, e)
            with self._lock:
                self._need_pass = True
                self._owed |= self._local_older(job)
        finally:
            self.settled = True

    def _local_older(self, job: "RankSave") -> set[str]:
        seq = job.seq
        local = self.engine.local
        assert local is not None
        try:
            return {c.checkpoint_id for c in committed_in_order(local) if c.header and c.header.seq < seq}
        except TierckptError:
            return set()

    def _backlog_pass(self, rank: int, world: int, token: str, below_seq: int | None, exclude: str, ch: Channel) -> None:
        """One backlog pass on this rank (see the module docstring); every rank of the job runs it
        with the same ``token``. ``below_seq``: only checkpoints committed before this one (the one
        about to be promoted normally); None: all."""
        eng = self.engine
        local, s3 = eng.local, eng.s3_tier()
        assert local is not None and eng.cfg.s3 is not None
        timeout = eng.cfg.job.commit_timeout
        prefix = f"tierckpt/{token}/backlog"
        what = f"backlog before {exclude}" if exclude else "backlog at start"
        # 1. what this rank holds: committed locally, older than the job
        mine: dict[str, dict[str, Any]] = {}
        queued = self.pending_ids()  # promoted normally, soon
        for c in committed_in_order(local):
            assert c.header is not None
            if (below_seq is None or c.header.seq < below_seq) and c.checkpoint_id != exclude and c.checkpoint_id not in queued:
                files = {n: o.size for n, o in c.objects.items() if n.endswith(".data")}
                mine[c.checkpoint_id] = {"seq": c.header.seq, "step": c.step, "files": files}
        ch.publish(f"{prefix}/have{rank}", json.dumps(mine).encode())
        # 2. the coordinator's plan
        if rank == 0:
            plan = self._plan_backlog(ch, prefix, world, timeout, what)
            ch.publish(f"{prefix}/plan", json.dumps(plan).encode())
        else:
            plan = json.loads(ch.wait_get(f"{prefix}/plan", timeout + 30, f"{what}: plan"))
        needed: list[str] = plan["needed"]
        if not needed:
            with self._lock:
                self._owed -= set(mine)
                if rank == 0:
                    self._need_pass = False
            return
        log.info("%s: %d checkpoint(s) committed locally are missing on %s: %s", what, len(needed), s3.url, ", ".join(needed))
        # 3. uploads of the files assigned to this rank; the metadata from its designated rank
        results: dict[str, str] = {}
        for cid in needed:
            p = plan["plan"][cid]
            try:
                todo = [f for f, (r, _size) in p["files"].items() if r == rank]
                if todo or p["md_rank"] == rank:
                    with leases.acquire(local, cid, purpose=f"backlog promotion by rank {rank}"):
                        for f in todo:
                            s3.upload_file(data_key(cid, f), str(local.root / data_key(cid, f)))  # type: ignore[attr-defined]
                        if p["md_rank"] == rank:
                            ch.publish(f"{prefix}/md/{cid}", self._checked_metadata(cid, p["files"]))
                results[cid] = "ok"
            except BaseException as e:  # noqa: BLE001 - reported to the coordinator
                results[cid] = f"rank {rank}: {type(e).__name__}: {e}"
        ch.publish(f"{prefix}/done{rank}", json.dumps(results).encode())
        # 4. commits, oldest first, by the coordinator
        if rank == 0:
            outcome = self._commit_backlog(ch, prefix, world, timeout, what, needed)
            ch.publish(f"{prefix}/outcome", json.dumps(outcome).encode())
        else:
            outcome = json.loads(ch.wait_get(f"{prefix}/outcome", timeout + 30, f"{what}: outcome"))
        with self._lock:
            self._owed -= set(mine)
            self._owed |= set(outcome["failed"])
            if rank == 0:
                self._need_pass = bool(outcome["failed"])
        if rank == 0 and outcome["promoted"]:
            try:
                eng.retain_s3_now(set(outcome["promoted"]))
            except Exception as e:  # noqa: BLE001
                log.warning("S3 retention after the backlog failed: %s", e)

    def _plan_backlog(self, ch: Channel, prefix: str, world: int, timeout: float, what: str) -> dict:
        """Coordinator: union the ranks' holdings, compare with S3, assign every file to one rank."""
        cfg = self.engine.cfg.s3
        assert cfg is not None
        deadline = time.monotonic() + timeout
        have: list[dict] = []
        for r in range(world):
            raw = ch.wait_get(f"{prefix}/have{r}", max(0.0, deadline - time.monotonic()), f"{what}: holdings of rank {r}")
            have.append(json.loads(raw))
            ch.delete(f"{prefix}/have{r}")
        on_s3 = committed_in_order(self.engine.s3_tier())
        s3_ids = {c.checkpoint_id for c in on_s3}
        s3_newest = on_s3[-1].header.seq if on_s3 else 0  # type: ignore[union-attr]
        info: dict[str, dict] = {}
        for h in have:
            for cid, d in h.items():
                info.setdefault(cid, d)
        needed = sorted((cid for cid, d in info.items() if cid not in s3_ids and (
            d["seq"] > s3_newest or (cfg.keep_every and d["step"] is not None and d["step"] % cfg.keep_every == 0))),
            key=lambda cid: info[cid]["seq"])
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
        """The metadata of ``cid`` from this rank's local tier, after checking that every data file
        it names was found on some rank with its recorded size."""
        local = self.engine.local
        assert local is not None
        raw = local.get(metadata_key(cid))
        _md, man = metadata_from_json(raw, f"{local.url}/{metadata_key(cid)}")
        for f, size in man.files.items():
            if size and (f not in files or files[f][1] != size):
                raise TierckptError(f"checkpoint {cid}: data file {f} ({size} bytes) {_LOST}")
        return raw

    def _commit_backlog(self, ch: Channel, prefix: str, world: int, timeout: float, what: str, needed: list[str]) -> dict:
        s3 = self.engine.s3_tier()
        deadline = time.monotonic() + timeout
        errors: dict[str, str] = {}
        for r in range(world):
            raw = ch.wait_get(f"{prefix}/done{r}", max(0.0, deadline - time.monotonic()), f"{what}: uploads of rank {r}")
            for cid, res in json.loads(raw).items():
                if res != "ok" and cid not in errors:
                    errors.setdefault(cid, res)
            ch.delete(f"{prefix}/done{r}")
        promoted, failed = [], {}
        for cid in needed:
            md = ch.try_get(f"{prefix}/md/{cid}")
            ch.delete(f"{prefix}/md/{cid}")
            if cid in errors or md is None:
                why = errors.get(cid, "no metadata")
                if _LOST in why:
                    log.warning("%s: %s cannot be promoted to %s (it stays local only): %s", what, cid, s3.url, why)
                else:
                    failed[cid] = why
                    log.warning("%s: %s stays owed to %s: %s", what, cid, s3.url, why)
                continue
            try:
                s3.put(metadata_key(cid), md, if_absent=True)
            except CommitConflict:
                pass  # committed meanwhile (another process): it is there
            except TierckptError as e:
                failed[cid] = str(e)
                log.warning("%s: committing %s on %s failed: %s", what, cid, s3.url, e)
                continue
            promoted.append(cid)
            log.info("%s: %s promoted to %s", what, cid, s3.url)
        return {"promoted": promoted, "failed": failed}
