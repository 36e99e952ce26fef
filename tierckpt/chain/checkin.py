"""Check-ins: before a collective of DCP, every rank of its group announces itself on the job's
store, so that a rank that died or hung before it is named by every other rank within ``[job]
commit_timeout`` (instead of DCP's collective failing with gloo's ``Connection closed by peer
[address]``, which names no rank). Three points use it (:func:`check_in`, each with ids of its
own, so their keys never meet):

* a save, before DCP gathers the plans (``tierckpt.save.assign``: the checkpoint id);
* a distributed load, before the ranks' agreement on the checkpoint, the load's first collective
  (``tierckpt.load.resolve``: ``load:`` and the requested id, in the ``load/`` namespace);
* a distributed load, at the end of ``read_data``, before DCP's gather of the reads
  (``tierckpt.load.reader``: ``read:`` and the agreement's token for this load): a rank that died
  while reading or serving files to other nodes is named.

The save's check-in runs at the end of ``TieredWriter.prepare_local_plan``. The keys of one check-in
live under ``tierckpt/checkin/<h>/``, ``h`` a hash of the group's name (``load/<name>`` for a
load's) and the id, so every rank names them without talking to the others:

1. The coordinator sets the group's ``coord`` key to its id; every other rank sets ``in<r>``.
2. The coordinator waits for every ``in<r>`` in one store ``wait`` (bounded by the commit timeout),
   then publishes the verdict ``v``: ``OK``, or ``E`` with the ranks whose key is missing (found by
   bisecting the keys with ``check``: O(m log N) calls for m missing ranks, on the coordinator only).
3. Every other rank waits for ``v`` (the commit timeout plus :data:`GRACE`), deletes its ``in<r>``
   and counts itself under ``read``; the last reader deletes ``v`` and ``read``, before it reaches
   DCP's collective, so before any rank can start another save (a retry under the same id finds no
   stale verdict).

A rank still waiting after a second reads ``coord`` (then after 2, 4 ... 30 s): if the coordinator
checks in for another id than this rank's (and than this rank's previous one), the ranks passed
different ids; this rank then takes part in the coordinator's check-in instead, and DCP's gather
that follows carries the coordinator's "ranks passed different checkpoint ids" to every rank.

Store operations per check-in (a save has one, a distributed load two): a rank other than the
coordinator 5 when ``v`` is already there (set, check, get, delete, add), else 7 (a check that finds nothing and the store's ``wait`` before the
check and get), and the verdict's last reader 2 more; the coordinator 5 (two deletes of what an
abnormal earlier attempt under this id may have left, its id, the wait, the verdict): about 7 per
rank, whatever the number of ranks (``tests/test_checkin.py`` pins them); a rank waiting longer
than a second 4 more per slice. Keys left in the store: the group's ``coord``. No collective.

Skipped (no wait, nothing on the store) when the save is not distributed, its group has one rank,
``dcp.save`` got no ``checkpoint_id`` (the ranks could not name the save's keys alike: the
coordinator picks the id later), or DCP's wrapper of the process group is not found on the stack
(the group's size is not known before DCP's gather: a guess could wait for ranks outside it).
A load's are skipped likewise: not distributed (no agreement: the first tier is shared, or one
rank), or no DCP wrapper on the stack (``resolve()`` called outside ``dcp.load``).
A rank whose planner raised before ``prepare_local_plan`` never checks in: the others name it after
the commit timeout, and DCP's gather that follows carries its error too, where DCP's own gather
alone raised it at once. So does gloo's error on a rank that died.
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

from ..errors import CheckInError
from .commit import GRACE, StoreChannel, grace, name_ranks
from .jobstore import JobStore

__all__ = ["GRACE", "Group", "dcp_group", "check_in", "grace", "prefix_of", "absent"]

log = logging.getLogger("tierckpt")


@dataclass(frozen=True)
class Group:
    """The process group of the ``dcp.save`` (or ``dcp.load``) in progress, as DCP's wrapper of it has it."""

    name: str
    world: int
    rank: int
    coordinator: int


def dcp_group(depth: int = 16) -> Group | None:
    """The group of the ``dcp.save`` or ``dcp.load`` calling this (DCP's ``_DistWrapper`` on the
    calling stack), or None where it is not found or not distributed."""
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
                gname = "default" if g is None else str(getattr(g, "group_name", "") or _ranks_of(g))
                return Group(gname, int(w.get_world_size()), int(w.rank), int(w.coordinator_rank))
        f = f.f_back
    return None


def _ranks_of(g: Any) -> str:
    """A name every rank gives the group ``g`` alike: its global ranks."""
    import torch.distributed as dist

    return "ranks:" + ",".join(map(str, dist.get_process_group_ranks(g)))


def _store() -> Any:
    return JobStore()


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
    """The store prefix of the check-in under id ``cid`` by the group named ``group_name``."""
    return "tierckpt/checkin/" + hashlib.sha256(f"{group_name}\0{cid}".encode()).hexdigest()[:16]


def _coord_key(group_name: str) -> str:
    """Where the coordinator of the group named ``group_name`` says which id it checks in for."""
    return "tierckpt/checkin/" + hashlib.sha256(group_name.encode()).hexdigest()[:16] + "/coord"


_prev: dict[str, str] = {}  # group name -> the id of this process's previous check-in in it


def check_in(
    cid: str, group: Group, timeout: float, what: str = "", before: str = "its planning"
) -> CheckInError | None:
    """Every rank of ``group``, at its check-in under id ``cid``: return once every rank of the
    group has checked in, or ``timeout`` seconds have passed: then return (never raise) a
    :class:`CheckInError` naming the ranks that did not, logged at ERROR level on this rank. The
    caller goes on into DCP's collective all the same: a rank that was only late (slower than the
    timeout, not dead) then still takes part and the save or load succeeds as it would have
    without the check-in; a dead rank makes that collective fail with gloo's error, which names
    none, after every rank logged who is missing. The errors start with ``what`` (default ``checkpoint <cid>:
    planning``, the save's) and say the missing ranks died, hung or failed ``before`` (what comes
    before the check-in). See the module docstring for the protocol."""
    if group.world < 2:
        return None
    prev, _prev[group.name] = _prev.get(group.name), cid
    what = what or f"checkpoint {cid}: planning"
    me = group.rank
    try:
        if me == group.coordinator:
            _coordinate(cid, group, timeout, what, before)
        else:
            _attend(cid, prev, group, timeout, what)
    except CheckInError as e:
        log.error("rank %d: %s", me, e)
        return e
    except Exception as e:  # noqa: BLE001 - the store failed under us
        err = CheckInError(
            f"{what}: the job's store failed on rank {me} ({type(e).__name__}: {str(e)[:200]}); "
            "was it hosted by a rank that died (torchrun's agent keeps it outside the ranks)?"
        )
        log.error("rank %d: %s", me, err)
        return err
    return None


def _coordinate(cid: str, group: Group, timeout: float, what: str, before: str) -> None:
    store = _store()
    prefix = prefix_of(group.name, cid)
    # What an attempt under this id that went wrong may have left (no reader of this one can be
    # counted yet: the verdict comes next).
    _delete(store, f"{prefix}/v")
    _delete(store, f"{prefix}/read")
    store.set(_coord_key(group.name), cid.encode())
    others = [r for r in range(group.world) if r != group.coordinator]
    keys = [f"{prefix}/in{r}" for r in others]
    missing: list[int] = []
    if not _wait_all(store, keys, timeout):
        missing = [others[i] for i in absent(store, keys)]
    if not missing:
        store.set(f"{prefix}/v", b"OK")
        return
    msg = (
        f"{what}: no report from {name_ranks(missing)} within {timeout:.0f} s "
        f"(dead, hung, or failed before {before}; every other rank reported)"
    )
    store.set(f"{prefix}/v", b"E" + json.dumps({"missing": missing, "error": msg}).encode())
    raise CheckInError(msg)


def _verdict(store: Any, cid: str, prev: str | None, group: Group, deadline: float) -> tuple[str, bytes | None]:
    """Check in and wait for the coordinator's verdict (None: none by ``deadline``); the prefix
    of the check-in taken part in. Waits in slices of 1, 2, 4 ... 30 s; after each, if the
    coordinator checks in for another id than this rank's (nor the one before), this rank takes
    part in that check-in instead: the ranks passed different ids, which the coordinator's
    ``prepare_global_plan`` then says, after DCP's gather (so no rank waits out the timeout)."""
    ch = StoreChannel(store)
    prefix = prefix_of(group.name, cid)
    store.set(f"{prefix}/in{group.rank}", b"1")
    step, quick, switched = 1.0, False, False
    while True:
        v = ch.try_get(f"{prefix}/v")
        if v is not None:
            return prefix, v
        if quick:
            time.sleep(0.05)  # a store whose wait returned at once without the key: do not spin
        left = deadline - time.monotonic()
        if left <= 0:
            return prefix, None
        t0 = time.monotonic()
        try:
            store.wait([f"{prefix}/v"], datetime.timedelta(seconds=min(step, left)))
            quick = time.monotonic() - t0 < 0.01
            continue
        except Exception:  # noqa: BLE001 - the slice ran out (a store gone: the next read tells)
            quick = False
        step = min(2 * step, 30.0)
        raw = None if switched else ch.try_get(_coord_key(group.name))
        other = raw.decode(errors="replace") if raw is not None else None
        if other is not None and other != cid and other != prev:
            switched = True
            log.debug(
                "rank %d checks in for %r, the coordinator for %r: taking part in its check-in", group.rank, cid, other
            )
            _delete(store, f"{prefix}/in{group.rank}")
            prefix = prefix_of(group.name, other)
            store.set(f"{prefix}/in{group.rank}", b"1")


def _attend(cid: str, prev: str | None, group: Group, timeout: float, what: str) -> None:
    store = _store()
    limit = timeout + grace(timeout)
    prefix, v = _verdict(store, cid, prev, group, time.monotonic() + limit)
    _delete(store, f"{prefix}/in{group.rank}")
    if v is None:
        raise CheckInError(
            f"{what}: no verdict on the check-in from the coordinator (rank {group.coordinator}: dead or hung?) "
            f"within {limit:.0f} s"
        )
    missing: list[int] = []
    error = ""
    if v != b"OK":
        d = json.loads(v[1:])
        missing, error = [int(r) for r in d["missing"]], str(d["error"])
        if group.rank in missing:  # this rank came after the coordinator gave up: it is no reader
            raise CheckInError(f"{error} (rank {group.rank} checked in after the coordinator gave up on it)")
    if store.add(f"{prefix}/read", 1) >= group.world - 1 - len(missing):
        _delete(store, f"{prefix}/v")
        _delete(store, f"{prefix}/read")
    if error:
        raise CheckInError(error)
