"""Checked JSON values and the tagged-value codec: the torch-free half of :mod:`tierckpt.dcpjson`.

``metadata.json`` comes from disk, so every value read from it is type- and range-checked here
(``_int``, ``_ints``, ``_str``, ... raise :class:`~tierckpt.errors.CorruptCheckpoint` with a short
description of the offending value, never the value itself when it is large). :class:`ValueCodec`
is the one engine behind both JSON dialects (``metadata.json``'s planner data here, the plan
cache's in :mod:`tierckpt.dcpjson`). :data:`DTYPE_SIZES` and :data:`MEMFMTS` name what a
tensor entry may hold.

Nothing here imports torch: :mod:`tierckpt.layout` parses and validates a whole ``metadata.json``
with it, so that the restore CLI's ``latest``, ``list``, ``verify`` and ``fetch`` start without
torch; DCP's objects are built from the checked values in :mod:`tierckpt.dcpjson`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from ..errors import CorruptCheckpoint

__all__ = ["DTYPE_SIZES", "MEMFMTS", "METADATA_VALUES", "ValueCodec", "CheckedEntry", "check_entry"]

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}
"""Tensor dtypes a checkpoint may hold (torch's names without ``torch.``) and their item sizes;
:data:`tierckpt.dcpjson.DTYPES` maps the same names to torch dtypes (a test checks they agree)."""

MEMFMTS = ("contiguous", "channels_last", "preserve", "channels_last_3d")
"""Memory formats a tensor entry may name."""


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

    def __init__(
        self,
        tuple_tag: str,
        dict_tag: str,
        *,
        strict: bool,
        max_depth: int | None,
        error: Callable[[str], Exception],
        refuse: Callable[[str, str], Exception],
        decode_prefix: str,
        malformed: str,
    ) -> None:
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


METADATA_VALUES = ValueCodec(
    "__tuple__",
    "__dict__",
    strict=True,
    max_depth=64,
    error=CorruptCheckpoint,
    refuse=_metadata_refusal,
    decode_prefix="metadata: planner_data",
    malformed="metadata: malformed planner_data",
)
"""The dialect of ``metadata.json`` (planner data)."""


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


# -- metadata.json: one state dict entry, checked ---------------------------------------------------


class CheckedEntry(NamedTuple):
    """One ``state_dict_metadata`` value of ``metadata.json``, checked (:func:`check_entry`).

    ``kind`` is ``"tensor"`` or ``"bytes"``; for bytes entries the other fields are empty.
    ``chunks`` holds ``(offsets, sizes)`` pairs that fit ``size``.
    """

    kind: str
    dtype: str = ""
    requires_grad: bool = False
    memory_format: str = "contiguous"
    pin_memory: bool = False
    size: list[int] = []
    chunks: list[tuple[list[int], list[int]]] = []


_BYTES_ENTRY = CheckedEntry("bytes")


def check_entry(m: Any) -> CheckedEntry:
    """Check one ``state_dict_metadata`` value (hot: one per state dict key); any failure is a
    :class:`CorruptCheckpoint` (or ``KeyError``/``TypeError`` for a missing field, which the
    caller turns into one). Unknown memory formats read as ``contiguous``, as before."""
    if type(m) is not dict:
        raise CorruptCheckpoint(f"metadata: an entry must be an object, got {_brief(m)}")
    kind = m["type"]
    if kind == "bytes":
        return _BYTES_ENTRY
    dtype = m["dtype"]
    if kind != "tensor" or type(dtype) is not str or dtype not in DTYPE_SIZES:
        raise CorruptCheckpoint(f"metadata: unsupported entry: type {_brief(kind)}, dtype {_brief(dtype)}")
    requires_grad, pin_memory = m.get("requires_grad", False), m.get("pin_memory", False)
    memfmt = m.get("memory_format", "contiguous")
    if type(requires_grad) is not bool or type(pin_memory) is not bool or type(memfmt) is not str:
        raise CorruptCheckpoint("metadata: requires_grad and pin_memory must be true or false, memory_format a string")
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
        chunks.append((offsets, sizes))
    return CheckedEntry(
        "tensor", dtype, requires_grad, memfmt if memfmt in MEMFMTS else "contiguous", pin_memory, size, chunks
    )
