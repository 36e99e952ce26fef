"""Integrity from the source tensor on: the source digest and the non-finite scan of a capture.

Two checks ride on the capture, each chosen in ``[job]``:

* ``verify_capture`` (``"off"``, ``"sample"``, ``"all"``): a digest of each source tensor is taken
  with torch ops *on the tensor's device* just before its first byte is copied (on a GPU: on the
  copy stream, ordered like the copy; on CPU: on the capture thread), and the same digest of the
  host copy is taken by the flush worker just before it computes the CRC32C of those bytes. A
  difference (a flip in the device-to-host copy or in the pinned buffer, or the source changed
  while it was being copied without moving its version counter) fails the checkpoint with
  :class:`~tierckpt.errors.CaptureMismatch`: it is never committed.
* ``nonfinite`` (``"ignore"``, ``"warn"``, ``"refuse"``): a floating tensor is reduced on its
  device in the same place (one pass: its sum, or min/max for 16-bit types); only when that is not
  finite are the NaN/Inf
  elements counted exactly, on the host copy (which the digest proves equal to the source) piece
  by piece in the flush workers. The count is recorded per item in ``metadata.json``
  (``"nonfinite"``); ``refuse`` fails the checkpoint with :class:`~tierckpt.errors.NonFiniteError`.

The digest (:func:`word_digest`) is the wrapping int64 sum of the bytes read as little-endian
int64 words, plus the sum of the trailing bytes: additive over 8-byte aligned pieces (so the host
side sums chunk by chunk, in any order), and changed by any single bit flip. It is a guard
against accidents, not against an adversary.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from ..errors import CaptureMismatch, NonFiniteError
from .copier import Piece, Source

__all__ = ["word_digest", "nonfinite_count", "CaptureCheck", "SAMPLE_EVERY"]

log = logging.getLogger("tierckpt")

SAMPLE_EVERY = 8  # verify_capture = "sample": items whose index is the save number modulo this
_SUMMABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def word_digest(flat: torch.Tensor) -> torch.Tensor:
    """The digest of a flat ``uint8`` tensor, as an int64 scalar tensor on its device (no sync).

    ``sum(int64 words) + sum(trailing bytes)`` with wrapping arithmetic. A view whose address is
    not 8-byte aligned is copied first (on its device; rare: a tensor at an odd offset in its
    storage)."""
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


def _maybe_nonfinite(t: torch.Tensor) -> torch.Tensor:
    """An int64 0/1 scalar on ``t``'s device: 1 when ``t`` may hold NaN/Inf. One reduction pass, no
    sync: for fp32/fp64 the sum (not finite when an element is not, or when the sum overflowed:
    the exact count later clears that), for the 16-bit types min and max (``aminmax`` propagates
    NaN; a float32-accumulated sum of bf16 costs ~30x more CPU); other floating types are
    converted to float32 first."""
    if t.dtype not in _SUMMABLE:
        t = t.to(torch.float32)
    if t.dtype in (torch.float32, torch.float64):
        bad = torch.isfinite(t.sum()).logical_not()
    else:
        lo, hi = torch.aminmax(t.reshape(-1))
        bad = torch.isfinite(lo).logical_not() | torch.isfinite(hi).logical_not()
    return bad.to(torch.int64)


class _Probe:
    """What the source side measured of one item: ``[digest, maybe_nonfinite]``, on the host once
    the copy stream passed it (read only after the chunk's copy events completed)."""

    __slots__ = ("values",)

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    def result(self) -> tuple[int, int]:
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
    flagged: bool | None = None


class CaptureCheck:
    """The digest and non-finite state of one checkpoint on one rank (built by ``RankSave.plan``).

    ``probe(source)`` runs where the copy of the source's first piece is issued, in its stream;
    ``flush(pieces, view)`` runs in a flush worker after the chunk landed and before its CRC32C;
    both raise (:class:`CaptureMismatch`, :class:`NonFiniteError`) to fail the checkpoint.
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
        """Source side: digest and/or float sum of ``src`` on its device (the current stream)."""
        it = self.items.get(src.item)
        if it is None:
            return
        assert src.tensor is not None
        t0 = time.thread_time()
        try:
            self._probe(src, it)
        finally:
            self.probe_cpu_s += time.thread_time() - t0

    def _probe(self, src: Source, it: _Item) -> None:
        assert src.tensor is not None
        zero = torch.zeros((), dtype=torch.int64, device=src.tensor.device)
        d = word_digest(src.flat) if it.digest else zero
        m = _maybe_nonfinite(src.tensor) if it.scan else zero
        vals = torch.stack([d, m])
        if not vals.is_cuda and it.scan and self.mode == "refuse" and int(vals[1]):
            # off the GPU the answer is here already: refuse before the capture completes, so that
            # the pre-step (wait_captured) waiting for it raises
            n = nonfinite_count(src.tensor)
            if n:
                raise self._refused(it.fqn, n)
        if vals.is_cuda:
            host = torch.empty(2, dtype=torch.int64, pin_memory=True)
            host.copy_(vals, non_blocking=True)  # lands before the chunk's copy event
            vals = host
        elif vals.device.type != "cpu":
            vals = vals.cpu()
        it.probe = _Probe(vals)

    def flush(self, pieces: list[Piece], view: torch.Tensor) -> None:
        """Host side, for one landed chunk (``view``: its slot): digest and count each piece of a
        checked item; the item's last piece compares the digests and settles its count."""
        for p in pieces:
            it = self.items.get(p.source.item)
            if it is None:
                continue
            if it.probe is None:
                raise CaptureMismatch(
                    f"checkpoint {self.ckpt}: rank {self.rank}: item {it.fqn!r} landed without its source digest"
                )
            digest, maybe = it.probe.result()
            part = view[p.slot_off : p.slot_off + p.n]
            h = int(word_digest(part)) if it.digest else 0
            c = 0
            if it.scan and maybe:
                assert it.dtype is not None
                c = nonfinite_count(part.view(it.dtype))
            with self._lock:
                it.host += h
                it.count += c
                it.pieces_left -= 1
                last = it.pieces_left == 0
            if not last:
                continue
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
                self.counts[p.source.item] = it.count
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
