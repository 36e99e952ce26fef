"""The plan channel: what DCP's plan caching leaves out of cached plans, exchanged on the store.

With ``DefaultSavePlanner(enable_plan_caching=True)`` DCP sends the coordinator an empty plan for
every rank whose plan did not change and hands ``write_data`` the cached plan of the previous
save: neither carries this save's rank info (:class:`LocalInfo`) nor the coordinator's decision
(:class:`PlanAssign`). Once the first save of the process has set up a plan channel
(:attr:`Session.channel`), ranks publish their info under :func:`info_key` in
``prepare_local_plan`` and the coordinator publishes its decision under :func:`assign_key`;
:func:`multi_get` reads them back (``TieredWriter.prepare_global_plan``/``write_data``, on the
saving thread; blocking store reads, no collective).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..capture.ranksave import RankAssign

__all__ = ["LocalInfo", "PlanAssign", "Session", "session", "info_key", "assign_key", "multi_get"]


@dataclass
class LocalInfo:
    """Rank -> coordinator: inside the local SavePlan and, once a plan channel exists, on the store.

    ``seq`` numbers this process's local steps: the coordinator takes an info as this save's only
    if its ``seq`` is newer than any it has seen from that rank (a plan that DCP's plan cache
    carried over from an earlier save holds an old info).
    """

    root: str
    requested_id: str | None
    committed_here: bool
    seq: int = 0
    global_rank: int = 0

    def encode(self) -> bytes:
        return json.dumps([self.root, self.requested_id, self.committed_here, self.seq, self.global_rank]).encode()

    @staticmethod
    def decode(raw: bytes) -> LocalInfo:
        root, requested, committed, seq, grank = json.loads(raw)
        return LocalInfo(
            str(root), None if requested is None else str(requested), bool(committed), int(seq), int(grank)
        )


@dataclass
class PlanAssign:
    """Coordinator -> rank: inside the global SavePlan (DCP drops it when it serves a cached plan:
    the rank then reads the same decision from the store, see :meth:`TieredWriter.write_data`)."""

    assign: RankAssign
    seq: int  # the local step of the rank this answers
    channel: str
    coord_global: int  # the coordinator's global rank (persisted plans name it)


class Session:
    """Process-wide plan-caching state (DCP's own plan cache is process-wide too).

    ``channel`` names the store keys through which ranks and coordinator exchange what DCP's
    plan caching leaves out of cached plans; the coordinator of the first save picks it and every
    rank adopts it from the assignment of a plan it received in full. ``seen`` is the
    coordinator's newest ``LocalInfo.seq`` per rank.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seq = 0
        self.channel: str | None = None
        self.seen: dict[int, int] = {}

    def next_seq(self) -> tuple[int, str | None]:
        with self.lock:
            self.seq += 1
            return self.seq, self.channel


session = Session()


def info_key(channel: str, rank: int) -> str:
    return f"tierckpt/plan/{channel}/info{rank}"


def assign_key(channel: str) -> str:
    return f"tierckpt/plan/{channel}/assign"


def multi_get(keys: list[str]) -> list[bytes | None]:
    """The values of ``keys`` on the default store (None where absent): two round trips when all
    are there (the protocol's case), whatever their number."""
    from ..chain.jobstore import JobStore

    store = JobStore()
    if store.check(keys):
        if hasattr(store, "multi_get"):
            return [bytes(v) for v in store.multi_get(keys)]
        return [bytes(store.get(k)) for k in keys]
    return [bytes(store.get(k)) if store.check([k]) else None for k in keys]
