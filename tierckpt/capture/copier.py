"""The copy engine: moves item bytes into pool slots.

Device tensors are copied on one dedicated CUDA stream per device, ordered after the compute
stream's work at the moment of the save (an event recorded in ``write_data`` on the training
thread), into pinned slots with ``non_blocking=True``; the returned event tells when the chunk
has landed. Host tensors and serialized objects are copied synchronously by the capture
thread, one ``memcpy`` per piece (the CPU path that CI exercises). Sources stay referenced by
the job until their copy landed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Source", "Piece", "Copier"]

_memmove = ctypes.memmove  # a ctypes foreign function: runs without the GIL


@dataclass
class Source:
    """One item's bytes to capture.

    ``tensor`` is a contiguous tensor (any device; its flat ``uint8`` view is made lazily by the
    capture thread, keeping ``write_data`` cheap), or ``data`` holds a serialized object. ``guard`` is the tensor whose ``_version`` must not move until the copy
    landed, ``version`` its value at the save.
    """

    item: int
    fqn: str
    pos: int
    length: int
    tensor: torch.Tensor | None = None
    data: memoryview | None = None
    guard: torch.Tensor | None = None
    version: int = 0
    _flat: torch.Tensor | None = None

    @property
    def flat(self) -> torch.Tensor:
        """The tensor's bytes as a flat ``uint8`` view (no copy)."""
        if self._flat is None:
            assert self.tensor is not None
            self._flat = self.tensor.reshape(-1).view(torch.uint8)
        return self._flat

    @property
    def device(self) -> torch.device:
        return self.tensor.device if self.tensor is not None else torch.device("cpu")


@dataclass
class Piece:
    """Bytes ``[src_off, src_off+n)`` of ``source`` go to ``[slot_off, slot_off+n)`` of a chunk's slot."""

    source: Source
    src_off: int
    slot_off: int
    n: int


class Copier:
    """Issues the copies of one chunk. One instance per engine; used by the capture thread only."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    @staticmethod
    def record_ready(sources: list[Source]) -> dict[int, torch.cuda.Event]:
        """On the training thread: an event per CUDA device marking 'state as of this save'."""
        events: dict[int, torch.cuda.Event] = {}
        for s in sources:
            if s.tensor is not None and s.tensor.is_cuda:
                idx = s.tensor.device.index
                if idx not in events:
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(s.tensor.device))
                    events[idx] = ev
        return events

    def _stream(self, idx: int, ready: dict[int, torch.cuda.Event]) -> torch.cuda.Stream:
        st = self._streams.get(idx)
        if st is None:
            st = self._streams[idx] = torch.cuda.Stream(device=idx)
        return st

    def copy(
        self,
        pieces: list[Piece],
        slot: torch.Tensor,
        ready: dict[int, torch.cuda.Event],
        probe: Callable[[Source], None] | None = None,
    ) -> list:
        """Copy ``pieces`` into ``slot``; return CUDA events to wait on before reading the slot.

        ``probe(source)`` (the capture check, :mod:`tierckpt.capture.verify`) runs for each
        tensor source right before its first piece is copied, in the stream of the copy (on a
        GPU: the copy stream, after the ready event), so the events returned also cover it."""
        events = []
        slot_np = None
        waited: set[int] = set()
        for p in pieces:
            src = p.source
            dst = slot[p.slot_off : p.slot_off + p.n]
            if src.tensor is None:
                assert src.data is not None  # a Source holds a tensor or bytes
                if slot_np is None:
                    slot_np = slot.numpy()
                slot_np[p.slot_off : p.slot_off + p.n] = np.frombuffer(
                    src.data, dtype=np.uint8, count=p.n, offset=p.src_off
                )
            elif src.tensor.is_cuda:
                idx = src.tensor.device.index
                st = self._stream(idx, ready)
                if idx not in waited:
                    if idx in ready:
                        st.wait_event(ready[idx])
                    waited.add(idx)
                with torch.cuda.stream(st):
                    if probe is not None and p.src_off == 0:
                        probe(src)
                    dst.copy_(src.flat[p.src_off : p.src_off + p.n], non_blocking=True)
            elif src.tensor.device.type == "cpu":
                if probe is not None and p.src_off == 0:
                    probe(src)
                # One plain memcpy on this thread, GIL released: torch's copy_ would split it over
                # the intra-op threads, which training uses at the same moment (more CPU, no gain).
                _memmove(dst.data_ptr(), src.flat.data_ptr() + p.src_off, p.n)
            else:
                if probe is not None and p.src_off == 0:
                    probe(src)
                dst.copy_(src.flat[p.src_off : p.src_off + p.n])
        for idx in waited:
            ev = torch.cuda.Event()
            ev.record(self._streams[idx])
            events.append(ev)
        return events
