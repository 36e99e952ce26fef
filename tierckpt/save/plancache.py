"""Plan reuse across restarts: DCP's plan cache, persisted on the local tier and put back into
the DCP plan cache of a new process when every rank still holds the same plans.

With ``DefaultSavePlanner(enable_plan_caching=True)`` DCP caches, per process and planner class,
each rank's local plan and final plan and, on the coordinator, every rank's local and global
plan and the global metadata. A restarted job starts with an empty cache, so its first save
pays for DCP's whole planning. tierckpt keeps those entries:

* **Persist** (background, after a save *committed*, only when the cached plans changed): every
  process writes ``_plans/g<global rank>.json`` on its local tier: its own local and final
  plan, their SHA-256 hashes and, on the coordinator, every rank's plans, their hashes and the
  metadata. JSON, never pickle; the file carries a SHA-256 of its body.
* **Seed** (the first save of a process, in ``set_up_storage_writer``, before DCP plans): the
  ranks agree through the process group's store. Each publishes the hashes of the plans it
  holds; the coordinator compares them with the hashes in its own file and answers yes only if
  every rank holds exactly the plans it holds for them, for the same planner class, world size
  and torch version. Only then every process puts its entries into DCP's cache (a rank never
  seeds unless the coordinator does, so DCP never gets an empty plan it cannot resolve).

DCP then compares the state's fresh local plan with the seeded one, as it does for any cached
plan: an unchanged model sends an empty plan and the save costs what a cached save costs; a
rank whose keys or shapes changed sends its full plan and DCP re-plans. DCP's comparison ignores
dtypes: ``TieredWriter.write_data`` checks every tensor's shape and dtype against its layout and
the metadata records the tensors' real dtypes (see :mod:`tierckpt.planning`), so a changed
model never reuses a stale layout.

Files are read in the background when a ``TieredWriter`` is created (:func:`preload`). The JSON
codec of plans and metadata is :mod:`tierckpt.dcpjson`'s (re-exported here: ``encode_plan``,
``decode_plan``, ``encode_metadata``, ``decode_metadata``, ``plan_hash``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ..errors import CheckpointNotFound
from ..format.dcpjson import decode_metadata, decode_plan, encode_metadata, encode_plan, plan_hash
from ..tiers.base import Tier
from .planfile import PLAN_DIR, PersistedPlans, Snapshot, from_bytes, plan_key, to_bytes

__all__ = [
    "PLAN_DIR",
    "PersistedPlans",
    "encode_plan",
    "decode_plan",
    "encode_metadata",
    "decode_metadata",
    "plan_hash",
    "preload",
    "seed",
    "status",
    "Persister",
]

log = logging.getLogger("tierckpt")

_CACHES = (
    "_cached_save_plan",
    "_cached_final_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
)
AGREE_TIMEOUT = 60.0  # seconds the first save of a process waits for the other ranks' answers


def dcp_caches() -> dict[str, dict] | None:
    """DCP's class-level plan caches, or None if this torch has no (such) plan caching."""
    out = {}
    for name in _CACHES:
        cache = getattr(SavePlanner, name, None)
        if not isinstance(cache, dict):
            return None
        out[name] = cache
    return out


# -- what a process persists -------------------------------------------------------------------

# -- persisting (background) ---------------------------------------------------------------------


def snapshot(
    planner: Any, final: SavePlan, world: int, rank: int, global_rank: int, coord_global: int
) -> Snapshot | None:
    """This rank's cached DCP plans of the save in progress, or None (no plan caching)."""
    caches = dcp_caches()
    key = getattr(planner, "_cached_plans_key", None)
    if caches is None or not isinstance(key, str) or not getattr(planner, "_enable_plan_caching", False):
        return None
    local = caches["_cached_save_plan"].get(key)
    if local is None or caches["_cached_final_save_plan"].get(key) is not final:
        return None
    return Snapshot(key, world, rank, global_rank, coord_global, local, final)


def add_coordinator(snap: Snapshot, members: list[int]) -> None:
    """The coordinator's part of ``snap``: every rank's cached plans and the metadata."""
    caches = dcp_caches()
    if caches is None:
        return
    snap.all_plans = caches["_cached_all_plans"].get(snap.key)
    snap.global_plans = caches["_cached_global_plan"].get(snap.key)
    snap.metadata = caches["_cached_metadata"].get(snap.key)
    snap.members = members
    if (
        snap.all_plans is None
        or snap.global_plans is None
        or snap.metadata is None
        or not (len(snap.all_plans) == len(snap.global_plans) == len(members) == snap.world)
    ):
        snap.all_plans = snap.global_plans = snap.metadata = snap.members = None


class Persister:
    """Writes a process's snapshot to its local tier after the save committed, when it changed.

    One per local tier root; :meth:`after_commit` is called on the saving thread and returns at
    once; the encoding and the write run on a background thread.
    """

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self._last: tuple | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0

    def after_commit(self, committed: Future, snap: Snapshot, coordinator: bool) -> None:
        if coordinator and snap.all_plans is None:
            return  # a coordinator without its part would leave the others' files unanswerable
        with self._lock:
            if snap.ident() in (self._last, _status.ident):
                return
            self._pending += 1

        def done(f: Future) -> None:
            if f.cancelled() or f.exception() is not None:
                self._finished()
                return
            threading.Thread(target=self._write, args=(snap,), name="tierckpt-plans", daemon=True).start()

        committed.add_done_callback(done)

    def _finished(self) -> None:
        with self._lock:
            self._pending -= 1
            self._idle.notify_all()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every scheduled write is done (``TieredWriter.wait`` calls it)."""
        with self._lock:
            self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _write(self, snap: Snapshot) -> None:
        try:
            self._write_now(snap)
        finally:
            self._finished()

    def _write_now(self, snap: Snapshot) -> None:
        try:
            with self._lock:
                if snap.ident() == self._last:
                    return
            self.tier.put(plan_key(snap.global_rank), to_bytes(snap))
            with self._lock:
                self._last = snap.ident()
        except TypeError as e:  # plans this codec does not know (custom planner data): not persisted
            log.debug("plan cache not persisted: %s", e)
        except Exception as e:  # noqa: BLE001 - an optimisation only: never fail a save for it
            log.warning("could not persist the plan cache to %s: %s", self.tier.url, e)


# -- reading and seeding (first save of a process) -------------------------------------------------

_preloads: dict[tuple[str, int], Future] = {}
_preloads_lock = threading.Lock()


def _load(tier: Tier, global_rank: int) -> PersistedPlans | None:
    key = plan_key(global_rank)
    try:
        raw = tier.get(key)
    except CheckpointNotFound:
        return None
    p = from_bytes(raw, f"{tier.url}/{key}")
    if p.global_rank != global_rank or p.torch_version != torch.__version__:
        return None
    return p


def preload(tier: Tier, global_rank: int) -> Future:
    """Start reading this process's persisted plans in the background (once per tier and rank).
    The future holds the :class:`PersistedPlans`, or None (none, unreadable or stale)."""
    k = (tier.url, global_rank)
    with _preloads_lock:
        fut = _preloads.get(k)
        if fut is not None:
            return fut
        fut = _preloads[k] = Future()

    def run() -> None:
        try:
            fut.set_result(_load(tier, global_rank))
        except Exception as e:  # noqa: BLE001 - a bad file only costs the reuse
            log.warning("ignoring the persisted plan cache of rank %d: %s", global_rank, e)
            fut.set_result(None)

    threading.Thread(target=run, name="tierckpt-plan-preload", daemon=True).start()
    return fut


@dataclass
class SeedStatus:
    """What the first save of this process did about persisted plans (for logs and tests)."""

    attempted: bool = False
    seeded: bool = False
    reason: str = ""
    channel: str | None = None  # the plan channel the coordinator opened with its answer
    ident: tuple | None = None  # Snapshot.ident() of the seeded plans (already on disk: not persisted again)


_status = SeedStatus()
_seed_lock = threading.Lock()


def status() -> SeedStatus:
    return _status


def _seed_caches(p: PersistedPlans) -> None:
    caches = dcp_caches()
    assert caches is not None
    _status.ident = (
        p.key,
        p.world,
        p.rank,
        id(p.local),
        id(p.final),
        id(p.all_plans),
        id(p.global_plans),
        id(p.metadata),
    )
    caches["_cached_save_plan"][p.key] = p.local
    caches["_cached_final_save_plan"][p.key] = p.final
    if p.is_coordinator:
        caches["_cached_all_plans"][p.key] = p.all_plans
        caches["_cached_global_plan"][p.key] = p.global_plans
        caches["_cached_metadata"][p.key] = p.metadata


def _wait(channel: Any, key: str, timeout: float) -> bytes | None:
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        v = channel.try_get(key)
        if v is not None or time.monotonic() > deadline:
            return v
        time.sleep(delay)
        delay = min(delay * 1.5, 0.02)


def seed(
    tier: Tier | None,
    channel: Any,
    *,
    distributed: bool,
    is_coordinator: bool,
    global_rank: int,
    world: int,
    timeout: float = AGREE_TIMEOUT,
) -> SeedStatus:
    """Once per process, before DCP's first planning: agree with the other ranks and seed DCP's
    plan cache from the persisted plans, or leave it empty. Every rank of the save must call it
    (``TieredWriter.set_up_storage_writer`` does). ``channel`` is the store channel (distributed)."""
    global _status
    with _seed_lock:
        if _status.attempted:
            return _status
        _status = SeedStatus(attempted=True)
        caches = dcp_caches()
        p: PersistedPlans | None = None
        if tier is not None and caches is not None:
            try:
                p = preload(tier, global_rank).result()
            except Exception:  # noqa: BLE001
                p = None
        if p is not None and any(p.key in c for c in caches.values()):  # type: ignore[union-attr]
            p = None  # this process already has live plans: never overwrite them
        if not distributed:
            if p is not None and p.world == 1 and p.is_coordinator:
                _seed_caches(p)
                _status.seeded, _status.reason = True, "single rank"
            else:
                _status.reason = "no usable persisted plans"
            return _status
        me = f"tierckpt/seed/g{global_rank}"
        mine = {"coord": is_coordinator, "key": p.key if p else None, "h": [p.h_local, p.h_final] if p else None}
        channel.publish(me, json.dumps(mine).encode())
        if is_coordinator:
            answer: dict = {"ok": False}
            if p is None or not p.is_coordinator:
                _status.reason = "the coordinator has no usable persisted plans"
            elif p.world != world:
                _status.reason = f"world size {world}, persisted plans for {p.world}"
            else:
                bad = []
                assert p.members is not None and p.hashes is not None
                for r, g in enumerate(p.members):
                    if g == global_rank:
                        other: dict | None = mine
                    else:
                        raw = _wait(channel, f"tierckpt/seed/g{g}", timeout)
                        other = json.loads(raw) if raw is not None else None
                    if other is None or other.get("key") != p.key or other.get("h") != p.hashes[r]:
                        bad.append(r)
                if bad:
                    _status.reason = f"rank(s) {bad[:8]} hold other plans than the coordinator persisted"
                else:
                    answer = {"ok": True, "channel": uuid.uuid4().hex[:16]}
            channel.publish(f"{me}/decision", json.dumps(answer).encode())
            if answer["ok"]:
                _seed_caches(p)  # type: ignore[arg-type]
                _status.seeded, _status.reason, _status.channel = True, "all ranks agree", answer["channel"]
            return _status
        if p is None:
            _status.reason = "no usable persisted plans"
            return _status
        coord = f"tierckpt/seed/g{p.coord_global}"
        raw = _wait(channel, coord, timeout)
        if raw is None or not json.loads(raw).get("coord"):
            _status.reason = f"rank {p.coord_global} is not the coordinator now"
            return _status
        raw = _wait(channel, f"{coord}/decision", timeout)
        answer = json.loads(raw) if raw is not None else {"ok": False}
        if answer.get("ok"):
            _seed_caches(p)
            _status.seeded, _status.reason, _status.channel = True, "all ranks agree", str(answer["channel"])
        else:
            _status.reason = "the coordinator declined"
        return _status


def reset_for_tests() -> None:
    """Forget this process's seeding attempt and preloads (tests only)."""
    global _status
    with _seed_lock:
        _status = SeedStatus()
    with _preloads_lock:
        _preloads.clear()
