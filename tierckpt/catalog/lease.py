"""Leases: who is using a checkpoint on a tier right now, so that no deletion pulls it from under them.

A *lease* is a small object ``_leases/ID/<kind>-<uuid>.json`` on the tier that holds the
checkpoint, written by whoever reads it (a load, ``fetch``, ``verify``, ``consolidate``) or is
still writing it (a save in flight), renewed by one background thread per process while held,
deleted on release, and considered dead once its ``expires`` time has passed (its holder died).
``_leases`` cannot be a checkpoint id (ids start with a letter or digit), so listings of
checkpoints never see these objects.

A deletion (retention, ``gc``) runs this protocol for each checkpoint it wants to remove, after
it listed the checkpoint's objects:

1. if a live lease exists: skip the checkpoint (and log it);
2. write a *tombstone* ``_leases/ID/tomb-<uuid>.json`` (a deletion intent, with an expiry);
3. list the leases again: if a live one appeared, remove the tombstone and skip;
4. delete the metadata (the checkpoint stops being committed), then the listed data objects,
   then the tombstone.

A deletion that dies between 2 and 4 (a crashed or killed ``gc`` on another host) leaves its
tombstone: the checkpoint stays committed but cannot be loaded from that tier until the
tombstone expires (:data:`TOMB_TTL`; at once when the deleter ran on this host and is gone).
``latest`` skips such a copy (:func:`live_tomb`), a reader gets
:class:`~tierckpt.errors.CheckpointBeingDeleted` (also a ``CorruptCheckpoint``: a resume loop
falls back to the next older checkpoint), and ``tierckpt.list_checkpoints`` shows it
(``Checkpoint.deleting``).

A reader does the mirror image: write its lease, then check for a live tombstone, then that the
checkpoint is still committed (a HEAD of its metadata, or a GET of the whole metadata when the
reader needs it anyway: ``acquire(read_metadata=size)``, which a load's coordinator uses). Both
sides write before they look, so at least one of them sees the other (local file systems and S3
are read-after-write consistent): either the reader backs off before reading a byte, or the
deleter leaves the checkpoint alone. The order of the reader's two looks matters: a deletion
that missed the lease removes the metadata before its tombstone, so a reader that finds no
tombstone and then the metadata knows no such deletion was under way when it looked.

A *writer* (a save into its first tier, a hop copying into the next tier) does the same with
:func:`acquire_for_write`, before its first object of the checkpoint on that tier, and holds the
lease until the checkpoint is committed there. If it finds a live tombstone, the deletion may
not have seen its lease and may still remove what it listed, so the writer waits until the
tombstone is gone (that deletion is over, before the writer's first object) or gives up. So a
commit and a deletion of the same id never both go ahead: the deleter skips a checkpoint whose
writer's lease it sees, and a writer whose lease a deletion might have missed starts only once
that deletion is done. The lease must also stay visible: a lease whose renewal came too late
(:attr:`Lease.lapsed`: its holder stalled for most of :data:`LEASE_TTL`) may have been judged
dead, so the save checks it before it reports its file good and before its metadata is written,
and fails cleanly if it lapsed.

Lease expiry uses the holder's wall clock, compared with the deleter's: keep clocks within a
fraction of :data:`LEASE_TTL` (NTP does). A lease whose holder ran on the same host and no longer
exists is dead at once (a killed job's leftovers are cleaned by the next commit). Leases never
decide the *order* of checkpoints.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable

from ..errors import CheckpointBeingDeleted, CheckpointNotFound, CorruptCheckpoint, TierAccessDenied, TierckptError
from ..format.layout import check_checkpoint_id, metadata_key
from ..tiers.base import Tier
from .leaseinfo import (
    LEASE_PREFIX,
    LEASE_TTL,
    TOMB_TTL,
    LeaseInfo,
    _body,
    _key,
    _let_go,
    _parse,
    list_leases,
    owner,
)
from .renewer import Renewer

__all__ = [
    "LEASE_PREFIX",
    "LEASE_TTL",
    "Lease",
    "LeaseInfo",
    "live_leases",
    "acquire",
    "acquire_for_write",
    "guarded_delete",
    "held_here",
    "owner",
    "wait_released_here",
    "live_tomb",
    "live_tombs",
    "CheckpointBeingDeleted",
]

log = logging.getLogger("tierckpt.lease")

RENEW_EVERY = LEASE_TTL / 4
TOMB_WAIT = 60.0  # how long a writer waits at most for a deletion of the same id to finish


def live_leases(
    tier: Tier, checkpoint_id: str | None = None, *, exclude: Iterable[str] = ()
) -> dict[str, list[LeaseInfo]]:
    """Live leases (not tombstones) per checkpoint id on ``tier``. ``exclude``: lease keys to ignore
    (the caller's own). Expired leases and tombstones are removed on the way (best effort)."""
    now = time.time()
    skip = set(exclude)
    out: dict[str, list[LeaseInfo]] = {}
    for li in list_leases(tier, checkpoint_id):
        if li.key in skip:
            continue
        if not li.live(now):
            _forget(tier, li.key)
            continue
        if li.kind != "tomb":
            out.setdefault(li.checkpoint_id, []).append(li)
    return out


def _live_tombs(tier: Tier, checkpoint_id: str, exclude: str = "") -> list[LeaseInfo]:
    """Live tombstones of ``checkpoint_id``: one listing, and a read of each tombstone only (not of
    every lease: many ranks may hold one)."""
    return [li for li in _tombs(tier, f"{LEASE_PREFIX}/{check_checkpoint_id(checkpoint_id)}/") if li.key != exclude]


def _tombs(tier: Tier, prefix: str) -> list[LeaseInfo]:
    now = time.time()
    out = []
    for info in list(tier.list(prefix)):
        if not info.key.rsplit("/", 1)[-1].startswith("tomb-"):
            continue
        li = _parse(tier, info.key, info.size, info.mtime)
        if li is not None and li.kind == "tomb" and li.live(now):
            out.append(li)
    return out


def live_tomb(tier: Tier, checkpoint_id: str) -> LeaseInfo | None:
    """A live tombstone of ``checkpoint_id`` on ``tier``, or None: a deletion runs there, or one
    crashed and its tombstone has not expired (:data:`TOMB_TTL` after it was written; at once
    when its process ran on this host and is gone). Such a copy cannot be loaded: ``latest``
    skips it. One listing of the checkpoint's leases, one read per tombstone; the tier's errors
    propagate."""
    tombs = _live_tombs(tier, checkpoint_id)
    return tombs[0] if tombs else None


def live_tombs(tier: Tier) -> dict[str, LeaseInfo]:
    """The live tombstones on ``tier`` per checkpoint id (one per id): one listing of
    :data:`LEASE_PREFIX`, one read per tombstone (``tierckpt.list_checkpoints``)."""
    out: dict[str, LeaseInfo] = {}
    for li in _tombs(tier, f"{LEASE_PREFIX}/"):
        out.setdefault(li.checkpoint_id, li)
    return out


_PAST = {"load": "loaded", "fetch": "fetched", "verify": "verified"}


def being_deleted(tier: Tier, checkpoint_id: str, tomb: LeaseInfo, purpose: str = "load") -> CheckpointBeingDeleted:
    """The error for a reader (``purpose``: ``load``, ``fetch``, ...) that found ``tomb``."""
    verb = _PAST.get(purpose) or (f"used ({purpose})" if purpose else "used")
    return CheckpointBeingDeleted(
        f"checkpoint {checkpoint_id} cannot be {verb} from {tier.url}: it is being deleted ({tomb.deleting()})"
    )


def _forget(tier: Tier, key: str) -> bool:
    """Delete the lease object ``key`` (never raises); returns whether it is gone."""
    try:
        tier.delete(key)
    except TierckptError as e:
        log.debug("could not remove lease %s on %s: %s", key, tier.url, e)
        return False
    _let_go.discard(key)
    return True


class Lease:
    """A held lease on one checkpoint on one tier. Release it (or use ``with``).

    Created by :func:`acquire` or :func:`acquire_for_write`; renewed by the process's renewal
    thread until released. A renewal that fails is logged (the lease then expires after
    :data:`LEASE_TTL`). :attr:`lapsed` tells whether the lease may have looked dead to another
    process at some moment since it was taken.
    """

    def __init__(self, tier: Tier, checkpoint_id: str, kind: str, purpose: str) -> None:
        self.tier = tier
        self.checkpoint_id = checkpoint_id
        self.kind = kind
        self.purpose = purpose
        self.key = _key(checkpoint_id, kind, uuid.uuid4().hex[:16])
        self.released = False
        self.metadata: bytes | None = None  # the metadata read by acquire(read_metadata=...), after the lease
        self.valid_until = 0.0  # the expiry written by the last successful put (this host's clock)
        self._late = False  # a renewal landed after (or just before) the previous expiry
        self._write_lock = threading.Lock()  # a renewal and the release never interleave

    def _put(self) -> None:
        ttl = LEASE_TTL
        expires = time.time() + ttl
        self.tier.put_volatile(self.key, _body(self.kind, self.purpose, ttl, expires))
        if self.valid_until and time.time() > self.valid_until - ttl / 12:
            self._late = True
        self.valid_until = expires

    @property
    def lapsed(self) -> bool:
        """Whether a deleter may have judged this lease dead since it was taken: a renewal came
        too late, or the last one is (nearly) expired now. A writer whose lease lapsed must not
        commit (a deletion may have removed its objects meanwhile)."""
        return self._late or time.time() > self.valid_until - LEASE_TTL / 12

    def renew(self) -> None:
        """Write the lease again with a fresh expiry, unless it was released (a renewal never
        writes it back after :meth:`release` deleted it)."""
        with self._write_lock:
            if not self.released:
                self._put()

    def release(self) -> None:
        """Delete the lease (idempotent, never raises). Once it returns the lease object is gone
        from the tier (unless the delete failed: then it expires) and is no longer
        :func:`held_here`."""
        with self._write_lock:
            if self.released:
                return
            self.released = True
            if not _forget(self.tier, self.key):
                _let_go.add(self.key)
        _renewer.remove(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(
    tier: Tier,
    checkpoint_id: str,
    *,
    kind: str = "read",
    purpose: str = "",
    require_committed: bool = True,
    check_tombs: bool = True,
    read_metadata: int = 0,
) -> Lease:
    """Take a lease on ``checkpoint_id`` on ``tier``: write it, then make sure no deletion is under way.

    Raises :class:`~tierckpt.errors.CheckpointBeingDeleted` if a live tombstone exists (the lease
    is released; the message says who deletes it and when the tombstone expires),
    and :class:`CheckpointNotFound` if ``require_committed`` and the checkpoint is not (or no
    longer) committed there. Fetches into a tier pass ``require_committed=False``; saves and
    hops use :func:`acquire_for_write` (which waits for a deletion of the same id instead).

    ``read_metadata``: the size of the checkpoint's ``metadata.json`` as listed; the committed
    check then reads those bytes with one GET instead of a HEAD (the same request count, and
    the same proof: it runs after the tombstone check) and keeps them in :attr:`Lease.metadata`.
    A metadata shorter than listed now (replaced since) raises :class:`CheckpointNotFound` too,
    the lease released; the caller checks the bytes' commit header against the one it listed.
    """
    lease = Lease(tier, checkpoint_id, kind, purpose)
    try:
        lease._put()
    except TierAccessDenied as e:
        if kind != "read":
            raise
        # Read-only credentials: the read goes ahead unprotected (deleters cannot see it).
        _warn_once(
            tier,
            f"cannot take a lease on {tier.url} ({e}); reading {checkpoint_id} without one: "
            "a deletion elsewhere is not held off meanwhile",
        )
        lease.released = True
    try:
        tombs = _live_tombs(tier, checkpoint_id) if check_tombs else []
        if tombs:
            raise being_deleted(tier, checkpoint_id, tombs[0], purpose)
        if require_committed and read_metadata > 0:
            lease.metadata = _read_whole(tier, checkpoint_id, read_metadata)
        elif require_committed and not tier.exists(metadata_key(checkpoint_id)):
            raise CheckpointNotFound(f"checkpoint {checkpoint_id} is not committed on {tier.url} (deleted?)")
    except BaseException:
        lease.release()
        raise
    if not lease.released:
        _renewer.add(lease)
    return lease


def _read_whole(tier: Tier, checkpoint_id: str, size: int) -> bytes:
    """``metadata.json`` of ``checkpoint_id``, ``size`` bytes as listed, with one GET (the committed check)."""
    key = metadata_key(checkpoint_id)
    try:
        raw = tier.get(key, 0, size)
    except CheckpointNotFound:
        raise CheckpointNotFound(f"checkpoint {checkpoint_id} is not committed on {tier.url} (deleted?)") from None
    except CorruptCheckpoint as e:  # a range past the end: shorter than listed
        raise CheckpointNotFound(f"checkpoint {checkpoint_id} on {tier.url} changed since it was listed: {e}") from None
    if len(raw) != size:
        raise CheckpointNotFound(
            f"checkpoint {checkpoint_id} on {tier.url} changed since it was listed: "
            f"{tier.url}/{key} has {len(raw)} bytes, {size} were listed"
        )
    return raw


_warned: set[str] = set()


def _warn_once(tier: Tier, msg: str) -> None:
    if tier.url not in _warned:
        _warned.add(tier.url)
        log.warning("%s", msg)


def acquire_for_write(tier: Tier, checkpoint_id: str, *, purpose: str, wait: float | None = None) -> Lease:
    """A writer's lease (kind ``save``) on ``checkpoint_id`` on ``tier``: call it before writing
    the checkpoint's first object there, release it once the checkpoint is committed there (or
    the write failed).

    Written before it looks (the mirror image of :func:`guarded_delete`): when a live tombstone
    of the id exists, a deletion may not have seen this lease and may still remove objects it
    listed, so this waits (up to ``wait`` seconds, default :data:`TOMB_WAIT`) until no live
    tombstone is left. Raises :class:`CheckpointBeingDeleted` (the lease released) when one is
    still there, and the tier's error when the lease cannot be written. Blocks the calling
    thread (a capture or hop thread) only while a deletion of the same id runs.
    """
    wait = TOMB_WAIT if wait is None else wait
    lease = Lease(tier, checkpoint_id, "save", purpose)
    lease._put()
    _renewer.add(lease)
    try:
        deadline = time.monotonic() + wait
        delay, said = 0.01, False
        while True:
            tombs = _live_tombs(tier, checkpoint_id)
            if not tombs:
                return lease
            if time.monotonic() >= deadline:
                raise CheckpointBeingDeleted(
                    f"checkpoint {checkpoint_id} is being deleted on {tier.url} ({tombs[0].deleting()}) and the "
                    f"deletion did not finish within {wait:.0f} s: {purpose or 'a write'} cannot go ahead"
                )
            if not said:
                said = True
                log.info(
                    "%s on %s waits for a deletion of the same id to finish (%s)",
                    purpose or "a write",
                    tier.url,
                    tombs[0].describe(),
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    except BaseException:
        lease.release()
        raise


def guarded_delete(tier: Tier, checkpoint_id: str, delete, *, reason: str = "") -> bool:
    """Run ``delete()`` (which removes the checkpoint's metadata first, then its listed objects)
    under the tombstone protocol. Returns False, deleting nothing, when a live lease holds the
    checkpoint; logs who holds it."""
    held = live_leases(tier, checkpoint_id).get(checkpoint_id)
    if held:
        log.info(
            "not deleting %s on %s (%s): in use (%s)",
            checkpoint_id,
            tier.url,
            reason,
            ", ".join(li.describe() for li in held),
        )
        return False
    tomb = _key(checkpoint_id, "tomb", uuid.uuid4().hex[:16])
    tier.put_volatile(tomb, _body("tomb", reason or "deletion", TOMB_TTL))
    try:
        held = live_leases(tier, checkpoint_id, exclude=[tomb]).get(checkpoint_id)
        if held:
            log.info(
                "not deleting %s on %s (%s): a reader arrived (%s)",
                checkpoint_id,
                tier.url,
                reason,
                ", ".join(li.describe() for li in held),
            )
            return False
        delete()
        return True
    finally:
        _forget(tier, tomb)


def held_here(checkpoint_id: str) -> list[Lease]:
    """The leases on ``checkpoint_id`` (any tier, any kind) that this process holds now."""
    return [lease for lease in _renewer.held() if lease.checkpoint_id == checkpoint_id]


def wait_released_here(checkpoint_id: str, timeout: float) -> bool:
    """Block until this process holds no lease on ``checkpoint_id`` (its own loads, fetches and
    hops are done with it: each such lease is deleted from its tier by then), at most
    ``timeout`` seconds. Returns whether none is held."""
    return _renewer.wait_none(checkpoint_id, timeout)


_renewer = Renewer(RENEW_EVERY)
