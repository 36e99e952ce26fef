"""The files ``consolidate`` and ``export`` write: a ``.safetensors`` file or a ``torch.save`` zip,
laid out first (header, or ``torch.save``'s own skeleton) and filled tensor by tensor at fixed
offsets (``os.pwrite``), so that memory stays near one batch of tensors. Who calls:
:func:`restore.consolidate.consolidate_checkpoint` and :mod:`restore.export`, on the calling thread.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierckpt.errors import CorruptCheckpoint
from tierckpt.format.metadata import ItemRecord

from .errors import UsageError

__all__ = ["SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
}


@dataclass
class _Tensor:
    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[tuple[ItemRecord, tuple[int, ...], tuple[int, ...]]]  # (record, offsets, sizes)

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


def nbytes_of(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``."""
    return dtype.itemsize * math.prod(shape)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _Writer:
    def write(self, t: _Tensor, value: torch.Tensor) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Everything is written: make it durable."""

    def close(self) -> None:
        raise NotImplementedError


def _pwrite_all(fd: int, mv: memoryview, off: int) -> None:
    while len(mv):
        n = os.pwrite(fd, mv, off)
        mv = mv[n:]
        off += n


class _SafetensorsWriter(_Writer):
    """Header first, then each tensor ``pwrite``-n at its place (see the module docstring)."""

    def __init__(self, path: Path, tensors: list[_Tensor], checkpoint_id: str) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt", "tierckpt_checkpoint": checkpoint_id}}
        self.offsets: dict[str, int] = {}
        off = 0
        for t in tensors:
            if t.fqn == "__metadata__":
                raise UsageError("a key named '__metadata__' cannot be stored in safetensors; --exclude it")
            header[t.fqn] = {
                "dtype": SAFETENSORS_DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [off, off + t.nbytes],
            }
            self.offsets[t.fqn] = off
            off += t.nbytes
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        self.base = 8 + len(hb)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        _pwrite_all(self.fd, memoryview(struct.pack("<Q", len(hb)) + hb), 0)
        os.ftruncate(self.fd, self.base + off)

    def write(self, t: _Tensor, value: torch.Tensor) -> None:
        if t.nbytes:
            _pwrite_all(self.fd, _bytes_of(value), self.base + self.offsets[t.fqn])

    def finish(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


class _TorchSaveWriter(_Writer):
    """``torch.save``'s own skeleton (no tensor bytes), then the bytes at their storages' offsets."""

    def __init__(self, path: Path, tensors: list[_Tensor], values: dict[str, Any], order: list[str]) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        by_fqn = {t.fqn: t for t in tensors}
        with FakeTensorMode():
            fakes = {t.fqn: torch.empty(t.shape, dtype=t.dtype) for t in tensors}
        skeleton = {f: fakes[f] if f in by_fqn else values[f] for f in order}
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, path)
        del skeleton, fakes
        with FakeTensorMode():
            loaded = torch.load(path, weights_only=True)
        self.offsets: dict[str, int] = {}
        for t in tensors:
            off = getattr(loaded[t.fqn].untyped_storage(), "_checkpoint_offset", None)
            if off is None:
                raise UsageError(
                    f"torch {torch.__version__} does not report storage offsets: write .safetensors instead"
                )
            self.offsets[t.fqn] = int(off)
        del loaded
        self.crcs: dict[int, int] = {}  # storage data offset -> CRC-32 of its bytes
        self.path = path
        self.fd = os.open(path, os.O_RDWR)

    def write(self, t: _Tensor, value: torch.Tensor) -> None:
        if not t.nbytes:
            return
        mv = _bytes_of(value)
        off = self.offsets[t.fqn]
        _pwrite_all(self.fd, mv, off)
        self.crcs[off] = zlib.crc32(mv)

    def finish(self) -> None:
        os.fsync(self.fd)
        _patch_zip_crcs(self.path, self.fd, self.crcs)
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


_CD_SIG = 0x02014B50
_LOCAL_SIG = 0x04034B50
_DD_SIG = 0x08074B50


def _patch_zip_crcs(path: Path, fd: int, crcs: dict[int, int]) -> None:
    """Set the CRC-32 of the zip records whose data starts at the offsets in ``crcs``.

    The central directory holds the CRC every zip reader checks; a record written with a
    data descriptor (flag bit 3) repeats it after the data. Records are matched by data offset.
    """
    if not crcs:
        return
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        pos = zf.start_dir
    for info in infos:
        cd = os.pread(fd, 46, pos)
        (sig,) = struct.unpack_from("<I", cd, 0)
        if sig != _CD_SIG:
            raise CorruptCheckpoint(f"{path}: unexpected zip central directory layout")
        n, m, k = struct.unpack_from("<HHH", cd, 28)
        lh = os.pread(fd, 30, info.header_offset)
        if struct.unpack_from("<I", lh, 0)[0] != _LOCAL_SIG:
            raise CorruptCheckpoint(f"{path}: unexpected zip local header layout")
        ln, lm = struct.unpack_from("<HH", lh, 26)
        data = info.header_offset + 30 + ln + lm
        crc = crcs.get(data)
        if crc is not None:
            packed = struct.pack("<I", crc)
            os.pwrite(fd, packed, pos + 16)
            if info.flag_bits & 0x08:
                dd = data + info.compress_size
                head = os.pread(fd, 4, dd)
                os.pwrite(fd, packed, dd + 4 if struct.unpack("<I", head)[0] == _DD_SIG else dd)
            else:
                os.pwrite(fd, packed, info.header_offset + 14)
        pos += 46 + n + m + k
