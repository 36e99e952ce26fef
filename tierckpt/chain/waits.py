"""Waiting for the engine's background work, and telling the user what failed.

:func:`drain` waits for the checkpoints in flight: committed on the first tier, then done with
each later tier waited for; at the exit path it gives up a tier that is down (:func:`drain`'s
``patient``). The rest of this module is the record of background failures.

A failure is either *lost* (capture, flush or the commit on the first tier failed: the checkpoint
is committed nowhere) or a *copy* that failed (the checkpoint is committed on the first tier and
owed to a later one: the hop's backlog, copied first by its next pass). The engine queues each as
a :class:`Failure`; ``wait`` and ``dcp.save`` take those that concern them (:func:`take`), and a
failed copy is told as what is committed where and what is pending (:func:`pending_text`,
:func:`copies_pending`), not as one more error.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..capture.ranksave import RankSave
from ..errors import CommitError, ConfigError, CopiesPending

__all__ = ["Failure", "take", "scope", "pending_text", "copies_pending", "id_order", "drain"]

_LISTED = 10
"""Checkpoint ids named per tier in a message (then "and N more")."""


@dataclass(eq=False)
class Failure:
    """One background failure queued for the next wait (compared by identity).

    ``owner``: a weak reference to the writer whose save failed, or None; ``tier``: None when the
    checkpoint is committed nowhere, else the name of the hop whose copy failed."""

    owner: Any
    exc: BaseException
    checkpoint: str
    tier: str | None

    def belongs(self, owner: Any) -> bool:
        """Whether a wait of ``owner`` (None: anyone's) reports it: its own, or a writer's that no
        longer exists (``dcp.save(..., storage_writer=TieredWriter(cfg))`` inline)."""
        o = self.owner
        return owner is None or o is None or o() is None or o() is owner


def take(errors: list[Failure], owner: Any, hops: set[str]) -> tuple[list[Failure], bool]:
    """Which of ``errors`` a wait of ``owner`` for the hops ``hops`` reports now, and whether they
    are lost checkpoints: every lost one that belongs to ``owner`` if there is any (a checkpoint
    committed nowhere concerns every tier; failed copies wait for the next wait), else its failed
    copies to ``hops``."""
    mine = [f for f in errors if f.belongs(owner)]
    lost = [f for f in mine if f.tier is None]
    if lost:
        return lost, True
    return [f for f in mine if f.tier in hops], False


def scope(tiers: str | Iterable[str] | None, first: str, later: list[str]) -> list[str]:
    """The later tiers (hop names, chain order) that ``wait(tiers=...)`` waits for: ``None`` or
    ``"all"``: every one; ``"first"`` or the first tier's name: none; else the names given.
    Raises :class:`~tierckpt.errors.ConfigError` (a :class:`ValueError`) for a name not in the chain."""
    if tiers is None:
        return list(later)
    names = [tiers] if isinstance(tiers, str) else list(tiers)
    known = {first, "first", "all", *later}
    bad = [n for n in names if n not in known]
    if bad:
        raise ConfigError(
            f"tiers={tiers!r}: no tier {bad[0]!r} in this chain (its tiers: {', '.join([first, *later])}; "
            "or 'first', 'all')"
        )
    if "all" in names:
        return list(later)
    return [h for h in later if h in names]


def id_order(cid: str) -> list:
    """Sort key of checkpoint ids: numbers in them compare as numbers (``step-9`` before ``step-10``)."""
    return [int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", cid))]


def _ids(ids: list[str]) -> str:
    more = f" and {len(ids) - _LISTED} more" if len(ids) > _LISTED else ""
    return ", ".join(ids[:_LISTED]) + more


def pending_text(first: str, pending: dict[str, list[str]], causes: dict[str, str]) -> str:
    """``pending`` (tier -> the checkpoint ids it lacks, all committed on ``first``) in words."""
    parts = []
    for tier, ids in pending.items():
        n = f"{len(ids)} checkpoint{'s' if len(ids) != 1 else ''}"
        cause = f" (last error: {causes[tier]})" if tier in causes else ""
        parts.append(f"committed on {first}, pending on {tier}: {_ids(ids)} ({n}){cause}")
    return "; ".join(parts)


def copies_pending(first: str, pending: dict[str, list[str]], copies: list[Failure]) -> CopiesPending:
    """The error ``wait()`` raises for failed copies still owed (``copies``: their failures, oldest
    first; the last one is its ``__cause__``)."""
    causes: dict[str, str] = {}
    for f in copies:
        assert f.tier is not None
        causes[f.tier] = f"{type(f.exc).__name__}: {f.exc}"
    err = CopiesPending(
        f"not every checkpoint reached every tier: {pending_text(first, pending, causes)}. They stay loadable from "
        f"{first}; the next save, or the next job with this configuration, copies them first "
        "(`tierckpt-restore list` shows the tiers of each checkpoint)",
        committed_on=first,
        pending=pending,
        causes=causes,
    )
    err.__cause__ = copies[-1].exc
    return err


_POLL_S = 0.05
"""How often a wait that may give up (a job settled, a tier down) checks for it."""


def drain(
    jobs: list[RankSave],
    hops: list[Any],
    *,
    every: bool,
    retired: Callable[[RankSave], bool],
    timeout: float | None,
    patient: bool,
    first: str,
) -> None:
    """Block until each of ``jobs`` is committed on the first tier (or failed there) and each of
    ``hops`` (:class:`~.replicate.Replicator`, chain order) is done with it; ``every`` (all the
    engine's hops): until it is settled too (its history record written). A job ``retired`` by the
    engine is done. Not ``patient`` (the exit path): a hop whose copy failed since the drain began
    is given up (it is down; what it lacks stays owed), so an unreachable tier costs one attempt,
    bounded by its retries. Raises :class:`CommitError` after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    tried = {h.name: h.tried for h in hops}

    def down(h: Any) -> bool:
        return not patient and h.tried > tried[h.name] and h.failing is not None

    def gone(j: RankSave, h: Any) -> bool:
        return retired(j) or down(h)

    behind = ""  # what the wait is on now, in words (the timeout names it)
    try:
        for h in hops:  # a backlog replicated at start is part of "everything done"
            behind = f"{h.name} is behind: it is still checking for checkpoints an earlier run did not copy there"
            _await(h.started.wait, deadline, partial(down, h))
        for i, j in enumerate(jobs):
            later = [k.id for k in jobs[i + 1 :]]
            rest = f" (then {_ids(later)})" if later else ""
            behind = f"{first} is behind: {j.id} is not committed there yet{rest}"
            _await(partial(_settled, j.committed), deadline)
            if j.committed.exception() is not None:
                continue  # committed nowhere: no hop sees it
            for h in hops:
                behind = f"{h.name} is behind: {j.id} is committed on {first}, still being copied to {h.name}{rest}"
                _await(j.hop_done(h.name).wait, deadline, partial(gone, j, h))
            if every and patient:
                behind = f"{j.id} is on every tier; its retention and history are not done yet{rest}"
                _await(partial(_settled, j.replicated), deadline)
    except TimeoutError:
        raise CommitError(f"checkpoints in flight after {timeout} s: {behind}") from None


def _settled(fut: Future, timeout: float | None) -> bool:
    """Whether ``fut`` is done within ``timeout`` seconds (``Event.wait``'s contract)."""
    return bool(futures_wait([fut], timeout).done)


def _await(
    done: Callable[[float | None], bool], deadline: float | None, give_up: Callable[[], bool] | None = None
) -> None:
    """Call ``done(timeout)`` (like ``Event.wait``) until it returns True or ``give_up()`` does;
    :class:`TimeoutError` once ``deadline`` (monotonic) passed."""
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError
        step = left if give_up is None else (_POLL_S if left is None else min(_POLL_S, left))
        if done(step):
            return
        if give_up is not None and give_up():
            return
