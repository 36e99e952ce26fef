"""The coordinator's decision for one save, taken over DCP's planning calls: which checkpoint id,
which save token, which file each rank writes and which rank writes each root's metadata.

DCP calls ``prepare_local_plan`` on every rank, then ``prepare_global_plan`` on the coordinator,
then hands each rank its global plan in ``write_data``. :class:`SavePlanning` (a base of
:class:`~tierckpt.save.writer.TieredWriter`) implements those two calls and reads the decision
back in ``write_data`` (:meth:`SavePlanning._assignment`). With DCP's plan caching a rank's plan
may come from DCP's cache without this save's information: what it leaves out goes over the plan
channel (:mod:`tierckpt.save.planchannel`, at most one store write per rank and one read per
such rank on the coordinator); no collective is issued here.

One :class:`SaveCtx` per ``dcp.save`` call and thread carries what the writer's hooks hand to
each other (``dcp.async_save`` may run two saves of one writer at once, on two threads).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan

from ..capture.ranksave import RankAssign, RankSave
from ..catalog.listing import is_committed
from ..chain.checkin import check_in, dcp_group
from ..chain.commit import default_channel
from ..chain.engine import Engine
from ..errors import CommitConflict, TierckptError
from ..format.layout import rank_file, step_of
from ..tiers.base import Tier
from .planchannel import LocalInfo, PlanAssign, assign_key, info_key, multi_get, session

__all__ = ["SaveCtx", "SavePlanning", "global_rank"]

log = logging.getLogger("tierckpt")

_gen_lock = threading.Lock()
_gen_count = 0


class SaveCtx:
    """One ``dcp.save`` call on one thread: what the writer's hooks hand to each other."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.requested: str | None = None
        self.from_reset = False  # made by reset() for the save about to start
        self.is_coordinator = False
        self.rank = 0
        self.info: LocalInfo | None = None
        self.own_assign: RankAssign | None = None
        self.job: RankSave | None = None
        self.coord_global = 0
        self.members: list[int] = []  # coordinator: the global rank of every group rank


def _generate_id() -> str:
    global _gen_count
    with _gen_lock:
        _gen_count += 1
        n = _gen_count
    return time.strftime("ckpt-%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{n:04d}"


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class SavePlanning:
    """DCP's planning calls of the writer, and the per-thread save context they share with it.

    The writer sets, before the first call: ``engine``, ``_local`` (the first tier when it is
    listed cheaply, else None), ``_root`` (its root id), ``_distributed`` and ``_tls``.
    """

    engine: Engine
    _local: Tier | None
    _root: str
    _distributed: bool
    _tls: threading.local

    def _ctx(self) -> SaveCtx:
        ctx = getattr(self._tls, "ctx", None)
        if ctx is None:
            ctx = self._tls.ctx = SaveCtx()
        return ctx

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Every rank: add this rank's root and requested id to its plan and, once a plan channel
        exists, publish them on the store too (DCP's plan caching may hand the coordinator a
        cached plan without them): at most one store write. Then, for a distributed save with a
        checkpoint id, check in (:mod:`tierckpt.chain.checkin`): wait, up to ``[job]
        commit_timeout``, until every rank of the group has, else log an error naming those that
        did not and go on into DCP's gather (which then fails if one died, and succeeds if it was
        only late). No collective."""
        ctx = self._ctx()
        # The id given to reset() is used by this save only: a later save without checkpoint_id
        # must get a fresh id, never the previous one.
        requested, ctx.requested = ctx.requested, None
        committed = False
        if self._local is not None and requested is not None:
            committed = is_committed(self._local, requested)
        seq, channel = session.next_seq()
        info = ctx.info = LocalInfo(self._root, requested, committed, seq, global_rank())
        if channel is not None and self._distributed and not ctx.is_coordinator:
            default_channel(True).publish(info_key(channel, ctx.rank), info.encode())
        if self._distributed and requested is not None:
            # Last, right before DCP's gather of the plans: a rank dead or hung in planning is named.
            group = dcp_group()
            if group is not None:
                check_in(requested, group, self.engine.cfg.job.commit_timeout)
        return dataclasses.replace(plan, storage_data=info)

    def _infos(self, plans: list[SavePlan], ctx: SaveCtx) -> list[LocalInfo]:
        """Coordinator: this save's info of every rank: from its plan, or from the store for the
        ranks whose plan DCP served from its cache."""
        infos: list[LocalInfo | None] = [None] * len(plans)
        missing: list[int] = []
        with session.lock:
            for r, p in enumerate(plans):
                sd = p.storage_data
                if r == ctx.rank and ctx.info is not None:
                    infos[r] = ctx.info
                elif isinstance(sd, LocalInfo) and sd.seq > session.seen.get(r, 0):
                    infos[r] = sd
                else:
                    missing.append(r)
                if isinstance(sd, LocalInfo):
                    session.seen[r] = max(session.seen.get(r, 0), sd.seq)
            channel = session.channel
        if missing:
            if channel is None or not self._distributed:
                raise TierckptError(
                    f"rank(s) {missing} sent a cached DCP plan, but no tierckpt save planned it in this process: "
                    "DCP's plan cache was filled through another storage writer (use one planner per storage writer)"
                )
            raws = multi_get([info_key(channel, r) for r in missing])
            for r, raw in zip(missing, raws):
                info = LocalInfo.decode(raw) if raw is not None else None
                with session.lock:
                    if info is None or info.seq <= session.seen.get(r, 0):
                        raise TierckptError(
                            f"rank {r} sent a cached DCP plan but published no plan info for this save on plan "
                            f"channel {channel} (did it save through another process group?)"
                        )
                    session.seen[r] = info.seq
                infos[r] = info
        return infos  # type: ignore[return-value]

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: pick the id and save token, assign files and metadata writers.

        With DCP's plan caching, plans that DCP served from its cache carry no rank info, and
        their ranks will not see this decision in their plan either: the infos come from the
        store and the decision goes there (one store read per such rank, one write).
        """
        ctx = self._ctx()
        infos = self._infos(plans, ctx)
        ids = {i.requested_id for i in infos}
        if len(ids) != 1:
            raise TierckptError(f"ranks passed different checkpoint ids to dcp.save: {sorted(map(str, ids))}")
        cid = ids.pop()
        if cid is None:
            cid = _generate_id()
            log.warning("dcp.save was called without checkpoint_id: saving as %r", cid)
        for r, i in enumerate(infos):
            if i.committed_here:
                raise CommitConflict(
                    f"checkpoint {cid} is already committed at {i.root} (rank {r}); "
                    "use a new checkpoint_id (ids are never overwritten), or remove the old run first "
                    "to start again from scratch: tierckpt-restore delete --all"
                )
        first = self.engine.first_tier
        if self._local is None and is_committed(first, cid):
            raise CommitConflict(
                f"checkpoint {cid} is already committed at {first.url}; use a new checkpoint_id, or remove "
                "the old run first to start again from scratch: tierckpt-restore delete --all"
            )
        token = uuid.uuid4().hex
        with session.lock:
            if session.channel is None:
                session.channel = uuid.uuid4().hex[:16]
            channel = session.channel
        first_rank_of_root: dict[str, int] = {}
        for r, i in enumerate(infos):
            first_rank_of_root.setdefault(i.root, r)
        created = time.time()
        world = len(plans)
        step = step_of(cid)
        mw = [first_rank_of_root[i.root] for i in infos]
        me = global_rank()
        out = []
        for r, (p, i) in enumerate(zip(plans, infos)):
            assign = RankAssign(
                checkpoint_id=cid,
                token=token,
                rank=r,
                world=world,
                file=rank_file(r, token),
                meta_writer_rank=mw[r],
                distributed=self._distributed,
                created=created,
                step=step,
            )
            if r == ctx.rank:
                ctx.own_assign = assign
            out.append(dataclasses.replace(p, storage_data=PlanAssign(assign, i.seq, channel, me)))
        ctx.coord_global = me
        ctx.members = [i.global_rank for i in infos]
        if self._distributed and any(not p.usable for r, p in enumerate(plans) if r != ctx.rank):
            bundle = {
                "cid": cid,
                "token": token,
                "created": created,
                "step": step,
                "world": world,
                "mw": mw,
                "seqs": [i.seq for i in infos],
                "distributed": self._distributed,
                "cg": me,
            }
            default_channel(True).publish(assign_key(channel), json.dumps(bundle).encode())
        return out

    def _assignment(self, plan: SavePlan, ctx: SaveCtx) -> RankAssign:
        """This rank's decision for this save: the coordinator's own, the one in a plan received in
        full, or (for a plan DCP served from its cache) the one published on the store."""
        if ctx.own_assign is not None:
            return ctx.own_assign
        sd = plan.storage_data
        if isinstance(sd, PlanAssign) and ctx.info is not None and sd.seq == ctx.info.seq:
            with session.lock:
                session.channel = sd.channel
            ctx.coord_global = sd.coord_global
            return sd.assign
        channel = session.channel
        if channel is None or not self._distributed or ctx.info is None:
            raise TierckptError(
                f"rank {ctx.rank}: DCP handed write_data a cached plan, but no tierckpt save "
                "planned it in this process (DCP's plan cache was filled through another storage writer)"
            )
        raw = default_channel(True).try_get(assign_key(channel))
        b = json.loads(raw) if raw is not None else None
        if b is None or ctx.rank >= len(b["seqs"]) or b["seqs"][ctx.rank] != ctx.info.seq:
            raise TierckptError(
                f"rank {ctx.rank}: the coordinator published no decision for this save on plan "
                f"channel {channel} (did this rank save through another process group?)"
            )
        token = b["token"]
        ctx.coord_global = int(b["cg"])
        return RankAssign(
            checkpoint_id=b["cid"],
            token=token,
            rank=ctx.rank,
            world=int(b["world"]),
            file=rank_file(ctx.rank, token),
            meta_writer_rank=int(b["mw"][ctx.rank]),
            distributed=bool(b["distributed"]),
            created=float(b["created"]),
            step=b["step"],
        )
