"""The job's store, one client per thread (tierckpt.chain.jobstore), on real gloo ranks: a thread
blocked in the store's ``wait`` does not hold up the other threads of its rank. On one shared
TCPStore client it did: a save's check-in waiting on the training thread and the commit protocol
waiting on the background thread deadlocked two ranks until the commit timeout. A thread's client
outlives the thread, so no thread frees one as it ends: one that ended while the interpreter shut
down aborted the process (torch releases the GIL in a store's destructor)."""

from __future__ import annotations

from distrun import run_world


def test_a_thread_waiting_on_the_store_does_not_block_the_others(tmp_path):
    res = run_world(2, "store_threads", {"timeout": 60}, tmp_path / "w", timeout=150)
    for r, out in enumerate(res):
        assert out["timed_out"] == [], (r, out)  # each wait was ended by the other thread's set
        assert out["own_clients"], (r, out)  # a background thread keeps one client of its own
        assert out["kept_after_end"] and out["freed_later"], (r, out)
