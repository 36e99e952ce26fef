"""Byte planes of a run of fixed-width elements: the split the encoder does and the merge the decoder does.

Plane ``j`` of ``count`` elements of ``w`` bytes holds byte ``j`` (little endian) of every
element. :func:`split` and :func:`merge` are the hot loops of :mod:`tierckpt.codec.frames`;
both are numpy shifts and narrowing/widening copies on a little-endian integer view of the
bytes (``x >> 8*j`` then a ``uint8`` cast), which numpy runs as vectorized loops, 2-3x faster
here than a strided ``reshape(count, w).T.copy()``. Width 8 (fp64/int64, rare in checkpoints)
uses strided row copies.

Scratch memory is per thread and reused from frame to frame (a fresh allocation per frame is
first-touched every time, which costs as much as the split itself): the planes :func:`split`
returns are a view of that scratch, valid until the calling thread's next :func:`split`.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["merge", "scratch", "split"]

_local = threading.local()
_WORD: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def scratch(name: str, count: int, dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """A per-thread buffer of at least ``count`` elements of ``dtype`` named ``name``, reused by
    later calls on the same thread (grown when too small); its contents are undefined."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    dt = np.dtype(dtype)
    b = bufs.get(name)
    if b is None or b.dtype != dt or len(b) < count:
        b = bufs[name] = np.empty(max(count, 1), dt)
    return b[:count]


def split(group: np.ndarray, w: int, dst: np.ndarray | None = None, pair: bool = False) -> np.ndarray:
    """The ``(w, count)`` byte planes of ``group`` (contiguous ``uint8``, ``count * w`` bytes),
    written into ``dst`` (``count * w`` bytes, not overlapping ``group``) or, without it, into
    this thread's scratch (see the module docstring). ``pair`` (width 4 only): planes 0 and 1
    are written as one run of the elements' low 16-bit halves (little endian, ``2 * count``
    bytes), then planes 2 and 3: one pass fewer, for low planes kept raw anyway."""
    count = len(group) // w
    if pair:
        if w != 4:
            raise ValueError(f"paired low planes need 4-byte elements, not {w}")
        out = (scratch("planes", w * count) if dst is None else dst[: w * count]).reshape(w, count)
        x = group.view(_WORD[4])
        np.copyto(out[:2].reshape(-1).view(_WORD[2]), x, casting="unsafe")  # the low halves
        np.right_shift(x, 16, out=out[2], casting="unsafe")
        np.right_shift(x, 24, out=out[3], casting="unsafe")
        return out
    if w == 1 and dst is None:
        return group.reshape(1, count)
    out = (scratch("planes", w * count) if dst is None else dst[: w * count]).reshape(w, count)
    if w == 1:
        out[0] = group
        return out
    if w == 8:
        rows = group.reshape(count, 8)
        for j in range(8):
            out[j] = rows[:, j]
        return out
    x = group.view(_WORD[w])
    np.copyto(out[0], x, casting="unsafe")  # the low byte: a narrowing cast keeps it
    for j in range(1, w):
        # shift in the word type, narrowed into the plane by the ufunc's own small buffer: one
        # pass over memory instead of a shift into a scratch word array and a narrowing copy
        np.right_shift(x, 8 * j, out=out[j], casting="unsafe")
    return out


def merge(planes: list[np.ndarray], w: int, dst: np.ndarray) -> None:
    """Write the elements whose byte planes are ``planes`` (``w`` arrays of ``count`` bytes) into
    ``dst`` (contiguous ``uint8``, ``count * w`` bytes): the inverse of :func:`split`. Width 4
    also takes three arrays: the low 16-bit halves (``2 * count`` bytes), planes 2 and 3 (the
    inverse of ``split(..., pair=True)``)."""
    count = len(dst) // w
    if w == 4 and len(planes) == 3:
        o = dst.view(_WORD[4])
        np.left_shift(planes[2], 8, out=o, dtype=o.dtype)  # widening and shift in one pass
        np.bitwise_or(o, planes[1], out=o)
        np.left_shift(o, 16, out=o)
        np.bitwise_or(o, planes[0].view(_WORD[2]), out=o)
        return
    if w == 1:
        dst[:] = planes[0]
        return
    if w == 8:
        rows = dst.reshape(count, 8)
        for j in range(8):
            rows[:, j] = planes[j]
        return
    o = dst.view(_WORD[w])
    if w == 2:  # widening and shift in one pass (the ufunc casts the plane in its own small buffer)
        np.left_shift(planes[1], 8, out=o, dtype=o.dtype)
        np.bitwise_or(o, planes[0], out=o)
        return
    np.copyto(o, planes[w - 1])  # widening copy, then shift in the lower planes
    for j in range(w - 2, -1, -1):
        np.left_shift(o, 8, out=o)
        np.bitwise_or(o, planes[j], out=o)
