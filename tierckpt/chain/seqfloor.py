"""The commit order's floor on one rank: the highest commit ``seq`` this rank can see.

A checkpoint's ``seq`` (its place in the commit order, which ``latest`` and retention follow) is
one more than any rank has seen on its tiers. Who calls: the :class:`~tierckpt.chain.engine.Engine`
of one configuration; :meth:`SeqFloor.floor` on its commit thread (in the commit protocol's
report), :meth:`SeqFloor.note` after each commit, :meth:`SeqFloor.start_later` on the training
thread at the first save (rank 0), :meth:`SeqFloor.hurry` from a preemption drain (any thread but a
signal handler's).

**Never held back by a slower tier for long.** The first tier is listed once per engine, on the
commit path (rank 0 always, other ranks when listing it is cheap): the commit is made there
anyway. On rank 0 the later tiers (S3) are listed once on a thread of their own
(``tierckpt-seq-floor``, started by the first save), so that a checkpoint committed on a fresh
first tier is still numbered after what S3 holds. The first commit waits for that listing at most
:data:`LATER_FLOOR_GRACE_S` seconds, and not at all once a drain started; a commit numbered
without it is logged, and the listing, when it comes, raises the floor of every later commit.
"""

from __future__ import annotations

import logging
import threading

from ..catalog.listing import max_seq
from ..tiers import Chain
from ..tiers.base import Tier

__all__ = ["LATER_FLOOR_GRACE_S", "SeqFloor"]

log = logging.getLogger("tierckpt")

LATER_FLOOR_GRACE_S = 2.0  # the most the first commit waits for the later tiers' commit order (rank 0)


class SeqFloor:
    """The highest commit seq seen on ``chain``'s tiers by this rank (see the module docstring)."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self._floor: int | None = None  # highest commit seq seen on the tiers
        self._lock = threading.Lock()
        self._later: int | None = None  # the later tiers' highest seq, once listed (rank 0)
        self._later_started = False
        self._later_ready = threading.Event()  # the later tiers were listed, or a drain hurries the commits

    def floor(self, rank: int) -> int:
        """The highest commit seq this rank can see (the commit thread)."""
        if rank == 0 and self._floor is None and len(self.chain) > 1:
            self.start_later()
            if not self._later_ready.wait(LATER_FLOOR_GRACE_S):
                later = ", ".join(self.chain.names[1:])
                log.warning(
                    "%s did not answer within %.0f s, so this checkpoint is numbered from what %s holds alone; nothing "
                    "to do: the checkpoint is committed, and %s's answer is used from the next checkpoint on",
                    later,
                    LATER_FLOOR_GRACE_S,
                    self.chain.names[0],
                    later,
                )
        with self._lock:
            if self._floor is None:
                floor = 0
                first = self.chain.first
                if rank == 0 or first.cheap_listing:
                    floor = _listed_seq(first)
                self._floor = max(floor, self._later or 0)
            return self._floor

    def note(self, seq: int) -> None:
        """``seq`` was committed (the commit thread)."""
        with self._lock:
            self._floor = max(self._floor or 0, seq)

    def hurry(self) -> None:
        """A preemption drain started: :meth:`floor` waits for the later tiers no more."""
        self._later_ready.set()

    def start_later(self) -> None:
        """List the later tiers' commit order once, on the ``tierckpt-seq-floor`` thread (rank 0)."""
        with self._lock:
            if self._later_started or len(self.chain) < 2:
                return
            self._later_started = True
        threading.Thread(target=self._list_later, name="tierckpt-seq-floor", daemon=True).start()

    def _list_later(self) -> None:
        floor = max((_listed_seq(self.chain[i]) for i in range(1, len(self.chain))), default=0)
        with self._lock:
            self._later = floor
            if self._floor is not None:
                self._floor = max(self._floor, floor)
        self._later_ready.set()


def _listed_seq(tier: Tier) -> int:
    """``max_seq(tier)``; 0 (logged) when the tier cannot be listed."""
    try:
        return max_seq(tier)
    except Exception as e:  # noqa: BLE001 - numbering goes on from what is known
        log.warning(
            "cannot list the checkpoints on %s to number the next one after them; numbering from what the "
            "other tiers hold: %s",
            tier.url,
            e,
        )
        return 0
