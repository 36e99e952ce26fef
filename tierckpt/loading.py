"""Loads in flight in this process, so that background preparation for saves yields to them.

A resume is on the critical path of a restart; the host pool's first touch
(:class:`tierckpt.capture.pool.HostPool`) is not: it only has to be done before the first save.
Both start together in a restarted job (the writer is built, then the newest checkpoint loaded),
and on a busy host the zero-fill of the pool (with transparent huge pages, sometimes kernel
compaction: measured 0.02-1.7 CPU seconds for 128 MiB) competes with the load for the cores.
So the pool's touch pauses between slots while a load is in flight (see ``HostPool``).

Who marks a load: :class:`tierckpt.reader.TieredReader` from ``read_metadata`` to the end of
``read_data`` (or the failure that ends the load), and integrations around their whole resume
(``with loading():``, e.g. resolving ``latest`` first). A reader that is dropped mid-load stops
counting when it is garbage collected (weak references); waiters also bound their own wait.
Thread-safe.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["begin", "end", "in_flight", "loading"]

_lock = threading.Lock()
_active: weakref.WeakSet[Any] = weakref.WeakSet()
_scopes = 0


def begin(owner: Any) -> None:
    """``owner`` (a reader) started a load; idempotent until :func:`end`."""
    with _lock:
        _active.add(owner)


def end(owner: Any) -> None:
    """``owner``'s load is over (done or failed); idempotent."""
    with _lock:
        _active.discard(owner)


@contextmanager
def loading() -> Iterator[None]:
    """A load in flight for the duration of the block (nestable)."""
    global _scopes
    with _lock:
        _scopes += 1
    try:
        yield
    finally:
        with _lock:
            _scopes -= 1


def in_flight() -> bool:
    """Whether some load of this process is in flight now."""
    with _lock:
        return _scopes > 0 or len(_active) > 0
