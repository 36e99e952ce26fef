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
import logging
import os
import time
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
from .outfiles import SAFETENSORS_DTYPES, _bytes_of, _SafetensorsWriter, _Tensor, _TorchSaveWriter, _Writer
from .source import CheckpointSource, ReadRequest
from .work import progress_bar

__all__ = ["BATCH_BYTES", "SAFETENSORS_DTYPES", "ConsolidateResult", "consolidate_checkpoint", "select_keys"]

log = logging.getLogger("tierckpt.restore")

BATCH_BYTES = 64 << 20

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
