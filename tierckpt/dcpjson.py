"""DCP objects to and from JSON: the one codec under ``metadata.json`` and the ``_plans/`` cache.

Two persisted formats use it, and both stay exactly as they were written before this module:

* ``metadata.json`` (:mod:`tierckpt.layout` assembles the document): one object per state dict
  entry (:func:`entry_to_json` / :func:`entry_from_json`) and planner data in the
  :data:`METADATA_VALUES` dialect (``{"__tuple__": ...}``, ``{"__dict__": ...}``). Its decoder
  trusts nothing: every value is type- and range-checked with the ``check_*`` helpers below
  and any failure is a :class:`~tierckpt.errors.CorruptCheckpoint`.
* the plan cache (:mod:`tierckpt.plancache` writes and reads the files): plans and metadata column
  by column (:func:`encode_plan`, :func:`encode_metadata`, tensor properties in a table) so that
  reading is ``json.loads`` plus one constructor call per object, and values in the
  :data:`PLAN_VALUES` dialect (``$T``, ``$d``, and ``$S``/``$D``/``$E``/``$`` for a few DCP types).
  Encoding raises ``TypeError`` for what it cannot represent (such plans are not persisted).

One tagged-value engine (:class:`ValueCodec`) serves both dialects; the dtype and memory-format
names and the construction of DCP's ``Metadata`` are defined once here. Pure functions, no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from typing import Any, Callable

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

from .errors import CorruptCheckpoint

__all__ = ["DTYPES", "MEMFMT", "ValueCodec", "METADATA_VALUES", "PLAN_VALUES", "new_metadata", "entry_to_json",
           "entry_from_json", "encode_plan", "decode_plan", "encode_metadata", "decode_metadata", "digest", "plan_hash"]

# -- names -------------------------------------------------------------------------------------

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.complex128, torch.complex64, torch.complex32,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.uint16, torch.uint32, torch.uint64, torch.bool,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    )
}
MEMFMT = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last,
           "preserve": torch.preserve_format, "channels_last_3d": torch.channels_last_3d}
MEMFMT_NAMES = {v: k for k, v in MEMFMT.items()}


def torch_attr(name: Any, kind: type) -> Any:
    """``torch.<name>`` if it is a ``kind`` (dtype, layout, memory format); else :class:`CorruptCheckpoint`."""
    v = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(v, kind):
        raise CorruptCheckpoint(f"plan cache: unknown {kind.__name__} {name!r}")
    return v



def new_metadata(sdm: dict[str, Any], planner_data: Any, storage_meta: Any, version: Any, **extra: Any) -> Metadata:
    """DCP ``Metadata``; ``version`` is passed only to a torch whose ``Metadata`` has that field."""
    kwargs: dict[str, Any] = dict(state_dict_metadata=sdm, planner_data=planner_data, storage_meta=storage_meta, **extra)
    if "version" in Metadata.__dataclass_fields__:
        kwargs["version"] = version
    return Metadata(**kwargs)


# -- tagged values (planner data, storage meta) -------------------------------------------------

_NONE = object()


class ValueCodec:
    """JSON form of plain values: ``None``/bool/int/float/str as themselves, lists as lists,
    tuples as ``{tuple_tag: [...]}``, dicts with string keys as ``{dict_tag: {...}}``.

    A dialect names its tags and its errors; subclasses add types (:meth:`encode_special`,
    :meth:`decode_special`). ``strict`` decoding accepts a tagged object only with exactly one
    key of the right JSON type. Decoding refuses more than 64 levels of nesting; encoding too
    when ``max_depth`` is set.
    """

    def __init__(self, tuple_tag: str, dict_tag: str, *, strict: bool, max_depth: int | None,
                 error: Callable[[str], Exception], refuse: Callable[[str, str], Exception], decode_prefix: str,
                 malformed: str) -> None:
        self.tuple_tag, self.dict_tag, self.strict, self.max_depth = tuple_tag, dict_tag, strict, max_depth
        self._error, self._refuse, self._prefix, self._malformed = error, refuse, decode_prefix, malformed

    def encode_special(self, x: Any, where: str, depth: int) -> Any:
        return _NONE

    def decode_special(self, x: dict, depth: int) -> Any:
        return _NONE

    def encode(self, x: Any, where: str = "", depth: int = 0) -> Any:
        if self.max_depth is not None and depth > self.max_depth:
            raise self._refuse("deep", where)
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        special = self.encode_special(x, where, depth)
        if special is not _NONE:
            return special
        if isinstance(x, tuple):
            return {self.tuple_tag: [self.encode(v, where, depth + 1) for v in x]}
        if isinstance(x, list):
            return [self.encode(v, where, depth + 1) for v in x]
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise self._refuse("keys", where)
            return {self.dict_tag: {k: self.encode(v, where, depth + 1) for k, v in x.items()}}
        special = self.encode_object(x, where, depth)
        if special is not _NONE:
            return special
        raise self._refuse(type(x).__name__, where)

    def encode_object(self, x: Any, where: str, depth: int) -> Any:
        return _NONE

    def decode(self, x: Any, depth: int = 0) -> Any:
        if depth > 64:
            raise self._error(f"{self._prefix} nested too deeply")
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [self.decode(v, depth + 1) for v in x]
        if isinstance(x, dict) and (len(x) == 1 or not self.strict):
            special = self.decode_special(x, depth)
            if special is not _NONE:
                return special
            t = x.get(self.tuple_tag, _NONE)
            if t is not _NONE and (isinstance(t, list) or not self.strict):
                return tuple(self.decode(v, depth + 1) for v in t)
            d = x.get(self.dict_tag, _NONE)
            if d is not _NONE and (isinstance(d, dict) or not self.strict):
                return {str(k): self.decode(v, depth + 1) for k, v in d.items()}
        raise self._error(self._malformed)


def _metadata_refusal(what: str, where: str) -> Exception:
    if what == "deep":  # the reader refuses deeper nesting: never write what cannot be read back
        return CorruptCheckpoint(f"{where}: nested more than 64 levels deep (cannot be stored in the metadata)")
    if what == "keys":
        return CorruptCheckpoint(f"{where}: dict keys must be strings to be stored as JSON")
    return CorruptCheckpoint(
        f"{where}: a {what} cannot be stored in JSON metadata "
        "(custom planners must keep planner_data to str/int/float/bool/None/list/tuple/dict)"
    )


METADATA_VALUES = ValueCodec("__tuple__", "__dict__", strict=True, max_depth=64, error=CorruptCheckpoint,
                             refuse=_metadata_refusal, decode_prefix="metadata: planner_data",
                             malformed="metadata: malformed planner_data")
"""The dialect of ``metadata.json`` (planner data)."""


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
            return {"$": type(x).__name__, "f": {f.name: self.encode(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}}
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
_ENUMS: dict[str, type] = {"WriteItemType": WriteItemType}


def _plan_refusal(what: str, where: str) -> Exception:
    return TypeError("cannot persist a dict with non-string keys" if what == "keys" else f"cannot persist a {what}")


PLAN_VALUES = _PlanValues("$T", "$d", strict=False, max_depth=None, error=CorruptCheckpoint, refuse=_plan_refusal,
                          decode_prefix="plan cache:", malformed="plan cache: malformed value")
"""The dialect of the plan cache (planner data other than DCP's key mappings, storage meta)."""


# -- checked values (metadata.json comes from disk: trust nothing) ------------------------------

def _cut(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _brief(x: Any) -> str:
    """A short description of a JSON value for a message (never the whole of a large value)."""
    if isinstance(x, str):
        return repr(x) if len(x) <= 60 else repr(x[:60]) + f"... ({len(x)} characters)"
    if isinstance(x, bool) or x is None or isinstance(x, float):
        return repr(x)
    if isinstance(x, int):
        digits = len(str(abs(x))) if abs(x) < 10**60 else 61
        return repr(x) if digits <= 24 else f"an integer of {digits if digits <= 60 else 'over 60'} digits"
    if isinstance(x, list):
        return f"a list of {len(x)} element(s)"
    if isinstance(x, dict):
        return f"an object with {len(x)} key(s)"
    return type(x).__name__


_MAX_INT = 1 << 62


def _int(x: Any, what: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    if type(x) is not int or not (lo <= x <= hi):  # JSON integers are exactly int (never bool)
        raise CorruptCheckpoint(f"metadata: {what} must be an integer in [{lo}, {hi}], got {_brief(x)}")
    return x


def _ints(xs: Any, what: str, max_len: int = 64, hi: int = _MAX_INT) -> list[int]:
    """``xs`` itself if it is a list of at most ``max_len`` integers in ``[0, hi]``."""
    if type(xs) is not list or len(xs) > max_len:
        raise CorruptCheckpoint(f"metadata: {what} must be a list of at most {max_len} integers, got {_brief(xs)}")
    for v in xs:
        if type(v) is not int or not 0 <= v <= hi:
            raise CorruptCheckpoint(f"metadata: {what} must hold integers in [0, {hi}], got {_brief(v)}")
    return xs


def _obj(x: Any, what: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise CorruptCheckpoint(f"metadata: {what} must be an object, got {_brief(x)}")
    return x


def _list(x: Any, what: str) -> list[Any]:
    if not isinstance(x, list):
        raise CorruptCheckpoint(f"metadata: {what} must be a list, got {_brief(x)}")
    return x


def _req(d: dict[str, Any], key: str, what: str) -> Any:
    if key not in d:
        raise CorruptCheckpoint(f"metadata: {what} has no {key!r}")
    return d[key]


def _str(x: Any, what: str, max_len: int = 1 << 20, *, none: bool = False) -> Any:
    if x is None and none:
        return None
    if not isinstance(x, str) or len(x) > max_len:
        raise CorruptCheckpoint(f"metadata: {what} must be a string of at most {max_len} characters, got {_brief(x)}")
    return x


def _time(x: Any, what: str) -> float:
    """A time stamp (seconds since the epoch): a finite, non-negative number."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0 <= x < 1e12):
        raise CorruptCheckpoint(f"metadata: {what} must be a time in seconds since the epoch, got {_brief(x)}")
    return float(x)



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
    if type(m) is not dict:
        raise CorruptCheckpoint(f"metadata: an entry must be an object, got {_brief(m)}")
    kind = m["type"]
    if kind == "bytes":
        return BytesStorageMetadata()
    dtype = m["dtype"]
    if kind != "tensor" or type(dtype) is not str or dtype not in DTYPES:
        raise CorruptCheckpoint(f"metadata: unsupported entry: type {_brief(kind)}, dtype {_brief(dtype)}")
    requires_grad, pin_memory = m.get("requires_grad", False), m.get("pin_memory", False)
    memfmt = m.get("memory_format", "contiguous")
    if type(requires_grad) is not bool or type(pin_memory) is not bool or type(memfmt) is not str:
        raise CorruptCheckpoint("metadata: requires_grad and pin_memory must be true or false, memory_format a string")
    props = TensorProperties(dtype=DTYPES[dtype], requires_grad=requires_grad,
                             memory_format=MEMFMT.get(memfmt, torch.contiguous_format), pin_memory=pin_memory)
    size = _ints(m["size"], "size")
    rank = len(size)
    chunks = []
    for c in _list(m["chunks"], "chunks"):
        if type(c) is not dict:
            raise CorruptCheckpoint(f"metadata: a chunk must be an object, got {_brief(c)}")
        offsets, sizes = _ints(c["offsets"], "chunk offsets"), _ints(c["sizes"], "chunk sizes")
        if len(offsets) != rank or len(sizes) != rank:
            raise CorruptCheckpoint(f"metadata: a chunk has {len(offsets)}/{len(sizes)} dimensions, the tensor {rank}")
        for o, n, full in zip(offsets, sizes, size):
            if o + n > full:
                raise CorruptCheckpoint(f"metadata: a chunk {offsets}+{sizes} does not fit the tensor's size {size}")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)



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
    return [TensorProperties(dtype=torch_attr(d, torch.dtype), layout=torch_attr(lay, torch.layout),
                             requires_grad=bool(rg), memory_format=torch_attr(mf, torch.memory_format),
                             pin_memory=bool(pin)) for d, lay, rg, mf, pin in rows]


def _enc_planner_data(x: Any) -> Any:
    if isinstance(x, dict) and all(isinstance(k, str) and isinstance(v, tuple) and all(isinstance(e, (str, int)) for e in v)
                                   for k, v in x.items()):
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
    fqn, off, hint, typ, prop, size, coff, csz, bio = [], [], [], [], [], [], [], [], []
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
    return {"fqn": fqn, "off": off, "hint": hint, "type": typ, "prop": prop, "size": size, "coff": coff, "csz": csz,
            "bio": bio, "props": table.rows, "pd": _enc_planner_data(plan.planner_data), "usable": bool(plan.usable)}


def decode_plan(d: dict) -> SavePlan:
    props = _props(d["props"])
    types = {n: WriteItemType[n] for n in set(d["type"])}
    items = []
    for f, o, h, t, p, sz, co, cs, b in zip(d["fqn"], d["off"], d["hint"], d["type"], d["prop"], d["size"], d["coff"],
                                            d["csz"], d["bio"], strict=True):
        idx = MetadataIndex(str(f), None if o is None else torch.Size(o), None if h is None else int(h))
        td = None if p < 0 else TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(co), sizes=torch.Size(cs)), properties=props[p], size=torch.Size(sz))
        if b is not None and _HAS_BYTES_IO:
            items.append(WriteItem(index=idx, type=types[t], tensor_data=td, bytes_io_data=BytesIOWriteData(nbytes=int(b))))
        else:
            items.append(WriteItem(index=idx, type=types[t], tensor_data=td))
    return SavePlan(items, planner_data=_dec_planner_data(d["pd"]), usable=bool(d["usable"]))


def encode_metadata(md: Metadata) -> dict:
    """DCP's global Metadata, column by column (its storage data is not kept)."""
    table = _PropsTable()
    keys, prop, size, chunks = [], [], [], []
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
    return {"keys": keys, "prop": prop, "size": size, "chunks": chunks, "props": table.rows,
            "pd": _enc_planner_data(md.planner_data), "sm": PLAN_VALUES.encode(md.storage_meta), "version": getattr(md, "version", None)}


def decode_metadata(d: dict) -> Metadata:
    props = _props(d["props"])
    sdm: dict[str, Any] = {}
    for k, p, sz, ch in zip(d["keys"], d["prop"], d["size"], d["chunks"], strict=True):
        if p < 0:
            sdm[str(k)] = BytesStorageMetadata()
        else:
            sdm[str(k)] = TensorStorageMetadata(properties=props[p], size=torch.Size(sz), chunks=[
                ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(z)) for o, z in ch])
    return new_metadata(sdm, _dec_planner_data(d["pd"]), PLAN_VALUES.decode(d["sm"]), d.get("version"))


def digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def plan_hash(plan: SavePlan) -> str:
    """SHA-256 of a plan's items and planner data (keys, offsets, item types, sizes, chunks and
    tensor properties, dtypes included); its storage data does not count."""
    return digest(encode_plan(plan))

