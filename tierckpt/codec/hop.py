"""The encoded copy of one data file down the chain (the write side of :mod:`tierckpt.codec`).

:func:`copy_encoded` is called by the hop (:mod:`tierckpt.replicate`) on its thread, once per data
file, instead of :meth:`Tier.copy_from <tierckpt.tiers.base.Tier.copy_from>` when the destination
has an :attr:`~tierckpt.tiers.base.Tier.encoding`:

1. the calling thread reads the file from ``src`` frame by frame (:func:`tierckpt.codec.frame_size`)
   and hashes each frame (xxh3_128);
2. a frame whose hash equals the same frame of ``prev`` (the same rank's file in the previous
   checkpoint on ``dst``, same frame grid and codec) is not coded: its stored bytes are copied
   from ``prev``'s object by the tier (runs of them become ``UploadPartCopy`` parts on S3);
3. the other frames are coded (:func:`tierckpt.codec.frames.encode`, ``compression = "zstd"``)
   on a shared pool of background threads (``[job] background_nice``), at most a few frames
   ahead of the stream, or stored as they are (``"none"``);
4. frames go to ``dst.open_stream(key)`` in order; its close makes the object visible.

Memory: ``2 * threads + 3`` logical frames (read buffers reused round robin) and as many
coded frames (output buffers reused the same way: frames are coded in place, not copied out). Any failure aborts the
stream: nothing is visible under the key. Returns the :class:`~tierckpt.codec.index.StoredFile`
that the hop records in ``dst``'s metadata, and the figures of the copy.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..background import lower_priority
from ..format.jsonvalues import DTYPE_SIZES
from ..format.stored import StoredFile, frame_hash
from ..tiers.base import Encoding, Tier
from .frames import encode_into, segments_of, stored_bound

__all__ = ["Previous", "CopyFigures", "copy_encoded", "width_runs", "codec_threads"]


@dataclass
class Previous:
    """The same rank's file in the previous checkpoint committed on the destination tier."""

    checkpoint_id: str
    key: str
    index: StoredFile


@dataclass
class CopyFigures:
    """What one encoded copy did: logical and stored bytes, bytes sent, bytes the server copied,
    frames copied, CPU seconds spent coding."""

    logical: int = 0
    stored: int = 0
    uploaded: int = 0
    copied: int = 0
    frames_copied: int = 0
    compress_cpu_s: float = 0.0


def width_runs(items: list[tuple[int, int, str]]) -> list[tuple[int, int, int]]:
    """(start, end, plane width) of a file's items, from (pos, padded length, dtype) triples:
    the element size for tensors (a complex type's component size), 1 for serialized objects."""
    out = []
    for pos, n, dtype in sorted(items):
        size = DTYPE_SIZES.get(dtype, 1) if dtype else 1
        if dtype.startswith("complex"):
            size //= 2
        out.append((pos, pos + n, min(size, 8)))
    return out


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def codec_threads() -> int:
    """Threads coding frames in this process (shared by every copy): half the CPUs, 1 to 4."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def _codec_pool(nice: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                codec_threads(), thread_name_prefix="tierckpt-codec", initializer=lower_priority, initargs=(nice,)
            )
        return _pool


def copy_encoded(
    src: Tier,
    dst: Tier,
    key: str,
    *,
    size: int,
    frame: int,
    runs: list[tuple[int, int, int]],
    encoding: Encoding,
    prev: Previous | None = None,
    nice: int = 0,
) -> tuple[StoredFile, CopyFigures]:
    """Copy data file ``key`` (``size`` logical bytes) from ``src`` to ``dst``, encoded as the
    module docstring says. Blocks until the object is complete on ``dst``; raises (nothing
    visible) on failure."""
    zstd = encoding.compression == "zstd"
    level = encoding.level
    usable = (
        prev
        if encoding.copy_unchanged
        and prev is not None
        and prev.index.frame == frame
        and prev.index.codec == encoding.compression
        else None
    )
    n = -(-size // frame) if size else 0
    figs = CopyFigures(logical=size)
    cpu_lock = threading.Lock()
    pool = _codec_pool(nice) if zstd else None
    ahead = 2 * (codec_threads() if zstd else 1) + 2
    # Read buffers, reused round robin: frame i's buffer is next used by frame i + len(ring), read
    # only after frame i left ``pending`` (at most ``ahead - 1`` frames wait there), so its coding
    # has finished. Fresh memory per frame would be first-touched each time.
    ring = [bytearray(min(frame, size)) for _ in range(min(n, ahead + 1))]
    # Coded frames, in buffers reused the same way: frame i's is appended to the stream (which
    # copies or writes it before returning) before frame i + len(ring) is submitted.
    outs: list[bytearray] = [bytearray() for _ in ring] if zstd else []
    sizes: list[int] = [0] * n
    hashes: list[bytes] = [b""] * n
    stream = dst.open_stream(key, size)
    # pending: ("data", i, Future|bytes) or ("copy", i, (start, end)) in file order
    pending: deque[tuple[str, int, Any]] = deque()
    run: list[int] = []  # [start, end) of a run of copied bytes in prev's object

    def coded(data: memoryview, segs: list[tuple[int, int]], slot: int) -> memoryview:
        t0 = time.thread_time()
        need = stored_bound(len(data), segs)
        if len(outs[slot]) < need:
            outs[slot] = bytearray(need)
        out = memoryview(outs[slot])[: encode_into(data, segs, level, outs[slot])]
        with cpu_lock:
            figs.compress_cpu_s += time.thread_time() - t0
        return out

    def emit_one() -> None:
        kind, i, what = pending.popleft()
        if kind == "copy":
            s, e = what
            if run and run[1] == s:
                run[1] = e
            else:
                flush_run()
                run[:] = [s, e]
            sizes[i] = e - s
            figs.frames_copied += 1
            return
        flush_run()
        data = what.result() if isinstance(what, Future) else what
        sizes[i] = len(data)
        stream.append(data)

    def flush_run() -> None:
        if run:
            assert usable is not None
            stream.append_copy(usable.key, run[0], run[1])
            run.clear()

    try:
        for i in range(n):
            a, b = i * frame, min(size, (i + 1) * frame)
            buf = memoryview(ring[i % len(ring)])[: b - a]
            src.read_into(key, a, buf)
            h = hashes[i] = frame_hash(buf)
            if (
                usable is not None
                and i < usable.index.frames
                and usable.index.span(i) == (a, b)
                and usable.index.hashes[i] == h
            ):
                o = usable.index.offsets
                pending.append(("copy", i, (o[i], o[i + 1])))
            elif zstd:
                assert pool is not None
                pending.append(("data", i, pool.submit(coded, buf, segments_of(a, b, runs), i % len(ring))))
            else:  # the read buffer itself: reused only after this frame was appended
                pending.append(("data", i, buf))
            while len(pending) >= ahead:
                emit_one()
        while pending:
            emit_one()
        flush_run()
        stream.close()
    except BaseException:
        for kind, _i, what in pending:
            if kind == "data" and isinstance(what, Future):
                what.cancel()
        stream.abort()
        raise
    idx = StoredFile(encoding.compression, frame, size, sizes, hashes, level if zstd else 0)
    figs.stored, figs.uploaded, figs.copied = idx.stored if n else 0, stream.uploaded, stream.copied
    return idx, figs
