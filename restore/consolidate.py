"""``consolidate``: one full, unsharded state dict file from a checkpoint, without a process group.

The output is a flat dict ``fqn -> full tensor`` (plus non-tensor items for ``.pt``), as the
checkpoint's metadata names the keys (nested state dicts appear with DCP's dotted keys).

Memory bound. Tensors are assembled in batches of about :data:`BATCH_BYTES` (a tensor larger
than that is a batch of its own): each full tensor is allocated, its chunks are read straight
into it (a chunk that is not a contiguous slice of the full tensor goes through a scratch
buffer of the chunk's size), the bytes are written to their final place in the output with
``pwrite``, and the batch is freed. Peak memory is therefore about
``max(BATCH_BYTES, largest tensor) + largest chunk``, whatever the size of the state. Both
formats are laid out *before* any tensor byte is read:

* ``.safetensors`` is written directly: 8-byte little-endian header length, the JSON header
  ``{name: {dtype, shape, data_offsets}}`` (padded with spaces to 8 bytes), then the tensors
  back to back. Non-tensor items cannot be stored there and are skipped (and reported).
* ``.pt``: ``torch.save`` writes the file's skeleton under ``torch.serialization.skip_data``
  from ``FakeTensor`` stand-ins (shape and dtype only, no memory), so the pickle, the zip
  records and every storage's place are torch's own; loading that skeleton under
  ``FakeTensorMode`` tells each storage's offset (``_checkpoint_offset``). The tensor bytes are
  then written there, and the CRC-32 of each storage record is patched into the zip (torch
  itself writes them by default), so that the file is a valid zip and ``torch.load(...,
  weights_only=True)`` returns ordinary CPU tensors. Non-tensor items are loaded with
  ``weights_only=True`` and pickled in as values.

The output is written to a temporary name in the same directory and renamed at the end.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import struct
import time
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from tierckpt.config import TierConfig
from tierckpt.errors import CorruptCheckpoint
from tierckpt.format.metadata import ItemRecord

from .catalog import as_config
from .errors import NotFound, UsageError
from .source import CheckpointSource, ReadRequest
from .work import progress_bar

__all__ = ["BATCH_BYTES", "SAFETENSORS_DTYPES", "ConsolidateResult", "consolidate_checkpoint", "select_keys"]

log = logging.getLogger("tierckpt.restore")

BATCH_BYTES = 64 << 20

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
_FORMATS = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt", ".bin": "pt"}


@dataclass
class ConsolidateResult:
    checkpoint_id: str
    out: str
    format: str
    tensors: int = 0
    objects: int = 0
    bytes: int = 0  # tensor bytes written
    largest_tensor: int = 0
    skipped: list[str] = field(default_factory=list)  # non-tensor keys left out of a .safetensors file
    served: dict[str, str] = field(default_factory=dict)  # data file -> tier it was read from
    seconds: float = 0.0

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["seconds"] = round(self.seconds, 3)
        return d


@dataclass
class _Tensor:
    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[tuple[ItemRecord, tuple[int, ...], tuple[int, ...]]]  # (record, offsets, sizes)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def select_keys(fqns: Iterable[str], keys: list[str] | None, exclude: list[str] | None) -> list[str]:
    """``fqns`` that start with one of ``keys`` (all when None/empty) and with none of ``exclude``."""
    out = []
    for f in fqns:
        if keys and not any(f.startswith(k) for k in keys):
            continue
        if exclude and any(f.startswith(x) for x in exclude):
            continue
        out.append(f)
    return out


def output_format(out: Path, fmt: str | None) -> str:
    if fmt:
        if fmt not in ("pt", "safetensors"):
            raise UsageError(f"--format {fmt!r}: use pt or safetensors")
        return fmt
    f = _FORMATS.get(out.suffix.lower())
    if f is None:
        raise UsageError(f"--out {out}: cannot tell the format from the suffix (use .pt or .safetensors, or --format)")
    return f


def consolidate_checkpoint(
    config: TierConfig | str | os.PathLike | None,
    checkpoint_id: str = "latest",
    *,
    out: str | os.PathLike,
    keys: list[str] | None = None,
    exclude: list[str] | None = None,
    fmt: str | None = None,
    progress: bool = True,
    strip_prefix: str | None = None,
) -> ConsolidateResult:
    """Write checkpoint ``checkpoint_id`` (or ``"latest"``) as one full state dict file ``out``.

    Args:
        config: a :class:`TierConfig`, a TOML path, or ``None`` for ``$TIERCKPT_CONFIG``.
        out: the output path; ``.safetensors`` or ``.pt`` (``.pth``, ``.bin``) unless ``fmt`` says.
        keys: keep only keys starting with one of these prefixes (e.g. ``["model."]``).
        exclude: drop keys starting with one of these prefixes.
        fmt: ``"pt"`` or ``"safetensors"`` (default: from the suffix of ``out``).
        progress: show a progress bar on a terminal.
        strip_prefix: removed from the start of every key that has it, in the file written
            (``"model."``: ``model.layer.w`` is written as ``layer.w``); two keys that would get
            the same name raise :class:`UsageError`.

    Reads from the fastest tier holding each data file (local, else S3), verifying every CRC32C.
    See the module docstring for the memory bound and the file layouts.
    """
    t0 = time.perf_counter()
    cfg = as_config(config)
    out_path = Path(out)
    fmt = output_format(out_path, fmt)
    if out_path.is_dir():
        raise UsageError(f"--out {out_path}: is a directory")
    with CheckpointSource(cfg, checkpoint_id, purpose="consolidate") as src:
        md = src.metadata
        res = ConsolidateResult(src.checkpoint_id, str(out_path), fmt)
        chosen = select_keys(md.state_dict_metadata, keys, exclude)
        if not chosen:
            raise NotFound(
                f"checkpoint {src.checkpoint_id}: no key matches"
                + (f" --keys {' '.join(keys)}" if keys else "")
                + (f" --exclude {' '.join(exclude)}" if exclude else "")
                + f" ({len(md.state_dict_metadata)} keys, e.g. {next(iter(md.state_dict_metadata), '-')!r})"
            )
        tensors, objects = _plan(src, chosen)
        if fmt == "safetensors":
            res.skipped = [fqn for fqn, _ in objects]
            if res.skipped:
                log.warning(
                    "safetensors holds tensors only: leaving out %d non-tensor key(s): %s",
                    len(res.skipped),
                    ", ".join(res.skipped[:5]) + (" ..." if len(res.skipped) > 5 else ""),
                )
            objects = []
            unsupported = [t for t in tensors if t.dtype not in SAFETENSORS_DTYPES]
            if unsupported:
                t = unsupported[0]
                raise UsageError(
                    f"{t.fqn!r} is {str(t.dtype).removeprefix('torch.')}, which safetensors cannot store: "
                    "write a .pt file or --exclude it"
                )
        values = _load_objects(src, objects)
        order = [f for f in chosen if f in values or f in {t.fqn for t in tensors}]
        if strip_prefix:
            tensors, values, order = _strip(src.checkpoint_id, strip_prefix, tensors, values, order)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(f".{out_path.name}.partial-{os.getpid()}")
        try:
            if fmt == "safetensors":
                writer: _Writer = _SafetensorsWriter(tmp, tensors, src.checkpoint_id)
            else:
                writer = _TorchSaveWriter(tmp, tensors, values, order)
            try:
                _copy_tensors(src, tensors, writer, res, progress)
                writer.finish()
            finally:
                writer.close()
            os.replace(tmp, out_path)
        except BaseException:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
            raise
        res.tensors = len(tensors)
        res.objects = len(values)
        res.largest_tensor = max((t.nbytes for t in tensors), default=0)
        res.served = dict(sorted(src.served.items()))
        res.seconds = time.perf_counter() - t0
        return res


def _strip(
    cid: str, prefix: str, tensors: list[_Tensor], values: dict[str, Any], order: list[str]
) -> tuple[list[_Tensor], dict[str, Any], list[str]]:
    """The keys to write with ``prefix`` removed where they start with it (see
    :func:`consolidate_checkpoint`); the reads still go by each item's stored record."""

    def name(fqn: str) -> str:
        return fqn[len(prefix) :] if fqn.startswith(prefix) else fqn

    seen: dict[str, str] = {}
    for fqn in order:
        new = name(fqn)
        if not new:
            raise UsageError(f"checkpoint {cid}: --strip-prefix {prefix}: key {fqn!r} would have no name left")
        if new in seen:
            raise UsageError(
                f"checkpoint {cid}: --strip-prefix {prefix}: keys {seen[new]!r} and {fqn!r} would both be "
                f"written as {new!r}; select one with --keys or --exclude"
            )
        seen[new] = fqn
    return (
        [dataclasses.replace(t, fqn=name(t.fqn)) for t in tensors],
        {name(k): v for k, v in values.items()},
        [name(f) for f in order],
    )


def _plan(src: CheckpointSource, chosen: list[str]) -> tuple[list[_Tensor], list[tuple[str, ItemRecord]]]:
    md = src.metadata
    by_key: dict[tuple[str, tuple[int, ...] | None], ItemRecord] = {}
    for idx, rec in (md.storage_data or {}).items():
        by_key[(idx.fqn, None if idx.offset is None else tuple(idx.offset))] = rec
    tensors: list[_Tensor] = []
    objects: list[tuple[str, ItemRecord]] = []
    for fqn in chosen:
        m = md.state_dict_metadata[fqn]
        if isinstance(m, BytesStorageMetadata):
            rec = by_key.get((fqn, None))
            if rec is None:
                rec = next((r for (f, _o), r in by_key.items() if f == fqn), None)
            if rec is None:
                raise CorruptCheckpoint(f"checkpoint {src.checkpoint_id}: no stored item for {fqn!r}")
            objects.append((fqn, rec))
            continue
        assert isinstance(m, TensorStorageMetadata)
        shape = tuple(m.size)
        chunks = []
        covered = 0
        dtname = str(m.properties.dtype).removeprefix("torch.")
        for c in m.chunks:
            off, sizes = tuple(c.offsets), tuple(c.sizes)
            rec = by_key.get((fqn, off))
            if rec is None:
                raise CorruptCheckpoint(
                    f"checkpoint {src.checkpoint_id}: no stored item for {fqn!r} at offset {list(off)}"
                )
            if tuple(rec.shape) != sizes or rec.dtype != dtname:
                raise CorruptCheckpoint(
                    f"checkpoint {src.checkpoint_id}: {fqn!r} at offset {list(off)}: stored "
                    f"{rec.dtype}{list(rec.shape)}, metadata says {dtname}{list(sizes)}"
                )
            if len(off) != len(shape) or any(o + s > d for o, s, d in zip(off, sizes, shape)):
                raise CorruptCheckpoint(
                    f"checkpoint {src.checkpoint_id}: {fqn!r}: chunk at {list(off)} of size "
                    f"{list(sizes)} is outside the tensor {list(shape)}"
                )
            n = 1
            for s in sizes:
                n *= s
            covered += n
            chunks.append((rec, off, sizes))
        total = 1
        for s in shape:
            total *= s
        if covered != total:
            raise CorruptCheckpoint(
                f"checkpoint {src.checkpoint_id}: the chunks of {fqn!r} hold {covered} of its "
                f"{total} elements (a shard is missing from the metadata)"
            )
        tensors.append(_Tensor(fqn, m.properties.dtype, shape, chunks))
    return tensors, objects


def _load_objects(src: CheckpointSource, objects: list[tuple[str, ItemRecord]]) -> dict[str, Any]:
    bufs = {fqn: bytearray(rec.length) for fqn, rec in objects}
    src.read([ReadRequest(rec, memoryview(bufs[fqn]), f"item {fqn!r}") for fqn, rec in objects])
    values: dict[str, Any] = {}
    for fqn, _rec in objects:
        try:
            values[fqn] = torch.load(io.BytesIO(bytes(bufs[fqn])), weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure: refuse that key
            raise UsageError(
                f"checkpoint {src.checkpoint_id}: non-tensor item {fqn!r} cannot be loaded with "
                f"weights_only=True ({type(e).__name__}); leave it out with --exclude {fqn}"
            ) from None
    return values


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _batches(tensors: list[_Tensor]) -> list[list[_Tensor]]:
    out: list[list[_Tensor]] = []
    cur: list[_Tensor] = []
    size = 0
    for t in tensors:
        if cur and size + t.nbytes > BATCH_BYTES:
            out.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur:
        out.append(cur)
    return out


def _copy_tensors(
    src: CheckpointSource,
    tensors: list[_Tensor],
    writer: _Writer,
    res: ConsolidateResult,
    progress: bool,
    label: str = "consolidate",
) -> None:
    """Read every tensor of ``tensors`` whole (batch by batch, see the module docstring) and hand it
    to ``writer.write`` in order; ``res.bytes`` counts the bytes read. ``label`` names the bar."""
    bar = progress_bar(sum(t.nbytes for t in tensors), f"{label} {src.checkpoint_id}", progress)
    try:
        for batch in _batches(tensors):
            full: dict[str, torch.Tensor] = {}
            reqs: list[ReadRequest] = []
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            for t in batch:
                dest = torch.empty(t.shape, dtype=t.dtype)
                full[t.fqn] = dest
                if dest.numel() == 0:
                    continue
                for rec, off, sizes in t.chunks:
                    view = dest
                    for dim, (o, s) in enumerate(zip(off, sizes)):
                        view = view.narrow(dim, o, s)
                    if view.numel() == 0:
                        continue
                    if view.is_contiguous():
                        target = view
                    else:
                        target = torch.empty(sizes, dtype=t.dtype)
                        copies.append((view, target))
                    reqs.append(ReadRequest(rec, _bytes_of(target), f"item {t.fqn!r} at offset {list(off)}"))
            src.read(reqs)
            for view, scratch in copies:
                view.copy_(scratch)
            del reqs, copies
            for t in batch:
                writer.write(t, full.pop(t.fqn))
                res.bytes += t.nbytes
                bar.update(t.nbytes)
    finally:
        bar.close()


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
