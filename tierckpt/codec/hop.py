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
4. frames go to ``dst.open_stream(key)`` in order; its close makes the object visible;
5. every frame that was copied rather than coded here is read back from the new object (ranged
   reads of at most :data:`VERIFY_CHUNK` stored bytes, on the same pool), decoded and hashed:
   the copy is proven to hold what the local data encodes to, never assumed from ``prev``'s
   index (``prev``'s object may have been damaged, truncated or deleted since its commit).

A copy that fails (:class:`~tierckpt.tiers.streams.CopySourceError`: the source is missing,
short or unreadable) makes the object be written again without copying; frames whose read-back
does not match make it be written again with those frames coded and uploaded (after a second
such attempt, with nothing copied). Each is logged (WARNING) naming the source object; neither
fails the copy. Every uploaded byte is checked by the tier itself (S3: the CRC32C of every
part, the size of the completed object).

Memory: ``2 * threads + 3`` logical frames (read buffers reused round robin) and as many
coded frames (output buffers reused the same way: frames are coded in place, not copied out),
plus ``threads`` read-back chunks while verifying. Any other failure aborts the stream: nothing
is visible under the key. Returns the :class:`~tierckpt.codec.index.StoredFile` that the hop
records in ``dst``'s metadata, and the figures of the copy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..background import lower_priority
from ..errors import CorruptCheckpoint, TierckptError
from ..format.jsonvalues import DTYPE_SIZES
from ..format.stored import StoredFile, frame_hash
from ..tiers.base import Encoding, Tier
from ..tiers.streams import CopySourceError
from .frames import decode_into, encode_into, segments_of, stored_bound

__all__ = ["Previous", "CopyFigures", "copy_encoded", "width_runs", "codec_threads", "VERIFY_CHUNK"]

log = logging.getLogger("tierckpt.codec")

VERIFY_CHUNK = 16 << 20
"""Most stored bytes read back in one request when copied frames are checked."""


@dataclass
class Previous:
    """The same rank's file in the previous checkpoint committed on the destination tier."""

    checkpoint_id: str
    key: str
    index: StoredFile


@dataclass
class CopyFigures:
    """What one encoded copy did: logical and stored bytes, bytes sent, bytes the server copied,
    frames copied, CPU seconds spent coding, stored bytes read back to check the copied frames,
    frames found not to match (and uploaded instead). ``uploaded``, ``copied`` and the CPU
    seconds count every attempt; ``stored`` and ``frames_copied`` the object committed."""

    logical: int = 0
    stored: int = 0
    uploaded: int = 0
    copied: int = 0
    frames_copied: int = 0
    compress_cpu_s: float = 0.0
    verified: int = 0
    frames_refused: int = 0


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
_cpu_lock = threading.Lock()


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
    module docstring says. Called on the hop's thread; blocks until the object is complete on
    ``dst`` and every copied frame of it was read back and matched; raises (nothing visible) on
    failure. A copy source that fails or does not match never fails the call: see the module
    docstring."""
    usable = (
        prev
        if encoding.copy_unchanged
        and prev is not None
        and prev.index.frame == frame
        and prev.index.codec == encoding.compression
        else None
    )
    figs = CopyFigures(logical=size)
    refused: set[int] = set()  # frames not to copy: their copy did not match
    attempts = 0
    while True:
        try:
            idx, copied = _write(src, dst, key, size, frame, runs, encoding, usable, refused, nice, figs)
        except CopySourceError as e:
            if usable is None:
                raise
            log.warning(
                "%s/%s: frames unchanged since %s cannot be copied from %s/%s (%s); uploading them instead",
                dst.url,
                key,
                usable.checkpoint_id,
                dst.url,
                usable.key,
                e,
            )
            usable = None
            continue
        bad = _verify_copied(dst, key, idx, copied, nice, figs) if copied else []
        if not bad:
            break
        assert usable is not None
        attempts += 1
        figs.frames_refused += len(bad)
        log.warning(
            "%s/%s: %d of %d frame(s) copied from %s/%s (checkpoint %s) do not match the data being copied "
            "(frames %s); writing it again with %s uploaded",
            dst.url,
            key,
            len(bad),
            len(copied),
            dst.url,
            usable.key,
            usable.checkpoint_id,
            _ranges(bad),
            "them" if attempts < 2 else "every frame",
        )
        refused.update(bad)
        if attempts >= 2:
            usable = None
    figs.stored = idx.stored if idx.frames else 0
    figs.frames_copied = len(copied)
    return idx, figs


def _ranges(frames: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"`` (at most a few runs, for a log line)."""
    out: list[str] = []
    for i in frames:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out[:8]) + (f", ... ({len(out)} runs)" if len(out) > 8 else "")


def _verify_copied(dst: Tier, key: str, idx: StoredFile, frames: list[int], nice: int, figs: CopyFigures) -> list[int]:
    """The frames among ``frames`` (sorted) whose stored bytes in ``dst``'s object ``key`` do not
    decode to bytes of the hash ``idx`` records (the hash of the source tier's data): read back
    in chunks of at most :data:`VERIFY_CHUNK` bytes, decoded and hashed on the codec pool. A
    chunk that cannot be read counts as not matching (its frames are then uploaded)."""
    o = idx.offsets
    chunks: list[list[int]] = []
    for i in frames:
        last = chunks[-1] if chunks else None
        if last is not None and i == last[-1] + 1 and o[i + 1] - o[last[0]] <= VERIFY_CHUNK:
            last.append(i)
        else:
            chunks.append([i])
    where = f"{dst.url}/{key}"

    def check(ch: list[int]) -> tuple[list[int], int]:
        a, b = o[ch[0]], o[ch[-1] + 1]
        stored = bytearray(b - a)
        try:
            dst.read_into(key, a, memoryview(stored))
        except TierckptError as e:
            log.warning("%s: cannot read back stored bytes [%d, %d) to check them: %s", where, a, b, e)
            return ch, 0
        out = None if idx.plain else bytearray(idx.frame)
        bad = []
        for i in ch:
            sv = memoryview(stored)[o[i] - a : o[i + 1] - a]
            lo, hi = idx.span(i)
            if out is not None:
                logical = memoryview(out)[: hi - lo]
                try:
                    decode_into(sv, logical, f"{where} frame {i}")
                except CorruptCheckpoint:
                    bad.append(i)
                    continue
                sv = logical
            if frame_hash(sv) != idx.hashes[i]:
                bad.append(i)
        return bad, b - a

    pool = _codec_pool(nice)
    window = codec_threads() + 1
    running: deque[Future[tuple[list[int], int]]] = deque()
    bad: list[int] = []
    try:
        for ch in chunks:
            running.append(pool.submit(check, ch))
            while len(running) >= window:
                got, n = running.popleft().result()
                bad += got
                figs.verified += n
        while running:
            got, n = running.popleft().result()
            bad += got
            figs.verified += n
    finally:
        for f in running:
            f.cancel()
    return sorted(bad)


def _write(
    src: Tier,
    dst: Tier,
    key: str,
    size: int,
    frame: int,
    runs: list[tuple[int, int, int]],
    encoding: Encoding,
    usable: Previous | None,
    refused: set[int],
    nice: int,
    figs: CopyFigures,
) -> tuple[StoredFile, list[int]]:
    """One attempt of :func:`copy_encoded`: the object written, frames equal to ``usable``'s
    (except ``refused``) copied; returns its index and the frames copied. ``figs`` gathers the
    bytes sent and copied and the CPU spent."""
    zstd = encoding.compression == "zstd"
    level = encoding.level
    n = -(-size // frame) if size else 0
    copied: list[int] = []
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
        with _cpu_lock:  # one lock for every attempt: a failed one's coding may still be finishing
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
            copied.append(i)
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
                and i not in refused
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
    finally:
        figs.uploaded += stream.uploaded
        figs.copied += stream.copied
    return StoredFile(encoding.compression, frame, size, sizes, hashes, level if zstd else 0), copied
