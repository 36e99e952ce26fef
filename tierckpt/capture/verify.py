"""Integrity from the source tensor on: the source digest and the non-finite scan of a capture.

Two checks ride on the capture, each chosen in ``[job]``:

* ``verify_capture`` (``"off"``, ``"sample"``, ``"all"``): a digest of each source tensor is taken
  *where the tensor lives* just before its first byte is copied (on a GPU: torch ops on the copy
  stream, ordered like the copy; on CPU: one single-threaded numpy pass on the capture thread),
  and the same digest of the host copy is taken by the flush worker in the same pass over the
  bytes as their CRC32C (:meth:`CaptureCheck.seal`). A difference (a flip in the device-to-host
  copy or in the pinned buffer, or the source changed while it was being copied without moving its
  version counter) fails the checkpoint with :class:`~tierckpt.errors.CaptureMismatch`: it is never
  committed. ``"sample"`` digests a rotating eighth of the items each save.
* ``nonfinite`` (``"ignore"``, ``"warn"``, ``"refuse"``): floating tensors are scanned for NaN/Inf
  on the host copy, in that same pass (exact: two integer max reductions over the bits, and a count
  only when they find one), and the count is recorded per item in ``metadata.json``
  (``"nonfinite"``). A GPU tensor is first reduced on its device in the probe (its sum, or
  min/max for 16-bit types), and the host copy is scanned only when that says it may hold NaN/Inf.
  ``refuse`` fails the checkpoint with :class:`~tierckpt.errors.NonFiniteError`; a CPU tensor is
  then scanned at the source, in the probe's pass, so that the refusal comes before the capture
  completes (the pre-step waiting for it raises).

The host-side pass (:meth:`CaptureCheck.seal`) walks each chunk once in blocks of
:data:`BLOCK` bytes, and for each block, while it is in cache: CRC32C, digest, NaN/Inf scan. Its
reductions are numpy's (single-threaded, GIL released, no scratch memory): torch's CPU
reductions would wake its intra-op thread pool, whose spinning cost more CPU than the
reductions themselves.

The digest (:func:`word_digest`, :func:`np_digest`) is the wrapping int64 sum of the bytes read as
little-endian int64 words, plus the sum of the trailing bytes: additive over 8-byte aligned
pieces (so the host side sums block by block, chunk by chunk, in any order), and changed by any
single bit flip. It is a guard against accidents, not against an adversary.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..checksum import crc32c
from ..errors import CaptureMismatch, NonFiniteError
from .copier import Piece, Source

__all__ = ["word_digest", "np_digest", "nonfinite_count", "block_nonfinite", "CaptureCheck", "SAMPLE_EVERY", "BLOCK"]

log = logging.getLogger("tierckpt")

SAMPLE_EVERY = 8  # verify_capture = "sample": items whose index is the save number modulo this
BLOCK = 1 << 20  # bytes per step of the fused host pass (fits L2 with room to spare)
_MASK64 = (1 << 64) - 1
_SUMMABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# NaN/Inf by their bits: the exponent field all ones. Read as signed integers the positive ones
# are the largest values (>= pos); read as unsigned the negative ones are (>= neg).
_NF_BITS: dict[torch.dtype, tuple[type, type, int, int]] = {
    torch.float16: (np.int16, np.uint16, 0x7C00, 0xFC00),
    torch.bfloat16: (np.int16, np.uint16, 0x7F80, 0xFF80),
    torch.float32: (np.int32, np.uint32, 0x7F80_0000, 0xFF80_0000),
    torch.float64: (np.int64, np.uint64, 0x7FF0_0000_0000_0000, 0xFFF0_0000_0000_0000),
}


def np_digest(a: np.ndarray) -> int:
    """The digest of a flat contiguous ``uint8`` array (see :func:`word_digest`), in
    ``[0, 2**64)``: one single-threaded numpy pass (an unaligned start is fine: numpy copes)."""
    n = a.size
    w = n - n % 8
    d = int(np.add.reduce(a[:w].view(np.int64))) if w else 0
    if n > w:
        d += int(np.add.reduce(a[w:], dtype=np.int64))
    return d & _MASK64


def word_digest(flat: torch.Tensor) -> torch.Tensor:
    """The digest of a flat ``uint8`` tensor, as an int64 scalar tensor on its device (no sync).

    ``sum(int64 words) + sum(trailing bytes)`` with wrapping arithmetic. On CPU it is
    :func:`np_digest`; elsewhere torch ops, and a view whose address is not 8-byte aligned is
    copied first (on its device; rare: a tensor at an odd offset in its storage)."""
    if flat.device.type == "cpu":
        v = np_digest(flat.detach().numpy())
        return torch.tensor(v - (1 << 64) if v >> 63 else v, dtype=torch.int64)
    n = flat.numel()
    w = n - n % 8
    if w and (flat.data_ptr() % 8 or flat.storage_offset() % 8):
        flat = flat.clone()
    d = flat[:w].view(torch.int64).sum() if w else torch.zeros((), dtype=torch.int64, device=flat.device)
    if n > w:
        d = d + flat[w:].to(torch.int64).sum()
    return d


def nonfinite_count(t: torch.Tensor) -> int:
    """The number of NaN/Inf elements of a floating tensor (exact; syncs on a device tensor)."""
    if t.dtype not in _SUMMABLE:
        t = t.to(torch.float32)
    return int(t.numel() - torch.isfinite(t).sum().item())


def block_nonfinite(a: np.ndarray, dtype: torch.dtype) -> int:
    """The number of NaN/Inf elements in the bytes ``a`` (flat ``uint8``, whole elements of
    ``dtype``), exact. For fp16/bf16/fp32/fp64 two integer max reductions over the bits (no
    scratch memory; see ``_NF_BITS``) tell whether there are any, and only then are they counted;
    other floating types: torch's count."""
    bits = _NF_BITS.get(dtype)
    if bits is None:
        return nonfinite_count(torch.from_numpy(a).view(dtype)) if a.size else 0
    st, ut, pos, neg = bits
    u: np.ndarray = a.view(ut)
    if not u.size or (int(np.maximum.reduce(a.view(st))) < pos and int(np.maximum.reduce(u)) < neg):
        return 0
    return int(np.count_nonzero((u & ut(pos)) == ut(pos)))


def _maybe_nonfinite(t: torch.Tensor) -> torch.Tensor:
    """An int64 0/1 scalar on ``t``'s device: 1 when ``t`` may hold NaN/Inf. One reduction pass, no
    sync (the device-side pre-scan of a GPU tensor): for fp32/fp64 the sum (not finite when an
    element is not, or when the sum overflowed: the exact count later clears that), for the 16-bit
    types min and max (``aminmax`` propagates NaN); other floating types are converted to float32
    first."""
    if t.dtype not in _SUMMABLE:
        t = t.to(torch.float32)
    if t.dtype in (torch.float32, torch.float64):
        bad = torch.isfinite(t.sum()).logical_not()
    else:
        lo, hi = torch.aminmax(t.reshape(-1))
        bad = torch.isfinite(lo).logical_not() | torch.isfinite(hi).logical_not()
    return bad.to(torch.int64)


class _Probe:
    """What the source side measured of one item: ``[digest, maybe_nonfinite]``: Python ints (a
    CPU source), or a tensor on the host once the copy stream passed it (read only after the
    chunk's copy events completed)."""

    __slots__ = ("values",)

    def __init__(self, values: torch.Tensor | tuple[int, int]) -> None:
        self.values = values

    def result(self) -> tuple[int, int]:
        if isinstance(self.values, tuple):
            return self.values
        d, m = self.values.tolist()
        return int(d), int(m)


@dataclass
class _Item:
    fqn: str
    dtype: torch.dtype | None
    pieces_left: int
    digest: bool
    scan: bool
    probe: _Probe | None = None
    host: int = 0
    count: int = 0


class CaptureCheck:
    """The digest and non-finite state of one checkpoint on one rank (built by ``RankSave.plan``).

    ``probe(source)`` runs where the copy of the source's first piece is issued, in its stream;
    ``seal(pieces, crc_pieces, arr, crcs)`` runs in a flush worker after the chunk landed, computing
    the chunk's CRC32Cs together with the digests and NaN/Inf counts of the checked items; both
    raise (:class:`CaptureMismatch`, :class:`NonFiniteError`) to fail the checkpoint.
    :attr:`counts` holds, per item, its NaN/Inf count (``None``: not scanned); :attr:`checked`
    the number of items whose digests matched.
    """

    def __init__(
        self,
        ckpt: str,
        rank: int,
        sources: list[Source],
        chunks: list[list[Piece]],
        n_items: int,
        verify: str,
        nonfinite: str,
        save_no: int,
    ) -> None:
        self.ckpt = ckpt
        self.rank = rank
        self.mode = nonfinite
        self._lock = threading.Lock()
        self.counts: list[int | None] = [None] * n_items
        self.checked = 0
        self.probe_cpu_s = 0.0  # thread CPU time of probe() (the capture thread's share)
        pieces: dict[int, int] = {}
        for chunk in chunks:
            for p in chunk:
                pieces[p.source.item] = pieces.get(p.source.item, 0) + 1
        self.items: dict[int, _Item] = {}
        for s in sources:
            if s.tensor is None or not s.length:
                continue
            digest = verify == "all" or (verify == "sample" and (s.item + save_no) % SAMPLE_EVERY == 0)
            scan = nonfinite != "ignore" and s.tensor.is_floating_point()
            if digest or scan:
                self.items[s.item] = _Item(s.fqn, s.tensor.dtype, pieces.get(s.item, 0), digest, scan)
                if scan:
                    self.counts[s.item] = 0

    @property
    def active(self) -> bool:
        return bool(self.items)

    def probe(self, src: Source) -> None:
        """Source side: the digest of ``src`` (and its NaN/Inf pre-scan) where it lives."""
        it = self.items.get(src.item)
        if it is None:
            return
        assert src.tensor is not None
        t0 = time.thread_time()
        try:
            if src.tensor.device.type == "cpu":
                self._probe_cpu(src, it)
            else:
                self._probe_device(src, it)
        finally:
            self.probe_cpu_s += time.thread_time() - t0

    def _probe_cpu(self, src: Source, it: _Item) -> None:
        """One numpy pass over the source's bytes on this (the capture) thread. The NaN/Inf scan is
        left to the host copy (``maybe`` = 1), except with ``refuse``: then each block is scanned
        right after it was summed, still in cache, and a NaN/Inf fails the capture here."""
        a = src.flat.detach().numpy()
        refuse = it.scan and self.mode == "refuse"
        if not refuse:
            it.probe = _Probe((np_digest(a) if it.digest else 0, int(it.scan)))
            return
        assert it.dtype is not None
        d = n = 0
        for s in range(0, a.size, BLOCK):
            blk = a[s : s + BLOCK]
            if it.digest:
                d += np_digest(blk)
            n += block_nonfinite(blk, it.dtype)
        if n:
            raise self._refused(it.fqn, n)
        it.probe = _Probe((d & _MASK64, 0))

    def _probe_device(self, src: Source, it: _Item) -> None:
        """Torch ops on the tensor's device, in the current (copy) stream, without a sync."""
        assert src.tensor is not None
        zero = torch.zeros((), dtype=torch.int64, device=src.tensor.device)
        d = word_digest(src.flat) if it.digest else zero
        m = _maybe_nonfinite(src.tensor) if it.scan else zero
        vals = torch.stack([d, m])
        if not vals.is_cuda and it.scan and self.mode == "refuse" and int(vals[1]):
            # off the GPU the answer is here already: refuse before the capture completes
            n = nonfinite_count(src.tensor)
            if n:
                raise self._refused(it.fqn, n)
        if vals.is_cuda:
            host = torch.empty(2, dtype=torch.int64, pin_memory=True)
            host.copy_(vals, non_blocking=True)  # lands before the chunk's copy event
            vals = host
        else:
            vals = vals.cpu()
        it.probe = _Probe(vals)

    def seal(
        self,
        pieces: list[Piece],
        crc_pieces: list[tuple[int, int, int, int]],
        arr: np.ndarray,
        crcs: list[list[int]],
    ) -> float:
        """Host side, for one landed chunk (``arr``: its slot's bytes): the CRC32C of every CRC
        piece (``(item, j, slot_off, n)`` into ``crcs[item][j]``) and, block by block in the same
        pass, the digest and NaN/Inf count of each checked item's bytes; an item's last piece
        compares the digests and settles its count. Returns the CPU seconds spent in CRC32C."""
        mine = {p.source.item: p for p in pieces if p.source.item in self.items}
        crc_s = 0.0
        for item, j, off, n in crc_pieces:
            p = mine.get(item)
            if p is None:  # unchecked (or only its padding in this chunk): the CRC alone
                t0 = time.thread_time()
                crcs[item][j] = crc32c(arr[off : off + n])
                crc_s += time.thread_time() - t0
                continue
            it = self.items[item]
            if it.probe is None:
                raise CaptureMismatch(
                    f"checkpoint {self.ckpt}: rank {self.rank}: item {it.fqn!r} landed without its source digest"
                )
            _, maybe = it.probe.result()
            scan = it.scan and bool(maybe)
            lo, hi = p.slot_off, p.slot_off + p.n  # the item's bytes (then its padding)
            crc = h = c = 0
            for s in range(off, off + n, BLOCK):
                e = min(s + BLOCK, off + n)
                t0 = time.thread_time()
                crc = crc32c(arr[s:e], crc)  # first: what the digest then reads is what the CRC sealed
                crc_s += time.thread_time() - t0
                a, b = max(s, lo), min(e, hi)
                if b > a:
                    blk = arr[a:b]
                    if it.digest:
                        h += np_digest(blk)
                    if scan:
                        assert it.dtype is not None
                        c += block_nonfinite(blk, it.dtype)
            crcs[item][j] = crc
            self._settle(item, it, h, c)
        return crc_s

    def _settle(self, item: int, it: _Item, h: int, c: int) -> None:
        with self._lock:
            it.host += h
            it.count += c
            it.pieces_left -= 1
            last = it.pieces_left == 0
        if not last:
            return
        assert it.probe is not None
        digest, _ = it.probe.result()
        if it.digest:
            if _wrap(it.host) != _wrap(digest):
                raise CaptureMismatch(
                    f"checkpoint {self.ckpt}: rank {self.rank}: the host copy of {it.fqn!r} does not match "
                    f"the digest of its source tensor (0x{_wrap(it.host):016x} != 0x{_wrap(digest):016x}): "
                    "a flip in the device-to-host copy or the host buffer, or the tensor changed while it "
                    "was copied; the checkpoint will not be committed"
                )
            with self._lock:
                self.checked += 1
        if it.scan:
            self.counts[item] = it.count
            if it.count and self.mode == "refuse":
                raise self._refused(it.fqn, it.count)

    def _refused(self, fqn: str, n: int) -> NonFiniteError:
        return NonFiniteError(
            f"checkpoint {self.ckpt}: rank {self.rank}: tensor {fqn!r} holds {n} NaN/Inf value(s) "
            '([job] nonfinite = "refuse"); the checkpoint will not be committed'
        )

    def warn(self) -> None:
        """``nonfinite = "warn"``: log the items that held NaN/Inf (once the file is durable)."""
        bad = {it.fqn: self.counts[i] for i, it in self.items.items() if self.counts[i]}
        if bad and self.mode == "warn":
            log.warning(
                "checkpoint %s: rank %d: NaN/Inf values in %d tensor(s) (saved; recorded in its metadata): %s",
                self.ckpt,
                self.rank,
                len(bad),
                ", ".join(f"{k} ({v})" for k, v in list(bad.items())[:8]),
            )


def _wrap(v: int) -> int:
    return v & 0xFFFFFFFFFFFFFFFF
