"""Holding a save's capture until ``dcp.save`` is done with the CPU.

After write_data, DCP still gathers the write results, runs finish() on the coordinator and
broadcasts the global metadata; with plan caching that is half of the call. Capture and flush
started at once would compete with it for the GIL and the cores, so a save's capture waits
(RankSave.hold) until DCP's last step: finish() attaches a :class:`Release` marker to the metadata, which
the coordinator pickles and every other rank unpickles for the broadcast. A rank's capture
thread, once released, says so on the store; the coordinator's waits for every other rank's
word (a blocking store wait, no polling), so it does not take the cores from ranks still
unpickling. Also released at once by wait_captured()/wait()/the optimizer pre-step hook and by
the next save; every wait ends after :data:`HOLD_TIMEOUT`.

Who calls what: ``TieredWriter.write_data`` registers a hold per save (:func:`hold`) and
releases the previous saves' (:func:`release_all` with ``urgent=False``); ``TieredWriter.finish``
releases it on the coordinator (:func:`release`, or through :class:`Release`);
``wait_captured``/``wait``/the pre-step hook call :func:`release_all`. :meth:`Hold.wait` blocks
the capture thread (and the coordinator's results worker) for at most the timeout given.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..capture.ranksave import RankAssign

__all__ = ["HOLD_TIMEOUT", "Hold", "Release", "hold", "release", "release_all"]

HOLD_TIMEOUT = 2.0  # seconds a capture waits at most for its release (and the coordinator for the others)


class Hold:
    """One save's capture hold on one rank; :meth:`wait` is called by the capture thread
    (``RankSave.plan``) and, on the coordinator, by the results worker."""

    def __init__(self, assign: RankAssign, coordinator: bool) -> None:
        self.token = assign.token
        self.rank = assign.rank
        self.world = assign.world if assign.distributed else 1
        self.coordinator = coordinator
        self.event = threading.Event()
        self.urgent = False  # released by a wait: start now, wait for no other rank
        self._done = threading.Event()

    def release(self, urgent: bool = False) -> None:
        self.urgent = self.urgent or urgent
        self.event.set()

    def _key(self, rank: int) -> str:
        return f"tierckpt/release/{self.token}/r{rank}"

    def wait(self, timeout: float) -> None:
        """Until this rank is out of ``dcp.save`` (and, on the coordinator, every rank is)."""
        if self._done.is_set():
            return
        self.event.wait(timeout)
        if self.world > 1:
            try:
                from datetime import timedelta

                from ..chain.jobstore import JobStore

                store = JobStore()
                if not self.coordinator:
                    store.set(self._key(self.rank), "1")
                elif not self.urgent:
                    others = [self._key(r) for r in range(self.world) if r != self.rank]
                    store.wait(others, timedelta(seconds=timeout))
                    for k in others:
                        store.delete_key(k)
            except Exception:  # noqa: BLE001 - a rank that never says so only delays this capture
                pass
        self._done.set()


_holds: dict[str, Hold] = {}  # save token -> its job's hold (this process)
_holds_lock = threading.Lock()


def hold(assign: RankAssign, coordinator: bool) -> Hold:
    h = Hold(assign, coordinator)
    with _holds_lock:
        _holds[assign.token] = h
    return h


def release(token: str) -> None:
    with _holds_lock:
        h = _holds.pop(token, None)
    if h is not None:
        h.release()


def release_all(urgent: bool = True) -> None:
    """Let every held capture of this process start now."""
    with _holds_lock:
        hs = list(_holds.values())
        _holds.clear()
    for h in hs:
        h.release(urgent)


def _released(token: str) -> Release:
    """Unpickling a :class:`Release` (every rank but the coordinator, in DCP's broadcast)."""
    release(token)
    return Release(token)


class Release:
    """The coordinator puts it in ``Metadata.storage_data`` in ``finish()`` (as DCP's own writers put
    their storage data there); pickling it (coordinator) and unpickling it (every other rank) for
    DCP's metadata broadcast releases that process's held capture of the save."""

    def __init__(self, token: str) -> None:
        self.token = token

    def __reduce__(self) -> tuple:
        release(self.token)
        return (_released, (self.token,))
