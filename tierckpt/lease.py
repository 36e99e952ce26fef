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

A reader does the mirror image: write its lease, then check for a live tombstone (and that the
checkpoint is still committed). Both sides write before they look, so at least one of them sees
the other (local file systems and S3 are read-after-write consistent): either the reader backs
off before reading a byte, or the deleter leaves the checkpoint alone. A writer's lease is taken
before its first file is created; a deletion only removes objects it listed, so a save that
starts after the listing is never touched.

Lease expiry uses the holder's wall clock, compared with the deleter's: keep clocks within a
fraction of :data:`LEASE_TTL` (NTP does). A lease whose holder ran on the same host and no longer
exists is dead at once (a killed job's leftovers are cleaned by the next commit). Leases never
decide the *order* of checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Iterable

from .errors import CheckpointNotFound, CorruptCheckpoint, TierAccessDenied, TierckptError
from .layout import check_checkpoint_id, metadata_key
from .tiers.base import Tier

__all__ = ["LEASE_PREFIX", "LEASE_TTL", "Lease", "LeaseInfo", "live_leases", "acquire", "guarded_delete",
           "CheckpointBeingDeleted"]

log = logging.getLogger("tierckpt.lease")

LEASE_PREFIX = "_leases"
LEASE_TTL = 60.0  # seconds a lease lives without renewal
RENEW_EVERY = LEASE_TTL / 4
TOMB_TTL = 600.0  # a deletion that takes longer than this without finishing is considered dead

_MAX_LEASE_BYTES = 4096


class CheckpointBeingDeleted(CheckpointNotFound):
    """A reader found a live deletion of the checkpoint it wanted (retention or gc elsewhere)."""


@dataclass(frozen=True)
class LeaseInfo:
    """One lease or tombstone as found on a tier."""

    key: str
    checkpoint_id: str
    kind: str  # "read", "fetch", "save", ... or "tomb"
    owner: str
    purpose: str
    expires: float

    def live(self, now: float | None = None) -> bool:
        """Not expired, and (when its holder ran on this host) its holder process still runs."""
        if self.expires <= (time.time() if now is None else now):
            return False
        host, _, pid = self.owner.rpartition(":")
        if host == socket.gethostname() and pid.isdigit():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                return False  # its holder died: no need to wait for the expiry
            except (PermissionError, OverflowError):
                pass
        return True

    def describe(self) -> str:
        return f"{self.purpose or self.kind} by {self.owner}"


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _key(checkpoint_id: str, kind: str, lid: str) -> str:
    return f"{LEASE_PREFIX}/{check_checkpoint_id(checkpoint_id)}/{kind}-{lid}.json"


def _body(kind: str, purpose: str, ttl: float) -> bytes:
    return json.dumps({"owner": _owner(), "kind": kind, "purpose": purpose, "expires": time.time() + ttl}).encode()


def _parse(tier: Tier, key: str, size: int, mtime: float) -> LeaseInfo | None:
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != LEASE_PREFIX or not parts[2].endswith(".json") or "-" not in parts[2]:
        return None
    cid, name = parts[1], parts[2]
    kind = name.split("-", 1)[0]
    expires = mtime + (TOMB_TTL if kind == "tomb" else LEASE_TTL)  # an unreadable body: judge by its time
    owner = purpose = "?"
    if size <= _MAX_LEASE_BYTES:
        try:
            d = json.loads(tier.get(key))
            if isinstance(d, dict):
                e = d.get("expires")
                if isinstance(e, (int, float)) and not isinstance(e, bool):
                    expires = float(e)
                owner, purpose = str(d.get("owner", "?"))[:200], str(d.get("purpose", ""))[:200]
        except CheckpointNotFound:
            return None  # released while we listed
        except (TierckptError, ValueError, OSError) as e:
            log.debug("unreadable lease %s on %s: %s", key, tier.url, e)
    return LeaseInfo(key=key, checkpoint_id=cid, kind=kind, owner=owner, purpose=purpose, expires=expires)


def list_leases(tier: Tier, checkpoint_id: str | None = None) -> list[LeaseInfo]:
    """Every lease and tombstone on ``tier`` (of one checkpoint, or of all), live or expired."""
    prefix = f"{LEASE_PREFIX}/" if checkpoint_id is None else f"{LEASE_PREFIX}/{check_checkpoint_id(checkpoint_id)}/"
    out = []
    for info in list(tier.list(prefix)):
        li = _parse(tier, info.key, info.size, info.mtime)
        if li is not None:
            out.append(li)
    return out


def live_leases(tier: Tier, checkpoint_id: str | None = None, *, exclude: Iterable[str] = ()) -> dict[str, list[LeaseInfo]]:
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
    now = time.time()
    return [li for li in list_leases(tier, checkpoint_id) if li.kind == "tomb" and li.key != exclude and li.live(now)]


def _forget(tier: Tier, key: str) -> None:
    try:
        tier.delete(key)
    except TierckptError as e:
        log.debug("could not remove lease %s on %s: %s", key, tier.url, e)


class Lease:
    """A held lease on one checkpoint on one tier. Release it (or use ``with``).

    Created by :func:`acquire`; renewed by the process's renewal thread until released. A
    renewal that fails is logged (the lease then expires after :data:`LEASE_TTL`).
    """

    def __init__(self, tier: Tier, checkpoint_id: str, kind: str, purpose: str) -> None:
        self.tier = tier
        self.checkpoint_id = checkpoint_id
        self.kind = kind
        self.purpose = purpose
        self.key = _key(checkpoint_id, kind, uuid.uuid4().hex[:16])
        self.released = False

    def _put(self) -> None:
        self.tier.put_volatile(self.key, _body(self.kind, self.purpose, LEASE_TTL))

    def renew(self) -> None:
        if not self.released:
            self._put()

    def release(self) -> None:
        """Delete the lease (idempotent, never raises)."""
        if self.released:
            return
        self.released = True
        _renewer.remove(self)
        _forget(self.tier, self.key)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(tier: Tier, checkpoint_id: str, *, kind: str = "read", purpose: str = "",
            require_committed: bool = True, check_tombs: bool = True) -> Lease:
    """Take a lease on ``checkpoint_id`` on ``tier``: write it, then make sure no deletion is under way.

    Raises :class:`CheckpointBeingDeleted` if a live tombstone exists (the lease is released),
    and :class:`CheckpointNotFound` if ``require_committed`` and the checkpoint is not (or no
    longer) committed there. Saves (``kind="save"``) and fetches into a tier pass
    ``require_committed=False``; a save also passes ``check_tombs=False``: its files are new, and
    a deletion only removes objects it listed before it looked for leases.
    """
    lease = Lease(tier, checkpoint_id, kind, purpose)
    try:
        lease._put()
    except TierAccessDenied as e:
        if kind != "read":
            raise
        # Read-only credentials: the read goes ahead unprotected (deleters cannot see it).
        _warn_once(tier, f"cannot take a lease on {tier.url} ({e}); reading {checkpoint_id} without one: "
                         "a deletion elsewhere is not held off meanwhile")
        lease.released = True
    try:
        tombs = _live_tombs(tier, checkpoint_id) if check_tombs else []
        if tombs:
            raise CheckpointBeingDeleted(f"checkpoint {checkpoint_id} is being deleted on {tier.url} "
                                         f"({tombs[0].describe()}): it cannot be {purpose or 'used'}")
        if require_committed and not tier.exists(metadata_key(checkpoint_id)):
            raise CheckpointNotFound(f"checkpoint {checkpoint_id} is not committed on {tier.url} (deleted?)")
    except BaseException:
        lease.release()
        raise
    if not lease.released:
        _renewer.add(lease)
    return lease


_warned: set[str] = set()


def _warn_once(tier: Tier, msg: str) -> None:
    if tier.url not in _warned:
        _warned.add(tier.url)
        log.warning("%s", msg)


def guarded_delete(tier: Tier, checkpoint_id: str, delete, *, reason: str = "") -> bool:
    """Run ``delete()`` (which removes the checkpoint's metadata first, then its listed objects)
    under the tombstone protocol. Returns False, deleting nothing, when a live lease holds the
    checkpoint; logs who holds it."""
    held = live_leases(tier, checkpoint_id).get(checkpoint_id)
    if held:
        log.info("not deleting %s on %s (%s): in use (%s)", checkpoint_id, tier.url, reason,
                 ", ".join(li.describe() for li in held))
        return False
    tomb = _key(checkpoint_id, "tomb", uuid.uuid4().hex[:16])
    tier.put_volatile(tomb, _body("tomb", reason or "deletion", TOMB_TTL))
    try:
        held = live_leases(tier, checkpoint_id, exclude=[tomb]).get(checkpoint_id)
        if held:
            log.info("not deleting %s on %s (%s): a reader arrived (%s)", checkpoint_id, tier.url, reason,
                     ", ".join(li.describe() for li in held))
            return False
        delete()
        return True
    finally:
        _forget(tier, tomb)


class _Renewer:
    """One daemon thread per process renewing every held lease every :data:`RENEW_EVERY` seconds."""

    def __init__(self) -> None:
        self._leases: set[Lease] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._leases.add(lease)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tierckpt-lease", daemon=True)
                self._thread.start()

    def remove(self, lease: Lease) -> None:
        with self._lock:
            self._leases.discard(lease)

    def held(self) -> list[Lease]:
        with self._lock:
            return list(self._leases)

    def _run(self) -> None:
        while True:
            time.sleep(RENEW_EVERY)
            for lease in self.held():
                try:
                    lease.renew()
                except (TierckptError, OSError, CorruptCheckpoint) as e:
                    log.warning("could not renew the lease on %s at %s: %s", lease.checkpoint_id, lease.tier.url, e)


_renewer = _Renewer()
