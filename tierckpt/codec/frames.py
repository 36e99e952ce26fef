"""One frame of a stored file: a few MiB of a data file, coded on its own (byte planes + zstd).

A frame is what the encoded hop stores for one piece ``[i * frame, (i + 1) * frame)`` of a data
file (:mod:`tierckpt.codec`). Its bytes are *segments* (runs of one item type, see
:func:`segments_of`), each with a plane *width*: the item's element size (2 for bf16/fp16, 4 for
fp32, 8 for fp64/int64, the component size for complex types, 1 for bytes, bool and serialized
objects). The encoder groups the frame's bytes by width and splits each group into byte planes
(plane ``j`` holds byte ``j`` of every element); the exponent planes of floating point data are
highly compressible, the low mantissa planes are not. Each plane is coded with zstd (at levels
<= 1 literal-only: Huffman-coded bytes, no match search, see :func:`_entropy_coder`), or kept raw
when a sample of it does not compress (so incompressible planes cost no coder CPU) or when its
coded form is not smaller.

Format (little endian), versions 1 and 2::

    b"\\x00" + the raw bytes                          (nothing compressed: kept as it was)
    b"\\x01"  u32 nseg  nseg * (u32 length, u8 width)  u8 nstream  nstream * (u8 kind, u32 size)
          then the streams' bytes, in order            kind: 0 raw, 1 zstd frame
    b"\\x02"  the same, and stream kind 2               (version 2)

Streams come per width in order of first appearance among the segments, planes ``0..width-1``
(one stream for width 1). In version 2 a width-4 group may begin with one stream of kind 2 in
place of planes 0 and 1: the elements' low 16-bit halves, raw (``2 * count`` bytes, little
endian), then planes 2 and 3. The encoder writes it where both low planes would be kept raw
(their samples do not shrink, the usual case for fp32 mantissas): the same stored bytes as two
raw planes and one stream head fewer, split and merged with one pass fewer (measured 0.93 ->
0.69-0.78 ms and 1.16 -> 0.85 ms per 4 MiB, one-off script on this VM, out of cache). A frame
without such a group is version 1, byte for byte what earlier releases wrote; both versions
decode, and readers older than version 2 refuse version-2 frames as corrupt ("unknown frame
kind 2"), so a reader must be at least as new as the writer.

A frame decodes on its own (:func:`decode_into`), with no other input than its logical length, which the stored index gives: ranged reads, resumable fetches and
parallel loads decode only the frames they touch. Every coder writes ordinary zstd frames (stream
kind 1), which python-zstandard decodes whatever parameters made them: the coder is not recorded
and needs not be. The zstd modules release the GIL while they code; the plane shuffles are numpy
copies.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import CorruptCheckpoint
from .planes import merge, scratch, split

__all__ = ["PROBE", "decode_into", "encode", "encode_into", "segments_of", "stored_bound"]

PROBE = 64 << 10
"""Bytes of a plane coded first: a plane whose sample shrinks by less than 5% is kept raw."""
KEEP = 0.95
"""A plane is coded only when its sample's coded size is at most this fraction of the sample.
Coding a plane costs about 1.2 ms of CPU per MB here (literal-only); a plane that would shrink
by a few percent is not worth it (torchtitan's ``exp_avg_sq``, second plane: samples 2.2-3.4%
smaller, whole planes 1.1-1.5%; coding them cost that category a fifth of its compression
speed for 0.2% of its ratio). 0.98 before."""
PLANE_PARAMS = {"window_log": 17, "hash_log": 6, "chain_log": 6, "search_log": 1, "min_match": 7, "target_length": 0}
"""zstd parameters (strategy "fast") for byte planes of wider elements at ``compression_level``
<= 1 when the literal-only coder (:func:`_entropy_coder`) is not available: a 64-entry match
table and 7-byte minimum matches make zstd nearly an order-0 entropy coder (Huffman-coded
literals in 128 KiB blocks). The decoder needs nothing to know: any zstd frame decodes the same
way."""
LITERAL_COMPRESSION_MODE = 1002
"""zstd's ``ZSTD_c_literalCompressionMode`` (``ZSTD_c_experimentalParam5`` in ``zstd.h``, the same
number in the zstd 1.5.7 these modules bundle); its value 1 (``ZSTD_ps_enable``) Huffman-codes literals even where the
strategy would leave them raw."""
_SEG = struct.Struct("<IB")
_STREAM = struct.Struct("<BI")
_U32 = struct.Struct("<I")
_U4 = np.dtype("<u4")

_local = threading.local()  # zstd (de)compressor objects are not thread-safe: one set per thread


def _zstd():
    import zstandard

    return zstandard


def _entropy_coder() -> Callable[[Any], bytes] | None:
    """A literal-only zstd coder for byte planes: every block is Huffman-coded literals, with no
    match search and no sequences (strategy "fast" with a step past the block end, which alone
    would leave literals raw, and ``literalCompressionMode`` on). Exponent planes are close to
    order-0 sources; measured on real state this codes them 1.3x faster than :data:`PLANE_PARAMS`
    (2.6x on ``exp_avg_sq``, whose low-entropy plane made zstd find many short matches), decodes
    them 1.05-2x faster, at the same ratio (``exp_avg_sq``'s plane 2.4% larger).

    Through the standard library's ``compression.zstd`` (Python 3.14+) or its backport
    (``backports.zstd``): python-zstandard accepts only zstd's stable parameters, while these
    take zstd's parameter numbers and release the GIL while they code. Its output is an ordinary
    zstd frame (decoded by python-zstandard, faster here). None when neither module is there or
    the library refuses the parameter: :func:`_compressor` then uses :data:`PLANE_PARAMS`."""
    try:
        try:
            from compression import zstd as zs  # type: ignore[import-not-found]  # Python 3.14+
        except ImportError:
            from backports import zstd as zs  # type: ignore[import-not-found,no-redef]
        p = zs.CompressionParameter
        c = zs.ZstdCompressor(
            options={
                p.strategy: zs.Strategy.fast,
                p.window_log: 17,  # 128 KiB blocks, each with its Huffman table
                p.hash_log: 6,
                p.chain_log: 6,
                p.search_log: 1,
                p.min_match: 7,
                p.target_length: 1 << 17,  # zstd's largest: the match search steps past the block
                LITERAL_COMPRESSION_MODE: 1,
            }
        )
        end = zs.ZstdCompressor.FLUSH_FRAME
        c.compress(b"\x00" * 64, end)  # refused parameters fail here, not on a frame
    except Exception:  # noqa: BLE001 - no module, or a zstd that refuses the parameter: fall back
        return None
    return lambda b: c.compress(b, end)


def _compressor(level: int, entropy: bool = False) -> Callable[[Any], bytes]:
    """This thread's coder for ``level``; ``entropy``: for a byte plane of wider elements
    (literal-only at levels <= 1, see :func:`_entropy_coder`)."""
    cs = getattr(_local, "compressors", None)
    if cs is None:
        cs = _local.compressors = {}
    key = (level, entropy and level <= 1)
    c = cs.get(key)
    if c is None:
        z = _zstd()
        if key[1]:
            c = _entropy_coder()
            if c is None:
                c = z.ZstdCompressor(
                    compression_params=z.ZstdCompressionParameters(**PLANE_PARAMS, strategy=z.STRATEGY_FAST)
                ).compress
        else:
            c = z.ZstdCompressor(level=level).compress
        cs[key] = c
    return c


def _decompressor():
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = _zstd().ZstdDecompressor()
    return d


def segments_of(start: int, end: int, runs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The (length, width) segments of bytes ``[start, end)`` given a file's width ``runs``
    ((start, end, width), sorted, disjoint); bytes no run covers have width 1. Adjacent segments
    of one width are merged; a segment's length need not be a multiple of its width."""
    out: list[tuple[int, int]] = []
    at = start

    def add(n: int, w: int) -> None:
        if n <= 0:
            return
        if out and out[-1][1] == w:
            out[-1] = (out[-1][0] + n, w)
        else:
            out.append((n, w))

    import bisect

    i = max(0, bisect.bisect_right(runs, (start, 1 << 62, 0)) - 1)
    while at < end and i < len(runs):
        s, e, w = runs[i]
        if e <= at:
            i += 1
            continue
        if s >= end:
            break
        if s > at:
            add(s - at, 1)
            at = s
        stop = min(e, end)
        add(stop - at, w)
        at = stop
        i += 1
    add(end - at, 1)
    return out


def _plan(segs: list[tuple[int, int]]) -> list[tuple[int, list[tuple[int, int]], int]]:
    """Per width (first appearance order): the (offset, length) pieces of the frame, and the
    element count of the group (a piece's tail that is not a whole element goes to width 1)."""
    groups: dict[int, list[tuple[int, int]]] = {}
    at = 0
    for n, w in segs:
        whole = n - n % w
        if whole:
            groups.setdefault(w, []).append((at, whole))
        if n - whole:
            groups.setdefault(1, []).append((at + whole, n - whole))
        at += n
    return [(w, pieces, sum(n for _, n in pieces) // w) for w, pieces in groups.items()]


def _gather(a: np.ndarray, pieces: list[tuple[int, int]]) -> np.ndarray:
    if len(pieces) == 1:
        s, n = pieces[0]
        return a[s : s + n]
    out = scratch("gather", sum(n for _, n in pieces))
    at = 0
    for s, n in pieces:
        out[at : at + n] = a[s : s + n]
        at += n
    return out


def _code(
    out: np.ndarray,
    src: int,
    count: int,
    at: int,
    level: int,
    entropy: bool,
    probe: bool = True,
    shrinks: bool | None = None,
) -> tuple[int, int]:
    """Code the plane at ``out[src:src + count]`` and leave its stream at ``out[at:]`` (``at <=
    src``; the bytes after ``src + count`` are not touched): (kind, stream size). ``entropy``: a
    byte plane of wider elements, coded literal-only at levels <= 1 (:func:`_compressor`).
    ``probe``: a large plane is first sampled (:data:`PROBE`) and kept raw, uncoded, when the
    sample does not shrink; without it the plane is coded at once (the top plane of a width,
    sign and exponent bits or the high bytes of integers, which compresses: a sample of it
    would be coded twice). ``shrinks``: the sample's verdict, when the caller has it already."""
    plane = out[src : src + count]
    c = _compressor(level, entropy)
    coded = None
    if shrinks is not None:
        coded = c(plane) if shrinks else None
    elif probe and count >= 4 * PROBE:
        mid = count // 2
        if len(c(plane[mid : mid + PROBE])) <= KEEP * PROBE:
            coded = c(plane)
    else:
        coded = c(plane)
    if coded is not None and len(coded) < count:
        out[at : at + len(coded)] = np.frombuffer(coded, dtype=np.uint8)
        return 1, len(coded)
    if at != src:  # a coded plane before this one: move it down (numpy buffers the overlap)
        out[at : at + count] = plane
    return 0, count


def _head(segs: list[tuple[int, int]], nstream: int) -> int:
    return 1 + 4 + _SEG.size * len(segs) + 1 + _STREAM.size * nstream


def stored_bound(n: int, segs: list[tuple[int, int]]) -> int:
    """The room :func:`encode_into` needs for a frame of ``n`` logical bytes cut into ``segs``
    (the frame is built in place, its header before its planes); the stored frame itself is at
    most ``n + 1`` bytes."""
    return n + max(1, _head(segs, sum(w for w, _, _ in _plan(segs))))


def encode(data: memoryview | bytes | bytearray | np.ndarray, segs: list[tuple[int, int]], level: int = 1) -> bytes:
    """The stored form of one frame: ``data`` (its logical bytes) cut into ``segs`` ((length,
    width), summing to ``len(data)``), coded as the module docstring says. A copy of what
    :func:`encode_into` builds in this thread's scratch (callers that can reuse a buffer of
    their own, as the hop does, call :func:`encode_into` and skip the copy)."""
    n = data.nbytes if isinstance(data, np.ndarray) else memoryview(data).nbytes
    out = scratch("frame", stored_bound(n, segs))
    return out[: encode_into(data, segs, level, out)].tobytes()


def encode_into(
    data: memoryview | bytes | bytearray | np.ndarray,
    segs: list[tuple[int, int]],
    level: int,
    dst: np.ndarray | bytearray | memoryview,
) -> int:
    """Code one frame as :func:`encode` does, into ``dst`` (writable, at least
    :func:`stored_bound` bytes, not overlapping ``data``); returns the stored size: the frame is
    ``dst[:size]``, the rest of ``dst`` is undefined."""
    a = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    if sum(n for n, _ in segs) != len(a):
        raise ValueError(f"segments cover {sum(n for n, _ in segs)} bytes of a {len(a)}-byte frame")
    out = dst if isinstance(dst, np.ndarray) else np.frombuffer(dst, dtype=np.uint8)
    plan = _plan(segs)
    nstream = sum(w for w, _, _ in plan)
    head = _head(segs, nstream)
    if len(out) < len(a) + max(1, head):
        raise ValueError(f"{len(out)} bytes of room for a frame of {len(a)} bytes, {len(a) + max(1, head)} needed")
    if nstream > 255 or head >= len(a):
        return _raw(a, out)
    # Width-4 groups large enough to be sampled: the samples of planes 0 and 1 first (the test
    # _code would make). When neither shrinks, both planes are kept raw, and the group is split
    # with them as one run of 16-bit halves (stream kind 2, frame version 2): the same stored
    # bytes, one pass fewer each way.
    low = [
        _low_samples(a, pieces, count, level) if w == 4 and count >= 4 * PROBE else None for w, pieces, count in plan
    ]
    pairs = [v is not None and not any(v) for v in low]
    nstream -= sum(pairs)
    head = _head(segs, nstream)
    # The coded form is built in place: each group is split into planes right where its streams
    # go, a raw plane stays where it is (or moves down past the coded planes before it), a coded
    # one is written over its own plane.
    kinds: list[tuple[int, int]] = []
    at = head
    for (w, pieces, count), pair, v in zip(plan, pairs, low):
        base = at
        split(_gather(a, pieces), w, out[base : base + w * count], pair)
        first = 0
        if pair:  # planes 0 and 1, kept raw where the split put them (a group starts at ``at``)
            kinds.append((2, 2 * count))
            at += 2 * count
            first = 2
        for j in range(first, w):
            kind, size = _code(
                out, base + j * count, count, at, level, w > 1, j < w - 1, v[j] if v is not None and j < 2 else None
            )
            kinds.append((kind, size))
            at += size
    if at >= 1 + len(a):
        return _raw(a, out)
    hv = out[:head].data  # a writable memoryview of the frame's header
    hv[0] = 2 if any(pairs) else 1
    _U32.pack_into(hv, 1, len(segs))
    p = 5
    for n, w in segs:
        _SEG.pack_into(hv, p, n, w)
        p += _SEG.size
    hv[p] = nstream
    p += 1
    for kind, size in kinds:
        _STREAM.pack_into(hv, p, kind, size)
        p += _STREAM.size
    return at


def _low_samples(a: np.ndarray, pieces: list[tuple[int, int]], count: int, level: int) -> tuple[bool, bool]:
    """Whether the samples of planes 0 and 1 of a width-4 group (``pieces`` of ``a``, ``count``
    elements) shrink: elements ``[count // 2, count // 2 + PROBE)``, the ones :func:`_code`
    would sample from each plane."""
    start, n = 4 * (count // 2), 4 * PROBE
    if len(pieces) == 1:
        s0 = pieces[0][0]
        x = a[s0 + start : s0 + start + n]
    else:  # the sample's bytes, gathered across the pieces
        x = scratch("sample", n)
        at = got = 0
        for s0, ln in pieces:
            lo, hi = max(start, at), min(start + n, at + ln)
            if lo < hi:
                x[got : got + hi - lo] = a[s0 + lo - at : s0 + hi - at]
                got += hi - lo
            at += ln
    w = x.view(_U4)
    p = scratch("probe", PROBE)
    c = _compressor(level, True)
    np.copyto(p, w, casting="unsafe")
    s0_ = len(c(p)) <= KEEP * PROBE
    np.right_shift(w, 8, out=p, casting="unsafe")
    return s0_, len(c(p)) <= KEEP * PROBE


def _raw(a: np.ndarray, out: np.ndarray) -> int:
    out[0] = 0
    out[1 : 1 + len(a)] = a
    return 1 + len(a)


def _inflate(d: Any, body: memoryview, count: int) -> np.ndarray:
    """The ``count`` bytes of one zstd stream (stream kind 1), never more memory than ``count``.

    python-zstandard sizes its output by the content size the frame header records and ignores
    ``max_output_size`` then: a stream of a few KiB whose header says 1 GiB (RLE blocks) would
    be inflated whole before its size is found wrong. So the recorded size is checked first
    (every coder here records it: one-shot compression); a frame without one is decoded into a
    buffer of ``count`` bytes (``max_output_size``), and one that needs more fails there. Bytes
    after the frame are refused too (``allow_extra_data``). Raises ``ValueError`` or
    ``zstandard.ZstdError``; :func:`decode_into` turns both into :class:`CorruptCheckpoint`."""
    declared = _zstd().frame_content_size(body)  # -1: not recorded; raises on a malformed header
    if declared >= 0 and declared != count:
        raise ValueError(f"a zstd stream declaring {declared} bytes for a plane of {count}")
    return np.frombuffer(d.decompress(body, max_output_size=count, allow_extra_data=False), dtype=np.uint8)


def decode_into(stored: memoryview | bytes, out: memoryview, where: str) -> None:
    """Decode one stored frame into ``out`` (exactly its logical length); raises
    :class:`CorruptCheckpoint` naming ``where`` when the frame is malformed or does not decode to
    ``len(out)`` bytes (callers check the CRC32C of the result as well). Memory: ``len(out)`` and
    the frame's bytes, whatever the frame's headers claim (:func:`_inflate`)."""
    s = memoryview(stored).cast("B")
    n = len(out)
    if not len(s):
        raise CorruptCheckpoint(f"{where}: empty frame")
    if s[0] == 0:
        if len(s) != n + 1:
            raise CorruptCheckpoint(f"{where}: raw frame of {len(s) - 1} bytes, expected {n}")
        out[:] = s[1:]
        return
    version = s[0]
    if version not in (1, 2):
        raise CorruptCheckpoint(f"{where}: unknown frame kind {version}")
    try:
        nseg = _U32.unpack_from(s, 1)[0]
        at = 5
        if nseg > n + 1:
            raise ValueError(f"{nseg} segments")
        segs = [_SEG.unpack_from(s, at + k * _SEG.size) for k in range(nseg)]
        at += _SEG.size * nseg
        nstream = s[at]
        at += 1
        heads = [_STREAM.unpack_from(s, at + k * _STREAM.size) for k in range(nstream)]
        at += _STREAM.size * nstream
        if sum(ln for ln, _ in segs) != n or any(w not in (1, 2, 4, 8) for _, w in segs):
            raise ValueError("segments do not match the frame")
        plan = _plan(segs)
        if version == 1 and nstream != sum(w for w, _, _ in plan):
            raise ValueError("stream count does not match the segments")
        dst = np.frombuffer(out, dtype=np.uint8)
        k = 0
        d = _decompressor()
        for w, pieces, count in plan:
            planes = []
            j = 0
            while j < w:
                if k >= nstream:
                    raise ValueError("stream count does not match the segments")
                kind, size = heads[k]
                k += 1
                body = s[at : at + size]
                at += size
                if len(body) != size:
                    raise ValueError("truncated stream")
                j += 1
                if kind == 2:  # version 2: planes 0 and 1 of a width-4 group as 16-bit halves
                    if version < 2 or w != 4 or j != 1 or size != 2 * count:
                        raise ValueError(f"stream kind 2 of {size} bytes as plane {j - 1} of width {w}")
                    planes.append(np.frombuffer(body, dtype=np.uint8))
                    j += 1
                    continue
                if kind == 1:
                    plane = _inflate(d, body, count)
                elif kind == 0:
                    plane = np.frombuffer(body, dtype=np.uint8)
                else:
                    raise ValueError(f"stream kind {kind}")
                if len(plane) != count:
                    raise ValueError(f"a plane of {len(plane)} bytes, expected {count}")
                planes.append(plane)
            if len(pieces) == 1:  # one piece: the planes merge straight into their place in ``out``
                st, ln = pieces[0]
                merge(planes, w, dst[st : st + ln])
            else:
                flat = scratch("gather", count * w)
                merge(planes, w, flat)
                off = 0
                for st, ln in pieces:
                    dst[st : st + ln] = flat[off : off + ln]
                    off += ln
        if k != nstream:
            raise ValueError("stream count does not match the segments")
        if at != len(s):
            raise ValueError(f"{len(s) - at} trailing bytes")
    except CorruptCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed frame is corruption (zstd errors, struct errors)
        raise CorruptCheckpoint(f"{where}: cannot decode frame ({type(e).__name__}: {e})") from None
