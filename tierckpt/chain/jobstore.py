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
thread needs one, and closed when the thread ends. The main thread keeps the default client: a
job has one extra connection to the store per rank and tierckpt thread that uses it. A store
that cannot be cloned (``FileStore``, ``HashStore``: no blocking client to share) is used as is.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["JobStore", "thread_client"]

_tls = threading.local()


def thread_client() -> Any:
    """The calling thread's client of the job's store (the default group's; raises as
    ``torch.distributed`` does when none is initialized). The main thread gets the default store
    itself; another thread a clone of it, kept for the thread's life (renewed if the default group
    is replaced, as by ``destroy_process_group`` then ``init_process_group``)."""
    from torch.distributed import distributed_c10d as c10d

    base: Any = c10d._get_default_store()  # (torch's stubs lack Store.clone)
    if threading.current_thread() is threading.main_thread():
        return base
    group = c10d._get_default_group()
    held = getattr(_tls, "held", None)
    if held is None or held[0] is not group:
        try:
            client = base.clone()
        except Exception:  # noqa: BLE001 - a store without clone (FileStore, HashStore): no client to share
            client = base
        _tls.held = held = (group, client)
    return held[1]


class JobStore:
    """The job's store as every thread should use it: each call goes to :func:`thread_client` of
    the calling thread, so one object can be made on one thread and used on others."""

    def __getattr__(self, name: str) -> Any:
        return getattr(thread_client(), name)
