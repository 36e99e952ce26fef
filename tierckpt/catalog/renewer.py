"""The lease renewer: one daemon thread per process keeps every lease it holds alive.

:class:`~tierckpt.catalog.lease.Lease` adds itself when acquired and removes itself when released;
the thread renews each every ``every`` seconds (a failure is logged, the lease may lapse: its
holder finds out with ``lapsed()``). Also the registry of what this process holds, which a
deletion of this process waits on (:func:`~tierckpt.catalog.lease.wait_released_here`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..errors import CorruptCheckpoint, TierckptError

__all__ = ["Renewer"]

log = logging.getLogger("tierckpt")


class Renewer:
    """One daemon thread per process renewing every held lease every ``every`` seconds; the
    registry of the leases this process holds (:func:`~tierckpt.catalog.lease.held_here`)."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._leases: set[Any] = set()
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def add(self, lease: Any) -> None:
        with self._lock:
            self._leases.add(lease)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tierckpt-lease", daemon=True)
                self._thread.start()

    def remove(self, lease: Any) -> None:
        with self._lock:
            self._leases.discard(lease)
            self._released.notify_all()

    def wait_none(self, checkpoint_id: str, timeout: float) -> bool:
        with self._lock:
            return self._released.wait_for(
                lambda: not any(lease.checkpoint_id == checkpoint_id for lease in self._leases), timeout
            )

    def held(self) -> list[Any]:
        with self._lock:
            return list(self._leases)

    def _run(self) -> None:
        while True:
            time.sleep(self.every)
            for lease in self.held():
                try:
                    lease.renew()
                except (TierckptError, OSError, CorruptCheckpoint) as e:
                    log.warning("could not renew the lease on %s at %s: %s", lease.checkpoint_id, lease.tier.url, e)
