"""The Hugging Face shard writer of :mod:`restore.export`: tensors streamed into
``save_pretrained``'s shards (header first, bytes at fixed offsets by a writer thread that runs
while the next batch is read, at most :data:`WRITE_BEHIND` bytes queued), and the per-tensor
conversion (the user's adapter, then the dtype cast). Who calls: :func:`restore.export.export_hf`,
on the calling thread; the writer thread is its own.
"""

from __future__ import annotations

import collections
import json
import os
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import UsageError
from .outfiles import SAFETENSORS_DTYPES, _bytes_of, _pwrite_all, _Tensor, nbytes_of
from .outfiles import _Writer as _ConsolidateWriter

__all__ = ["WRITE_BEHIND", "Adapter"]

WRITE_BEHIND = 256 << 20  # bytes of read tensors queued for the writer thread at most (see _HfWriter)

Adapter = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]

_dtype_rank_cache: dict[torch.dtype, int] = {}  # dtype -> its place in safetensors' header order


def _dtype_ranks(dtypes: set[torch.dtype], st: Any) -> dict[torch.dtype, int]:
    """The position of each dtype in the order safetensors' writer sorts tensors by (asked of the
    installed safetensors: it serializes one one-element tensor per dtype, all names of equal
    length, and the header tells the order)."""
    missing = [d for d in dtypes if d not in _dtype_rank_cache]
    if missing:
        known = sorted(set(missing) | set(_dtype_rank_cache), key=str)
        probe = {f"k{i:04d}": torch.zeros(1, dtype=d) for i, d in enumerate(known)}
        raw = st.save(probe)
        (n,) = struct.unpack_from("<Q", raw, 0)
        order = [k for k in json.loads(raw[8 : 8 + n]) if k != "__metadata__"]
        for pos, k in enumerate(order):
            _dtype_rank_cache[known[int(k[1:])]] = pos
    return {d: _dtype_rank_cache[d] for d in dtypes}


@dataclass
class _Out:
    """One tensor of the export: its Hugging Face name, dtype, shape and where it goes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: str = ""
    offset: int = 0  # of its bytes in the shard's data section

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


class _Shard:
    """One safetensors file: header laid out when created, tensors ``pwrite``-n as they come."""

    def __init__(self, path: Path, outs: list[_Out], ranks: dict[torch.dtype, int]) -> None:
        self.path = path
        self.remaining = len(outs)
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for o in sorted(outs, key=lambda o: (ranks[o.dtype], o.name)):
            header[o.name] = {
                "dtype": SAFETENSORS_DTYPES[o.dtype],
                "shape": list(o.shape),
                "data_offsets": [off, off + o.nbytes],
            }
            o.offset = off
            off += o.nbytes
        hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        hb += b" " * (-len(hb) % 8)
        self.base = 8 + len(hb)
        self.size = self.base + off
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        _pwrite_all(self.fd, memoryview(struct.pack("<Q", len(hb)) + hb), 0)
        os.ftruncate(self.fd, self.size)

    def write(self, o: _Out, value: torch.Tensor) -> bool:
        """Write ``value`` at ``o``'s place; True once every tensor of the shard is written (the
        file is then fsync-ed and closed)."""
        if o.nbytes:
            _pwrite_all(self.fd, _bytes_of(value.contiguous()), self.base + o.offset)
        self.remaining -= 1
        if self.remaining == 0:
            os.fsync(self.fd)
            self.close()
            return True
        return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _HfWriter(_ConsolidateWriter):
    """Receives each full tensor of the checkpoint, runs the adapter and the cast, and writes the
    results into their shards (opened on first use, closed once full).

    Write-behind: a tensor of at most :data:`WRITE_BEHIND` bytes is handed to one writer thread
    (``pwrite`` releases the GIL) while the caller reads the next batch, as long as the tensors
    queued stay within :data:`WRITE_BEHIND` bytes in all; a larger tensor is written on the
    caller's thread once the queue is empty. So reading and writing overlap, and the memory held
    stays within the batch being read plus :data:`WRITE_BEHIND`. The first error of the writer
    thread is raised by the next :meth:`write` or by :meth:`finish`. ``on_shard(file name)``: called
    on the thread that completed a shard (an S3 export uploads it from there on); its error is the
    writer's error.
    """

    def __init__(
        self,
        tmp: Path,
        checkpoint_id: str,
        names: dict[str, str],
        planned: dict[str, list[_Out]],
        shards: dict[str, list[_Out]],
        ranks: dict[torch.dtype, int],
        adapter: Adapter | None,
        dtype: torch.dtype | None,
        on_shard: Callable[[str], None] | None = None,
    ) -> None:
        self.tmp = tmp
        self.on_shard = on_shard  # called with a shard's file name once it is complete, fsync-ed and closed
        self.checkpoint_id = checkpoint_id
        self.names = names  # fqn -> name after strip_prefix
        self.planned = planned  # fqn -> its outputs as planned
        self.shards = shards  # shard file -> its outputs
        self.ranks = ranks
        self.adapter = adapter
        self.dtype = dtype
        self.open: dict[str, _Shard] = {}
        self.done: set[str] = set()
        self.bytes = 0
        self.tensors = 0
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[_Tensor, torch.Tensor]] = collections.deque()
        self._queued = 0  # bytes of the tensors in the queue or being written
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    def write(self, t: _Tensor, value: torch.Tensor) -> None:
        with self._cond:
            self._raise()
            if t.nbytes > WRITE_BEHIND:
                self._cond.wait_for(lambda: self._queued == 0 or self._error is not None)
                self._raise()
            else:
                self._cond.wait_for(lambda: self._queued + t.nbytes <= WRITE_BEHIND or self._error is not None)
                self._raise()
                self._queue.append((t, value))
                self._queued += t.nbytes
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="tierckpt-export-write", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
                return
        self._write_now(t, value)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if not self._queue:
                    return
                t, value = self._queue[0]
            try:
                if self._error is None:
                    self._write_now(t, value)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                with self._cond:
                    self._error = e
            del value
            with self._cond:
                self._queue.popleft()
                self._queued -= t.nbytes
                self._cond.notify_all()

    def finish(self) -> None:
        """Wait until every queued tensor is written; raise the writer thread's error."""
        with self._cond:
            self._cond.wait_for(lambda: self._queued == 0)
            self._raise()

    def _write_now(self, t: _Tensor, value: torch.Tensor) -> None:
        outs = _convert(self.checkpoint_id, t.fqn, self.names[t.fqn], value, self.adapter, self.dtype)
        plan = self.planned[t.fqn]
        if [(n, v.dtype, tuple(v.shape)) for n, v in outs.items()] != [(o.name, o.dtype, o.shape) for o in plan]:
            raise UsageError(
                f"checkpoint {self.checkpoint_id}: the adapter returned for {t.fqn!r} "
                f"{[(n, str(v.dtype), list(v.shape)) for n, v in outs.items()]} from the tensor and "
                f"{[(o.name, str(o.dtype), list(o.shape)) for o in plan]} from its meta stand-in: "
                "it must depend on names, shapes and dtypes only"
            )
        for o in plan:
            shard = self.open.get(o.shard)
            if shard is None:
                shard = self.open[o.shard] = _Shard(self.tmp / o.shard, self.shards[o.shard], self.ranks)
            if shard.write(o, outs[o.name]):
                del self.open[o.shard]
                self.done.add(o.shard)
                if self.on_shard is not None:
                    self.on_shard(o.shard)
            self.bytes += o.nbytes
            self.tensors += 1

    def close(self) -> None:
        """Stop the writer thread (after what is queued; nothing more is written after an error)
        and close the shards still open."""
        with self._cond:
            self._stop = True
            if self._error is None and self._queue:
                self._error = UsageError(f"checkpoint {self.checkpoint_id}: export abandoned")
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        for shard in self.open.values():
            shard.close()
        self.open.clear()


def _convert(
    checkpoint_id: str,
    fqn: str,
    name: str,
    value: torch.Tensor,
    adapter: Adapter | None,
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    """``{name: value}`` through the adapter, then floating-point results cast to ``dtype``."""
    outs: dict[str, torch.Tensor] = {name: value}
    if adapter is not None:
        try:
            got = adapter(outs)
        except Exception as e:  # noqa: BLE001 - the user's callable: name the key it failed on
            raise UsageError(
                f"checkpoint {checkpoint_id}: the adapter failed on {fqn!r} ({name!r}): {type(e).__name__}: {e}"
            ) from e
        if not isinstance(got, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in got.items()
        ):
            raise UsageError(
                f"checkpoint {checkpoint_id}: the adapter returned {type(got).__name__} for {fqn!r}: "
                "it must return a dict of names to tensors"
            )
        outs = dict(got)
    if dtype is not None:
        outs = {k: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v for k, v in outs.items()}
    return outs
