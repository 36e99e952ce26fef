"""Lease records: how a lease or tombstone is named and stored on a tier, and how one is read back
(:class:`LeaseInfo`, :func:`list_leases`). The protocol that writes, renews, checks and deletes
them is :mod:`tierckpt.catalog.lease`, which re-exports these names."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass

from ..errors import CheckpointNotFound, TierckptError
from ..format.layout import check_checkpoint_id
from ..tiers.base import Tier

__all__ = ["LEASE_PREFIX", "LEASE_TTL", "TOMB_TTL", "LeaseInfo", "list_leases", "owner"]

log = logging.getLogger("tierckpt.lease")

LEASE_PREFIX = "_leases"
LEASE_TTL = 60.0  # seconds a lease lives without renewal
TOMB_TTL = 600.0  # a deletion that takes longer than this without finishing is considered dead

_MAX_LEASE_BYTES = 4096


@dataclass(frozen=True)
class LeaseInfo:
    """One lease or tombstone as found on a tier."""

    key: str
    checkpoint_id: str
    kind: str  # "read", "fetch", "save", ... or "tomb"
    owner: str
    purpose: str
    expires: float
    written: float = 0.0  # the object's time on the tier (its last write), 0 when unknown

    def live(self, now: float | None = None) -> bool:
        """Not expired, not released by this process (a release whose delete failed leaves the
        object behind: it is dead to us at once), and (when its holder ran on this host) its
        holder process still runs."""
        if self.expires <= (time.time() if now is None else now) or self.key in _let_go:
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

    def deleting(self, now: float | None = None) -> str:
        """A tombstone, for people: who deletes, since when, and when the tombstone expires
        (``gc by host:123, tombstone since 2024-06-01 12:00:03, expires in 588 s``)."""
        now = time.time() if now is None else now
        since = f", tombstone since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.written))}"
        return f"{self.describe()}{since if self.written else ''}, expires in {max(0.0, self.expires - now):.0f} s"


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def owner() -> str:
    """This process as the ``owner`` of the leases it writes (``host:pid``, :attr:`LeaseInfo.owner`)."""
    return _owner()


def _key(checkpoint_id: str, kind: str, lid: str) -> str:
    return f"{LEASE_PREFIX}/{check_checkpoint_id(checkpoint_id)}/{kind}-{lid}.json"


def _body(kind: str, purpose: str, ttl: float, expires: float | None = None) -> bytes:
    expires = time.time() + ttl if expires is None else expires
    return json.dumps({"owner": _owner(), "kind": kind, "purpose": purpose, "expires": expires}).encode()


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
    return LeaseInfo(
        key=key, checkpoint_id=cid, kind=kind, owner=owner, purpose=purpose, expires=expires, written=mtime
    )


def list_leases(tier: Tier, checkpoint_id: str | None = None) -> list[LeaseInfo]:
    """Every lease and tombstone on ``tier`` (of one checkpoint, or of all), live or expired."""
    prefix = f"{LEASE_PREFIX}/" if checkpoint_id is None else f"{LEASE_PREFIX}/{check_checkpoint_id(checkpoint_id)}/"
    out = []
    for info in list(tier.list(prefix)):
        li = _parse(tier, info.key, info.size, info.mtime)
        if li is not None:
            out.append(li)
    return out


#: Keys of leases this process released but could not delete (the tier was down): dead to this
#: process's deleters at once, not after :data:`LEASE_TTL` (a promotion that failed in an outage
#: must not keep its own leftover upload from being cleaned). Removed once the delete succeeds.
_let_go: set[str] = set()
