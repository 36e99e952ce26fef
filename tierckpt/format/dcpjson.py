"""DCP objects to and from JSON: the one codec under ``metadata.json`` and the ``_plans/`` cache.

Two persisted formats use it, and both stay exactly as they were written before this module:

* ``metadata.json`` (:mod:`tierckpt.layout` assembles the document): one object per state dict
  entry (:func:`entry_to_json` / :func:`entry_from_json`) and planner data in the
  :data:`METADATA_VALUES` dialect (``{"__tuple__": ...}``, ``{"__dict__": ...}``). Its decoder
  trusts nothing: every value is type- and range-checked by the torch-free helpers of
  :mod:`tierckpt.jsonvalues` (re-exported here) and any failure is a
  :class:`~tierckpt.errors.CorruptCheckpoint`.
* the plan cache (:mod:`tierckpt.plancache` writes and reads the files): plans and metadata column
  by column (:func:`encode_plan`, :func:`encode_metadata`, tensor properties in a table) so that
  reading is ``json.loads`` plus one constructor call per object, and values in the
  :data:`PLAN_VALUES` dialect (``$T``, ``$d``, and ``$S``/``$D``/``$E``/``$`` for a few DCP types).
  Encoding raises ``TypeError`` for what it cannot represent (such plans are not persisted).

One tagged-value engine (:class:`ValueCodec`) serves both dialects; the dtype and memory-format
names live in :mod:`tierckpt.jsonvalues`, the construction of DCP's objects here. Pure functions, no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

try:
    from torch.distributed.checkpoint.planner import BytesIOWriteData
except ImportError:  # a torch without it: its WriteItems have no bytes_io_data either
    BytesIOWriteData = None  # type: ignore[assignment,misc]

from ..errors import CorruptCheckpoint
from .jsonvalues import (  # noqa: F401 - the checked-value helpers are re-exported (layout, plancache use them)
    _MAX_INT,
    _NONE,
    DTYPE_SIZES,
    METADATA_VALUES,
    CheckedEntry,
    ValueCodec,
    _brief,
    _cut,
    _int,
    _ints,
    _list,
    _obj,
    _req,
    _str,
    _time,
    check_entry,
)

__all__ = [
    "DTYPES",
    "MEMFMT",
    "ValueCodec",
    "METADATA_VALUES",
    "PLAN_VALUES",
    "new_metadata",
    "entry_to_json",
    "entry_from_json",
    "entry_from_checked",
    "encode_plan",
    "decode_plan",
    "encode_metadata",
    "decode_metadata",
    "digest",
    "plan_hash",
]

# -- names -------------------------------------------------------------------------------------

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}
"""The dtypes a checkpoint may hold, by name (:data:`tierckpt.jsonvalues.DTYPE_SIZES`)."""
MEMFMT = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve": torch.preserve_format,
    "channels_last_3d": torch.channels_last_3d,
}
MEMFMT_NAMES = {v: k for k, v in MEMFMT.items()}


def torch_attr(name: Any, kind: type) -> Any:
    """``torch.<name>`` if it is a ``kind`` (dtype, layout, memory format); else :class:`CorruptCheckpoint`."""
    v = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(v, kind):
        raise CorruptCheckpoint(f"plan cache: unknown {kind.__name__} {name!r}")
    return v


def new_metadata(sdm: dict[str, Any], planner_data: Any, storage_meta: Any, version: Any, **extra: Any) -> Metadata:
    """DCP ``Metadata``; ``version`` is passed only to a torch whose ``Metadata`` has that field."""
    kwargs: dict[str, Any] = dict(
        state_dict_metadata=sdm, planner_data=planner_data, storage_meta=storage_meta, **extra
    )
    if "version" in Metadata.__dataclass_fields__:
        kwargs["version"] = version
    return Metadata(**kwargs)


class _PlanValues(ValueCodec):
    """The plan cache's dialect: also ``torch.Size`` (``$S``), dtypes (``$D``), the enums of
    :data:`_ENUMS` (``$E``) and the dataclasses of :data:`_CLASSES` (``$``); only those are built."""

    def encode_special(self, x: Any, where: str, depth: int) -> Any:
        if isinstance(x, torch.Size):
            return {"$S": list(x)}
        if isinstance(x, torch.dtype):
            return {"$D": str(x).removeprefix("torch.")}
        if isinstance(x, enum.Enum):
            if type(x).__name__ not in _ENUMS:
                raise TypeError(f"cannot persist enum {type(x).__name__}")
            return {"$E": type(x).__name__, "v": x.name}
        return _NONE

    def encode_object(self, x: Any, where: str, depth: int) -> Any:
        if dataclasses.is_dataclass(x) and _CLASSES.get(type(x).__name__) is type(x):
            return {
                "$": type(x).__name__,
                "f": {f.name: self.encode(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init},
            }
        return _NONE

    def decode_special(self, x: dict, depth: int) -> Any:
        if "$" in x:
            cls = _CLASSES.get(x["$"])
            if cls is None or not isinstance(x.get("f"), dict):
                raise CorruptCheckpoint(f"plan cache: unknown class {x.get('$')!r}")
            names = {f.name for f in dataclasses.fields(cls) if f.init}
            return cls(**{k: self.decode(v, depth + 1) for k, v in x["f"].items() if k in names})
        if "$S" in x:
            return torch.Size([int(v) for v in x["$S"]])
        if "$D" in x:
            return torch_attr(x["$D"], torch.dtype)
        if "$E" in x:
            e = _ENUMS.get(x["$E"])
            if e is None or x.get("v") not in e.__members__:
                raise CorruptCheckpoint("plan cache: unknown enum value")
            return e[x["v"]]
        return _NONE


_CLASSES: dict[str, type] = {c.__name__: c for c in (StorageMeta,)}
_ENUMS: dict[str, type[enum.Enum]] = {"WriteItemType": WriteItemType}


def _plan_refusal(what: str, where: str) -> Exception:
    return TypeError("cannot persist a dict with non-string keys" if what == "keys" else f"cannot persist a {what}")


PLAN_VALUES = _PlanValues(
    "$T",
    "$d",
    strict=False,
    max_depth=None,
    error=CorruptCheckpoint,
    refuse=_plan_refusal,
    decode_prefix="plan cache:",
    malformed="plan cache: malformed value",
)
"""The dialect of the plan cache (planner data other than DCP's key mappings, storage meta)."""


# -- metadata.json: one state dict entry ----------------------------------------------------------


def entry_to_json(fqn: str, m: Any) -> dict[str, Any]:
    """One ``state_dict_metadata`` value as ``metadata.json`` stores it."""
    if isinstance(m, TensorStorageMetadata):
        p = m.properties
        return {
            "type": "tensor",
            "dtype": str(p.dtype).removeprefix("torch."),
            "requires_grad": bool(p.requires_grad),
            "memory_format": MEMFMT_NAMES.get(p.memory_format, "contiguous"),
            "pin_memory": bool(p.pin_memory),
            "size": list(m.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks],
        }
    if isinstance(m, BytesStorageMetadata):
        return {"type": "bytes"}
    raise CorruptCheckpoint(f"metadata: unsupported storage metadata {type(m).__name__} for {fqn!r}")


def entry_from_json(m: Any) -> Any:
    """One ``state_dict_metadata`` value -> DCP storage metadata (hot: one per state dict key)."""
    return entry_from_checked(check_entry(m))


def entry_from_checked(e: CheckedEntry) -> Any:
    """DCP storage metadata of an entry :func:`tierckpt.jsonvalues.check_entry` accepted."""
    if e.kind == "bytes":
        return BytesStorageMetadata()
    props = TensorProperties(
        dtype=DTYPES[e.dtype],
        requires_grad=e.requires_grad,
        memory_format=MEMFMT[e.memory_format],
        pin_memory=e.pin_memory,
    )
    chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(z)) for o, z in e.chunks]
    return TensorStorageMetadata(properties=props, size=torch.Size(e.size), chunks=chunks)


# -- the plan cache: plans and metadata column by column -------------------------------------------


def _name(x: Any) -> str:
    return str(x).removeprefix("torch.")


class _PropsTable:
    """Distinct TensorProperties of a plan or metadata, numbered."""

    def __init__(self) -> None:
        self.rows: list[list] = []
        self._ids: dict[tuple, int] = {}

    def id(self, p: TensorProperties) -> int:
        key = (_name(p.dtype), _name(p.layout), bool(p.requires_grad), _name(p.memory_format), bool(p.pin_memory))
        i = self._ids.get(key)
        if i is None:
            i = self._ids[key] = len(self.rows)
            self.rows.append(list(key))
        return i


def _props(rows: list) -> list[TensorProperties]:
    return [
        TensorProperties(
            dtype=torch_attr(d, torch.dtype),
            layout=torch_attr(lay, torch.layout),
            requires_grad=bool(rg),
            memory_format=torch_attr(mf, torch.memory_format),
            pin_memory=bool(pin),
        )
        for d, lay, rg, mf, pin in rows
    ]


def _enc_planner_data(x: Any) -> Any:
    if isinstance(x, dict) and all(
        isinstance(k, str) and isinstance(v, tuple) and all(isinstance(e, (str, int)) for e in v) for k, v in x.items()
    ):
        return {"keys": list(x), "paths": [list(v) for v in x.values()]}  # DCP's flattening mappings
    return {"any": PLAN_VALUES.encode(x)}


def _dec_planner_data(d: Any) -> Any:
    if "keys" in d:
        return {str(k): tuple(v) for k, v in zip(d["keys"], d["paths"])}
    return PLAN_VALUES.decode(d["any"])


_HAS_BYTES_IO = BytesIOWriteData is not None and "bytes_io_data" in getattr(WriteItem, "__dataclass_fields__", {})


def encode_plan(plan: SavePlan) -> dict:
    """A SavePlan, column by column (its storage data is not kept)."""
    table = _PropsTable()
    fqn: list[Any] = []
    off: list[Any] = []
    hint: list[Any] = []
    typ: list[Any] = []
    prop: list[Any] = []
    size: list[list[int] | None] = []
    coff: list[list[int] | None] = []
    csz: list[list[int] | None] = []
    bio: list[Any] = []
    for it in plan.items:
        ix = it.index
        fqn.append(ix.fqn)
        off.append(None if ix.offset is None else list(ix.offset))
        hint.append(ix.index)
        typ.append(it.type.name)
        td = it.tensor_data
        if td is None:
            prop.append(-1)
            size.append(None)
            coff.append(None)
            csz.append(None)
        else:
            prop.append(table.id(td.properties))
            size.append(list(td.size))
            coff.append(list(td.chunk.offsets))
            csz.append(list(td.chunk.sizes))
        b = getattr(it, "bytes_io_data", None)
        bio.append(None if b is None else int(b.nbytes))
    return {
        "fqn": fqn,
        "off": off,
        "hint": hint,
        "type": typ,
        "prop": prop,
        "size": size,
        "coff": coff,
        "csz": csz,
        "bio": bio,
        "props": table.rows,
        "pd": _enc_planner_data(plan.planner_data),
        "usable": bool(plan.usable),
    }


def decode_plan(d: dict) -> SavePlan:
    props = _props(d["props"])
    types = {n: WriteItemType[n] for n in set(d["type"])}
    items = []
    for f, o, h, t, p, sz, co, cs, b in zip(
        d["fqn"], d["off"], d["hint"], d["type"], d["prop"], d["size"], d["coff"], d["csz"], d["bio"], strict=True
    ):
        idx = MetadataIndex(str(f), None if o is None else torch.Size(o), None if h is None else int(h))
        td = (
            None
            if p < 0
            else TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(co), sizes=torch.Size(cs)),
                properties=props[p],
                size=torch.Size(sz),
            )
        )
        if b is not None and _HAS_BYTES_IO:
            items.append(
                WriteItem(index=idx, type=types[t], tensor_data=td, bytes_io_data=BytesIOWriteData(nbytes=int(b)))
            )
        else:
            items.append(WriteItem(index=idx, type=types[t], tensor_data=td))
    return SavePlan(items, planner_data=_dec_planner_data(d["pd"]), usable=bool(d["usable"]))


def encode_metadata(md: Metadata) -> dict:
    """DCP's global Metadata, column by column (its storage data is not kept)."""
    table = _PropsTable()
    keys: list[Any] = []
    prop: list[Any] = []
    size: list[list[int] | None] = []
    chunks: list[list[list[list[int]]] | None] = []
    for k, m in md.state_dict_metadata.items():
        keys.append(k)
        if isinstance(m, TensorStorageMetadata):
            prop.append(table.id(m.properties))
            size.append(list(m.size))
            chunks.append([[list(c.offsets), list(c.sizes)] for c in m.chunks])
        elif isinstance(m, BytesStorageMetadata):
            prop.append(-1)
            size.append(None)
            chunks.append(None)
        else:
            raise TypeError(f"cannot persist storage metadata {type(m).__name__}")
    return {
        "keys": keys,
        "prop": prop,
        "size": size,
        "chunks": chunks,
        "props": table.rows,
        "pd": _enc_planner_data(md.planner_data),
        "sm": PLAN_VALUES.encode(md.storage_meta),
        "version": getattr(md, "version", None),
    }


def decode_metadata(d: dict) -> Metadata:
    props = _props(d["props"])
    sdm: dict[str, Any] = {}
    for k, p, sz, ch in zip(d["keys"], d["prop"], d["size"], d["chunks"], strict=True):
        if p < 0:
            sdm[str(k)] = BytesStorageMetadata()
        else:
            sdm[str(k)] = TensorStorageMetadata(
                properties=props[p],
                size=torch.Size(sz),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(z)) for o, z in ch],
            )
    return new_metadata(sdm, _dec_planner_data(d["pd"]), PLAN_VALUES.decode(d["sm"]), d.get("version"))


def digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def plan_hash(plan: SavePlan) -> str:
    """SHA-256 of a plan's items and planner data (keys, offsets, item types, sizes, chunks and
    tensor properties, dtypes included); its storage data does not count."""
    return digest(encode_plan(plan))
