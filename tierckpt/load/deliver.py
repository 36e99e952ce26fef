"""Where the bytes of a load land: each stored item is read once, straight into its destination
tensor when one read covers it whole (same dtype, shape, contiguous, on the CPU), else into a
scratch buffer that is copied out to every destination once the read engine verified it.
Non-tensor items are refused unless they load with ``weights_only=True`` (or ``allow_pickle``).
Used by :class:`~tierckpt.load.reader.TieredReader` on the read engine's threads.
"""

from __future__ import annotations

import ctypes
import io
import logging
import math
import mmap
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import CorruptCheckpoint
from ..format.metadata import DTYPES, ItemRecord

__all__ = [
    "Item",
    "buffer_for",
    "deliver",
    "is_whole",
    "direct_ok",
    "bytes_view",
    "unfilled",
    "advise_huge",
    "free_pages_reported",
]

log = logging.getLogger("tierckpt")


@dataclass
class Item:
    """One stored item a load reads: its record, DCP's reads of it and where its bytes go."""

    index: MetadataIndex
    rec: ItemRecord
    reads: list[ReadItem]
    direct: torch.Tensor | None = None  # destination read into directly
    targets: list[torch.Tensor] = field(default_factory=list)
    scratch: torch.Tensor | None = None
    data: Any = None


def buffer_for(it: Item) -> memoryview:
    """Where the item's bytes land: the destination tensor itself, or a scratch buffer."""
    if it.direct is not None:
        return bytes_view(it.direct)
    if not it.rec.is_tensor:
        it.data = bytearray(it.rec.length)
        return memoryview(it.data)
    it.scratch = unfilled((it.rec.length,), torch.uint8)
    return memoryview(it.scratch.numpy())


def deliver(it: Item, allow_pickle: bool, checkpoint_id: str | None, passed: set[bytes] | None = None) -> None:
    """Copy a verified item out to DCP's destinations (tensors), or keep its bytes (objects,
    refused unless they load with ``weights_only=True`` or ``allow_pickle``); frees the scratch buffer.

    ``passed``: the objects of this load that passed the ``weights_only`` check; an object equal
    to one of them, byte for byte, is not unpickled again (the check depends on the bytes
    alone: an optimizer's ``param_groups`` are hundreds of copies of a few values). Objects
    that pass are added. Several threads may share it."""
    rec = it.rec
    if not rec.is_tensor:
        data = bytes(it.data)  # type: ignore[arg-type]
        if not allow_pickle and (passed is None or data not in passed):
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unpickling failure means: refuse
                raise CorruptCheckpoint(
                    f"checkpoint {checkpoint_id}: non-tensor item {it.index.fqn!r} cannot be loaded with "
                    f"weights_only=True ({type(e).__name__}); pass TieredReader(..., allow_pickle=True) "
                    "only if you trust this checkpoint"
                ) from None
            if passed is not None:
                passed.add(data)
        it.data = data
        return
    if it.direct is not None:
        return
    assert it.scratch is not None
    src = it.scratch.view(DTYPES[rec.dtype]).reshape(rec.shape)
    for ri, target in zip(it.reads, it.targets):
        view = src
        for dim, (off, ln) in enumerate(zip(ri.storage_offsets, ri.lengths)):
            view = view.narrow(dim, off, ln)
        if target.shape != view.shape:
            raise CorruptCheckpoint(
                f"checkpoint {checkpoint_id}: {it.index.fqn!r}: stored shape {list(view.shape)} "
                f"does not fit the destination {list(target.shape)}"
            )
        target.copy_(view)
    it.scratch = None


def unfilled(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of ``shape`` and ``dtype`` whose memory is left as allocated, for a
    destination that a read overwrites whole before anyone sees it.

    ``torch.empty`` under ``torch.use_deterministic_algorithms(True)`` (Lightning's
    ``deterministic=True``) fills the new memory with NaN or the largest integer
    (``torch.utils.deterministic.fill_uninitialized_memory``): a full write pass of every
    byte a load is about to overwrite anyway (measured: 27 ms of a 47 ms Lightning resume of
    50 MB). A storage allocated directly is not filled, and no global flag is touched.

    A storage of at least :data:`HUGE_MIN` bytes is advised into transparent huge pages
    (:func:`advise_huge`) where that pays: the read that fills it then takes one page fault per
    2 MiB instead of one per 4 KiB (measured: reading 50 MB from the page cache into new memory,
    21 ms against 5 ms). It stays an ordinary storage of torch's allocator (resizable, shareable)."""
    n = math.prod(shape)
    t = torch.empty(0, dtype=dtype)
    storage = torch.UntypedStorage(n * t.element_size())
    advise_huge(storage.data_ptr(), storage.nbytes())
    return t.set_(storage, 0, torch.Size(shape))  # type: ignore[call-overload]


HUGE_PAGE = 2 << 20
"""The transparent huge page size :func:`advise_huge` aligns to (x86-64 and arm64 with 4 KiB pages)."""
HUGE_MIN = 2 * HUGE_PAGE
"""The smallest allocation :func:`unfilled` advises (it spans at least one whole aligned huge page)."""

_madvise: Any = None  # libc's madvise, or False where there is none or it does not pay (set on first use)

VIRTIO_BALLOON_F_REPORTING = 5
"""The virtio-balloon feature bit of free page reporting (the guest hands free memory back)."""


def free_pages_reported(devices: str = "/sys/bus/virtio/drivers/virtio_balloon") -> bool:
    """Whether this machine is a VM whose balloon device reports free pages to the hypervisor
    (virtio-balloon free page reporting, as Firecracker and some clouds enable): the host then
    drops the memory of free 2 MiB blocks, and a huge page taken from one is backed again by one
    host fault per 4 KiB on first touch. Measured on such a VM (2 CPUs, Lightning DDP resume of
    50 MB, ``tools/bench_integrations.py``): huge-page destinations took 120-139 ms in half the
    rounds, against 37-50 ms with 4 KiB pages. False when it cannot be told."""
    try:
        for dev in os.listdir(devices):
            if not dev.startswith("virtio"):
                continue
            with open(os.path.join(devices, dev, "features")) as f:
                bits = f.read().strip()
            if len(bits) > VIRTIO_BALLOON_F_REPORTING and bits[VIRTIO_BALLOON_F_REPORTING] == "1":
                return True
    except OSError:
        return False
    return False


def advise_huge(address: int, nbytes: int) -> bool:
    """Ask the kernel for transparent huge pages (``MADV_HUGEPAGE``) over the whole, 2 MiB-aligned
    huge pages of the ``nbytes`` at ``address``, memory not touched yet; ``nbytes`` under
    :data:`HUGE_MIN` are left alone. A hint: it changes how the memory is faulted in, never its
    contents. Returns whether the advice was given (False: too small, not Linux, no libc
    ``madvise``, THP not built in, or a VM reporting free pages to its host, where huge pages
    cost more than they save: :func:`free_pages_reported`); never raises."""
    global _madvise
    if nbytes < HUGE_MIN or not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    if _madvise is None and free_pages_reported():
        log.info("free page reporting to the hypervisor is on: load destinations stay in 4 KiB pages")
        _madvise = False
    if _madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    if _madvise is False:
        return False
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return end > start and _madvise(start, end - start, mmap.MADV_HUGEPAGE) == 0


def is_whole(ri: ReadItem, rec: ItemRecord) -> bool:
    return all(o == 0 for o in ri.storage_offsets) and tuple(ri.lengths) == tuple(rec.shape)


def direct_ok(t: torch.Tensor, rec: ItemRecord) -> bool:
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and str(t.dtype).removeprefix("torch.") == rec.dtype
        and tuple(t.shape) == tuple(rec.shape)
        and t.numel() * t.element_size() == rec.length
        and rec.length > 0
    )


def bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
