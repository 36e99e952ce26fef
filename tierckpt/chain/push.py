"""Push a backlog by hand: copy to each later tier what it lacks from the first tier, as a job's hops do.

A job's hops copy their backlog (checkpoints committed on the first tier that a later tier
lacks: an outage, a job that exited before its copies finished) before their next copy. When no
job runs any more, :func:`push_backlog` runs that same pass from one process (``tierckpt-restore
push``): the backlog pass of :mod:`.backlog` in a one-rank round, with the same plan (what the
destination should have and lacks: everything newer than its newest, and its ``keep_every``
milestones), the same leases (a read lease on the source, a writer's lease on the destination,
held until committed) and the same commit (metadata last, create-if-absent). A job copying the
same checkpoint at the same time is harmless: whichever commits second finds it committed.

Retention is not applied here: the caller runs it afterwards on every tier
(:func:`restore.gc.gc_checkpoints`), which then sees every promoted checkpoint.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field

from ..capture.ranksave import RankSave
from ..config import Config
from ..tiers.base import Tier
from .backlog import BacklogPasses
from .commit import Channel, LocalChannel, Round
from .encodedhop import EncodedCopies

__all__ = ["HopPush", "push_backlog"]


@dataclass
class HopPush:
    """What :func:`push_backlog` did for one later tier ``tier`` (a configuration section name)."""

    tier: str
    url: str
    needed: list[str] = field(default_factory=list)  # owed to the tier, oldest first
    promoted: list[str] = field(default_factory=list)  # committed there now
    failed: dict[str, str] = field(default_factory=dict)  # id -> why it stays owed
    error: str = ""  # the pass itself failed (the tier could not be listed): nothing copied

    def to_json(self) -> dict:
        return dict(self.__dict__)


class _Owner:
    """The hop owner of a one-process push: a local channel, and no retention during the pass."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def channel(self, job: RankSave) -> Channel:
        return LocalChannel()

    def retain(
        self, tier: Tier, protect: set[str], *, owed: set[str] | frozenset[str] = frozenset(), need_bytes: int = 0
    ) -> None:
        """No retention during the pass (the caller applies it on every tier afterwards)."""


class _Hop(BacklogPasses):
    """One hop ``src -> dst`` with the state a backlog pass keeps (see :class:`BacklogPasses`)."""

    def __init__(self, owner: _Owner, src: Tier, dst: Tier, index: int) -> None:
        self.owner = owner
        self._src_tier, self._dst_tier = src, dst
        self.name = dst.name
        self.hop = f"{index}-{dst.name}"
        self.settled = False
        self.started = threading.Event()
        self._lock = threading.Lock()
        self._need_pass = True
        self._owed: set[str] = set()
        self._pending: set[str] = set()
        self.failing = None
        self._encoded = EncodedCopies(owner.cfg.job.background_nice)

    @property
    def src(self) -> Tier:
        return self._src_tier

    @property
    def dst(self) -> Tier:
        return self._dst_tier


def push_backlog(cfg: Config, tiers: list[Tier], only: str | None = None) -> list[HopPush]:
    """Copy to every later tier of ``tiers`` (fastest first; or only to the tier of section
    ``only``) the committed checkpoints of ``tiers[0]`` it should have and lacks, each committed
    there by the commit protocol under leases. Returns one :class:`HopPush` per later tier; a
    tier that could not be listed or written is reported in it (``error``, ``failed``), never
    raised, so that the other tiers are still pushed."""
    owner = _Owner(cfg)
    out: list[HopPush] = []
    for i, dst in enumerate(tiers[1:], start=1):
        if only is not None and dst.name != only:
            continue
        res = HopPush(dst.name, dst.url)
        hop = _Hop(owner, tiers[0], dst, i)
        rnd = Round(
            LocalChannel(),
            f"push-{uuid.uuid4().hex}",
            f"backlog-{hop.hop}",
            0,
            1,
            cfg.job.commit_timeout,
            f"push to {dst.name}",
        )
        try:
            done = hop._backlog_pass(rnd, None, "")
            res.needed, res.promoted, res.failed = done["needed"], done["promoted"], dict(done["failed"])
            for cid in res.needed:  # skipped by the pass (logged there): still owed, so not ok
                if cid not in res.promoted and cid not in res.failed:
                    res.failed[cid] = (
                        f"not copied: {tiers[0].url} does not hold all of its files (a checkpoint whose ranks wrote "
                        "on several nodes: run push where [peer] copies make one node hold them all, or on each node)"
                    )
        except Exception as e:  # noqa: BLE001 - reported per tier (see docstring)
            res.error = f"{type(e).__name__}: {e}"
        finally:
            rnd.finish()
        out.append(res)
    return out
