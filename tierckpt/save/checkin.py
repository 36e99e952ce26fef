"""The save's check-in: before DCP gathers the plans of a ``dcp.save``, every rank of its group
announces itself on the job's store, so that a rank that died or hung in planning is named by
every other rank within ``[job] commit_timeout`` (instead of DCP's gather failing with gloo's
``Connection closed by peer [address]``, which names no rank).

Run at the end of ``TieredWriter.prepare_local_plan`` (:func:`check_in`). The keys of one save live
under ``tierckpt/checkin/<h>/``, ``h`` a hash of the process group's name and the checkpoint id, so
every rank names them without talking to the others:

1. Every rank but the coordinator sets ``in<r>``.
2. The coordinator waits for every ``in<r>`` in one store ``wait`` (bounded by the commit timeout),
   then publishes the verdict ``v``: ``OK``, or ``E`` with the ranks whose key is missing (found by
   bisecting the keys with ``check``: O(m log N) calls for m missing ranks, on the coordinator only).
3. Every other rank waits for ``v`` (the commit timeout plus :data:`GRACE`), deletes its ``in<r>``
   and counts itself under ``read``; the last reader deletes ``v`` and ``read``, before it reaches
   DCP's gather, so before any rank can start another save (a retry under the same id finds no
   stale verdict).

Store operations per save: a rank other than the coordinator 5 when ``v`` is already there (set,
check, get, delete, add), else 7 (a check that finds nothing and the store's ``wait`` before the
check and get), and the verdict's last reader 2 more; the coordinator 4 (two deletes of what an
abnormal earlier attempt under this id may have left, the wait, the verdict): about 7 per rank,
whatever the number of ranks (``tests/test_checkin.py`` pins them). No collective.

Skipped (no wait, nothing on the store) when the save is not distributed, its group has one rank,
``dcp.save`` got no ``checkpoint_id`` (the ranks could not name the save's keys alike: the
coordinator picks the id later), or DCP's wrapper of the process group is not found on the stack
(the group's size is not known before DCP's gather: a guess could wait for ranks outside it).
A rank whose planner raised before ``prepare_local_plan`` never checks in: the others name it after
the commit timeout, and DCP's gather that follows carries its error too. Ranks that passed different
checkpoint ids wait under different keys: the coordinator names the ranks whose id differs from its
own as missing (DCP calls no ``prepare_global_plan``, which would have said the ids differ). In both
cases the error comes after the timeout, where DCP's own gather alone raised it at once; so does
gloo's error on a rank that died.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import sys
import time
import types
from dataclasses import dataclass
from typing import Any

from ..chain.commit import StoreChannel, name_ranks
from ..errors import CheckInError, CommitError

__all__ = ["GRACE", "Group", "dcp_group", "check_in", "prefix_of", "absent"]

log = logging.getLogger("tierckpt")

GRACE = 30.0
"""Seconds a rank waits for the coordinator's verdict beyond the commit timeout (the coordinator
waits the commit timeout from its own arrival, which may be later)."""


@dataclass(frozen=True)
class Group:
    """The process group of the ``dcp.save`` in progress, as DCP's wrapper of it has it."""

    name: str
    world: int
    rank: int
    coordinator: int


def dcp_group(depth: int = 16) -> Group | None:
    """The group of the ``dcp.save`` calling this (DCP's ``_DistWrapper`` on the calling stack), or
    None where it is not found or not distributed."""
    try:
        from torch.distributed.checkpoint.utils import _DistWrapper
    except ImportError:
        return None
    f: types.FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return None
        for name in ("self", "distW"):
            w = f.f_locals.get(name)
            if isinstance(w, _DistWrapper):
                if not w.use_dist:
                    return None
                g = w.group
                gname = "default" if g is None else str(getattr(g, "group_name", "") or id(g))
                return Group(gname, int(w.get_world_size()), int(w.rank), int(w.coordinator_rank))
        f = f.f_back
    return None


def _store() -> Any:
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def absent(store: Any, keys: list[str]) -> list[int]:
    """The indices of ``keys`` absent from ``store``, by bisection with ``check`` (which answers for
    a whole list): O(m log n) calls for m absent keys among n, one when none is."""
    out: list[int] = []
    todo = [(0, len(keys))]
    while todo:
        lo, hi = todo.pop()
        if hi <= lo or store.check(keys[lo:hi]):
            continue
        if hi - lo == 1:
            out.append(lo)
            continue
        mid = (lo + hi) // 2
        todo += [(mid, hi), (lo, mid)]
    return sorted(out)


def _delete(store: Any, key: str) -> None:
    """One ``delete_key`` (the check-in's values are never split into parts)."""
    try:
        store.delete_key(key)
    except Exception as e:  # noqa: BLE001 - some stores cannot delete; the keys are small
        log.debug("cannot delete %s from the store: %s", key, e)


def _wait_all(store: Any, keys: list[str], timeout: float) -> bool:
    """Whether every key of ``keys`` was set within ``timeout`` seconds: one store ``wait`` (woken
    when the last is set) in the common case. Raises what a store that is gone raises."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        t0 = time.monotonic()
        try:
            store.wait(keys, datetime.timedelta(seconds=left))
            return True
        except Exception:  # noqa: BLE001 - timed out (DistStoreError), or a store gone: check tells
            if store.check(keys):
                return True
        if time.monotonic() - t0 < 0.01:
            time.sleep(0.05)  # a store whose wait returns at once: do not spin


def prefix_of(group_name: str, cid: str) -> str:
    """The store prefix of the check-in of the save of ``cid`` by the group named ``group_name``."""
    return "tierckpt/checkin/" + hashlib.sha256(f"{group_name}\0{cid}".encode()).hexdigest()[:16]


def check_in(cid: str, group: Group, timeout: float) -> None:
    """Every rank of ``group``, in ``prepare_local_plan`` of the save of ``cid``: return once every
    rank of the group has checked in; raise :class:`CheckInError` naming the ranks that did not
    within ``timeout`` seconds (logged too: DCP's gather that follows fails on a dead rank with an
    error that names none). See the module docstring for the protocol."""
    if group.world < 2:
        return
    prefix = prefix_of(group.name, cid)
    what = f"checkpoint {cid}: planning"
    c, me = group.coordinator, group.rank
    try:
        if me == c:
            _coordinate(prefix, group, timeout, what)
        else:
            _attend(prefix, group, timeout, what)
    except CheckInError as e:
        log.error("rank %d: %s", me, e)
        raise
    except Exception as e:  # noqa: BLE001 - the store failed under us
        err = CheckInError(
            f"{what}: the job's store failed on rank {me} ({type(e).__name__}: {str(e)[:200]}); "
            "was it hosted by a rank that died (torchrun's agent keeps it outside the ranks)?"
        )
        log.error("rank %d: %s", me, err)
        raise err from e


def _coordinate(prefix: str, group: Group, timeout: float, what: str) -> None:
    store = _store()
    ch = StoreChannel(store)
    # What an attempt under this id that went wrong may have left (no reader of this one can be
    # counted yet: the verdict comes next).
    _delete(store, f"{prefix}/v")
    _delete(store, f"{prefix}/read")
    others = [r for r in range(group.world) if r != group.coordinator]
    keys = [f"{prefix}/in{r}" for r in others]
    missing: list[int] = []
    if not _wait_all(store, keys, timeout):
        missing = [others[i] for i in absent(store, keys)]
    if not missing:
        ch.publish(f"{prefix}/v", b"OK")
        return
    msg = (
        f"{what}: no report from {name_ranks(missing)} within {timeout:.0f} s "
        "(dead, hung, or failed before its planning; every other rank reported)"
    )
    ch.publish(f"{prefix}/v", b"E" + json.dumps({"missing": missing, "error": msg}).encode())
    raise CheckInError(msg)


def _attend(prefix: str, group: Group, timeout: float, what: str) -> None:
    store = _store()
    ch = StoreChannel(store)
    mine = f"{prefix}/in{group.rank}"
    ch.publish(mine, b"1")
    limit = timeout + GRACE
    try:
        v = ch.wait_get(f"{prefix}/v", limit, what)
    except CommitError:
        _delete(store, mine)
        raise CheckInError(
            f"{what}: no verdict on the check-in from the coordinator (rank {group.coordinator}: dead or hung?) "
            f"within {limit:.0f} s"
        ) from None
    _delete(store, mine)
    missing: list[int] = []
    error = ""
    if v != b"OK":
        d = json.loads(v[1:])
        missing, error = [int(r) for r in d["missing"]], str(d["error"])
        if group.rank in missing:  # this rank came after the coordinator gave up: it is no reader
            raise CheckInError(f"{error} (rank {group.rank} checked in after the coordinator gave up on it)")
    if ch.add(f"{prefix}/read", 1) >= group.world - 1 - len(missing):
        _delete(store, f"{prefix}/v")
        _delete(store, f"{prefix}/read")
    if error:
        raise CheckInError(error)
