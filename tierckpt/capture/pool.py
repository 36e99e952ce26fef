"""The host buffer pool: one allocation per process, reused by every checkpoint.

The pool is a single ``uint8`` tensor of ``buffer_size`` bytes (page-locked when CUDA is
available and ``[host] pinned`` is set), cut into fixed slots of ``chunk_size`` bytes. It starts
at a multiple of :data:`POOL_ALIGN` (a page, at least 4 KiB) and slots are multiples of 4 KiB, so
every slot can be handed to ``O_DIRECT`` writes as is. Pageable pools are anonymous ``mmap``
memory (page-aligned; transparent huge pages requested, which cuts page-pinning work in direct
I/O); pinned pools come from ``cudaHostAlloc`` (page-aligned). Capture
takes a slot per chunk and blocks when none is free (backpressure); the flush returns the slot
once the chunk is written. Host memory is therefore bounded by the pool, whatever the state size.

Pools are shared per process: :func:`get_pool` returns the same pool for the same settings, so
a new ``TieredWriter`` per ``dcp.save`` call does not allocate again. ``HostPool.allocations``
counts real allocations (tests assert it does not grow).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable
from typing import ClassVar

import torch

from ..errors import CaptureError

__all__ = ["HostPool", "get_pool", "POOL_ALIGN", "aligned_buffer"]

log = logging.getLogger("tierckpt.capture")

POOL_ALIGN = max(4096, mmap.PAGESIZE)  # the pool's start; O_DIRECT needs (at most) this alignment
MAX_PAUSE_S = 60.0  # the most the pool's first touch waits for loads in flight, in all
PAUSE_POLL_S = 0.01  # how often a paused touch looks again
TOUCH_STEP = 2 << 20  # bytes of the first touch between looks (one transparent huge page on x86-64)


def aligned_buffer(nbytes: int, pinned: bool = False) -> tuple[torch.Tensor, object]:
    """A ``uint8`` tensor of ``nbytes`` starting at a multiple of :data:`POOL_ALIGN`, and the
    object that owns its memory (keep it referenced as long as the tensor is used).

    Pageable: an anonymous ``mmap`` (zero-filled by the kernel on first touch) with
    ``MADV_HUGEPAGE`` where available. Pinned: ``torch.empty(..., pin_memory=True)``, whose
    memory comes from ``cudaHostAlloc`` and is page-aligned; should it not be, one extra page is
    allocated and the tensor sliced at the first aligned address (the slice shares the
    page-locked storage).
    """
    if pinned:
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % POOL_ALIGN == 0:
            return raw, raw
        del raw
        raw = torch.empty(nbytes + POOL_ALIGN, dtype=torch.uint8, pin_memory=True)
        off = (-raw.data_ptr()) % POOL_ALIGN
        return raw[off : off + nbytes], raw
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled or unsupported: plain pages
            pass
    t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    return t, mm


class HostPool:
    """Fixed-size slots over one host buffer. Thread-safe."""

    allocations: ClassVar[int] = 0

    def __init__(
        self,
        buffer_size: int,
        chunk_size: int,
        pinned: bool,
        pause: Callable[[], bool] | None = None,
        wanted: Callable[[], bool] | None = None,
    ) -> None:
        """``pause``: asked before touching each :data:`TOUCH_STEP` bytes; while it answers true (a load in flight and
        no save waiting, see :mod:`tierckpt.loading`) the touch waits, at most
        :data:`MAX_PAUSE_S` seconds in all. ``wanted``: asked likewise; once it answers true (a
        save waits for the pool) the touch up front stops and every slot not touched yet is
        touched by the thread that first acquires it, so a save never waits for the touch of
        slots it does not use (1 GiB took 4-8 s on a loaded 2-core VM)."""
        if chunk_size <= 0 or buffer_size < chunk_size:
            raise CaptureError(f"host pool: buffer_size {buffer_size} is smaller than chunk_size {chunk_size}")
        self.chunk_size = chunk_size
        self.nslots = buffer_size // chunk_size
        self.pinned = bool(pinned and torch.cuda.is_available())
        if chunk_size % 4096:
            raise CaptureError(f"host pool: chunk_size {chunk_size} is not a multiple of 4 KiB (direct I/O needs it)")
        self.buffer, self._owner = aligned_buffer(self.nslots * chunk_size, self.pinned)
        # First touch of fresh memory is slow (1-4 GiB/s on some hosts): pay it here, once, before
        # a slot is handed out (so that no capture ever races the zero-fill); TOUCH_STEP bytes
        # at a time, yielding the cores to a load in flight (a restart's resume) in between, and
        # leaving the slots not touched yet to their first acquire once a save waits (wanted).
        deadline = time.monotonic() + MAX_PAUSE_S
        touched = 0  # bytes
        while touched < self.size:
            if wanted is not None and wanted():
                break
            while pause is not None and time.monotonic() < deadline and pause():
                time.sleep(PAUSE_POLL_S)
            self.buffer[touched : touched + TOUCH_STEP].fill_(0)
            touched = min(self.size, touched + TOUCH_STEP)
        HostPool.allocations += 1
        done = touched // chunk_size  # slots wholly touched (a slot is touched whole, or not at all)
        self._free = list(range(done - 1, -1, -1))
        self._untouched = list(range(self.nslots - 1, done - 1, -1))  # popped from the end: lowest first
        self._cv = threading.Condition()
        log.info(
            "host pool: %d slots of %d bytes (%s)", self.nslots, chunk_size, "pinned" if self.pinned else "pageable"
        )

    @property
    def size(self) -> int:
        return self.nslots * self.chunk_size

    def acquire(self, should_stop: Callable[[], bool] = lambda: False) -> int | None:
        """Take a free slot, blocking until one is released; ``None`` if ``should_stop()`` turns true."""
        with self._cv:
            while not self._free:
                if self._untouched:
                    slot = self._untouched.pop()
                    break
                if should_stop():
                    return None
                self._cv.wait(0.05)
            else:
                return self._free.pop()
        self.slot(slot).fill_(0)  # its first touch, by the thread it is handed to
        return slot

    @property
    def untouched(self) -> int:
        """Slots never handed out nor touched yet (touched by their first :meth:`acquire`)."""
        with self._cv:
            return len(self._untouched)

    def release(self, slot: int) -> None:
        with self._cv:
            self._free.append(slot)
            self._cv.notify()

    def free_slots(self) -> int:
        """Slots a capture can take now (untouched ones included)."""
        with self._cv:
            return len(self._free) + len(self._untouched)

    def slot(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """The slot's bytes as a ``uint8`` tensor view (first ``nbytes`` of it)."""
        start = slot * self.chunk_size
        return self.buffer[start : start + (self.chunk_size if nbytes is None else nbytes)]


_pools: dict[tuple[int, int, bool], HostPool] = {}
_pools_lock = threading.Lock()


def get_pool(
    buffer_size: int,
    chunk_size: int,
    pinned: bool,
    pause: Callable[[], bool] | None = None,
    wanted: Callable[[], bool] | None = None,
) -> HostPool:
    """The process-wide pool for these settings, allocated on first use (``pause``, ``wanted``: see
    :class:`HostPool`; only the call that allocates uses them)."""
    key = (buffer_size, chunk_size, bool(pinned))
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = HostPool(buffer_size, chunk_size, pinned, pause, wanted)
        return pool
