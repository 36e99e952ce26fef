"""The job's store (the default process group's ``torch.distributed.Store``), one client per thread.

A TCPStore client serves one operation at a time: its ``wait`` holds the client until the keys
are set or the wait times out, and every other thread's ``set``/``get`` on the same client queues
behind it. tierckpt blocks in ``wait`` on the training thread (a save's check-in, waiting for the
other ranks) and on its background threads (the commit protocol, the capture hold). On one shared
client, those block each other across processes: rank 0's training thread waits for rank 1's
check-in key, rank 1's ``set`` of it queues behind rank 1's commit thread, which waits for a key
that rank 0's commit thread cannot set until rank 0's training thread is done waiting. That is a
deadlock until the first timeout (``[job] commit_timeout``).

So every thread other than the main one reaches the store through a client of its own, made by
``Store.clone()`` (the use torch documents for it: one clone per thread) the first time the
thread needs one, and closed after the thread ends. The main thread keeps the default client: a
job has one extra connection to the store per rank and tierckpt thread that uses it. A store
that cannot be cloned (``FileStore``, ``HashStore``: no blocking client to share) is used as is.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["JobStore", "thread_client"]

# thread -> (a weak reference to the default group the client was made for, the client). Module
# level, not thread-local: a client must never be freed by its thread as that thread ends. Freeing
# a store (or a process group) releases the GIL in torch's destructor; a thread that ends while the
# interpreter shuts down cannot take the GIL back and exits through C++ frames that forbid it, and
# the process aborts ("terminate called without an active exception"). Clients of ended threads
# are freed by the next thread that makes one, or by the main thread at exit.
_clients: dict[threading.Thread, tuple[weakref.ref, Any]] = {}
_lock = threading.Lock()


def thread_client() -> Any:
    """The calling thread's client of the job's store (the default group's; raises as
    ``torch.distributed`` does when none is initialized). The main thread gets the default store
    itself; another thread a clone of it, made once and kept past the thread's end (renewed if the default group
    is replaced, as by ``destroy_process_group`` then ``init_process_group``)."""
    from torch.distributed import distributed_c10d as c10d

    me = threading.current_thread()
    if me is threading.main_thread():
        return c10d._get_default_store()
    group = c10d._get_default_group()
    with _lock:
        held = _clients.get(me)
    if held is not None and held[0]() is group:
        return held[1]
    base: Any = c10d._get_default_store()  # (torch's stubs lack Store.clone)
    try:
        client = base.clone()
    except Exception:  # noqa: BLE001 - a store without clone (FileStore, HashStore): no client to share
        client = base
    with _lock:
        ended = [t for t in _clients if not t.is_alive()]
        freed = [_clients.pop(t) for t in ended]  # freed below, by this live thread
        _clients[me] = (weakref.ref(group), client)
    del freed
    return client


class JobStore:
    """The job's store as every thread should use it: each call goes to :func:`thread_client` of
    the calling thread, so one object can be made on one thread and used on others."""

    def __getattr__(self, name: str) -> Any:
        return getattr(thread_client(), name)
