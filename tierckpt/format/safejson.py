"""Bounded JSON decoding of untrusted bytes (checkpoint metadata read back from a tier).

:func:`loads` decodes UTF-8 JSON like :func:`json.loads` but refuses, with
:class:`JSONRejected` (a ``ValueError``), everything a hostile file could use to crash or stall
the reader:

* nesting deeper than ``max_depth`` (checked *before* decoding, by a linear scan, so the
  recursive decoder never runs out of stack, whatever ``sys.getrecursionlimit()`` says;
  a :class:`RecursionError` from the decoder is turned into :class:`JSONRejected` as well);
* ``NaN``, ``Infinity``, ``-Infinity`` and floats that overflow to infinity (``1e999``);
* integers with more than :data:`MAX_INT_DIGITS` digits (``int()`` of a long digit string is
  quadratic when ``sys.set_int_max_str_digits(0)`` lifted CPython's own limit);
* duplicate keys in an object (two parsers could disagree on which one counts);
* bytes that are not UTF-8 (``json.loads`` would otherwise guess UTF-16/32).

Time and memory are linear in ``len(data)``: the scan uses bytes methods and numpy over
bounded chunks; decoding builds the objects the text describes (the caller bounds the size).
The error messages are short and never quote the input beyond a position.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

__all__ = ["JSONRejected", "MAX_DEPTH", "MAX_INT_DIGITS", "loads", "too_deep"]

MAX_DEPTH = 200
"""Default bound on the nesting of arrays and objects."""
MAX_INT_DIGITS = 40
"""Longest integer literal accepted (2**128 has 39 digits)."""

_CHUNK = 1 << 22
_QUOTE = ord('"')
_STRUCT = b'"[]{}'
_DELETE_ALL_BUT_STRUCT = bytes(c for c in range(256) if c not in _STRUCT)
_STEP = np.zeros(256, dtype=np.int8)
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")


class JSONRejected(ValueError):
    """The bytes are not JSON, or JSON outside the bounds :func:`loads` enforces."""


def too_deep(data: bytes, limit: int) -> bool:
    """Whether arrays/objects in the JSON text ``data`` (UTF-8) nest deeper than ``limit``.

    Brackets inside strings do not count. Sound for what a JSON decoder reaches: up to the
    first syntax error the scan sees the same strings the decoder does (it may over-count
    after it, which only rejects a text the decoder would reject anyway).
    """
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    if b"\\" in data:
        # Escapes only occur inside strings: drop escaped backslashes, then escaped quotes, so
        # that every remaining quote opens or closes a string.
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Only quotes and brackets matter; dropping adjacent quote pairs keeps every bracket's
    # inside/outside-a-string parity and removes nearly all quotes of real metadata.
    s = data.translate(None, _DELETE_ALL_BUT_STRUCT).replace(b'""', b"")
    arr = np.frombuffer(s, dtype=np.uint8)
    has_quotes = b'"' in s
    depth = 0
    parity = 0
    for i in range(0, len(arr), _CHUNK):
        a = arr[i : i + _CHUNK]
        step = _STEP[a].astype(np.int64)
        if has_quotes:
            q = a == _QUOTE
            inside = ((np.cumsum(q, dtype=np.int64) + parity) & 1).astype(bool)
            step[inside] = 0
            parity = (parity + int(q.sum())) & 1
        levels = np.cumsum(step) + depth
        if len(levels) and int(levels.max()) > limit:
            return True
        if len(levels):
            depth = int(levels[-1])
    return False


def _reject_constant(name: str) -> Any:
    raise JSONRejected(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONRejected(f"number {text[:24]}{'...' if len(text) > 24 else ''} is out of range")
    return value


def _short_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JSONRejected(f"integer with {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise JSONRejected(f"duplicate key {dup[:60]!r} in an object")
    return obj


def loads(data: bytes | bytearray | memoryview, *, max_depth: int = MAX_DEPTH) -> Any:
    """Decode the UTF-8 JSON text ``data`` within the bounds in the module docstring.

    Raises :class:`JSONRejected` (a ``ValueError``) for anything else; never ``RecursionError``.
    """
    raw = bytes(data)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JSONRejected(f"not UTF-8 text (byte {e.start})") from None
    if too_deep(raw, max_depth):
        raise JSONRejected(f"arrays/objects nested deeper than {max_depth} levels")
    long_ints = b"0" * (MAX_INT_DIGITS + 1) in raw.translate(_DIGITS_TO_ZERO)
    try:
        return json.loads(
            text,
            object_pairs_hook=_unique_keys,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            parse_int=_short_int if long_ints else None,
        )
    except JSONRejected:
        raise
    except RecursionError:
        raise JSONRejected("arrays/objects nested too deeply for this interpreter's recursion limit") from None
    except ValueError as e:  # json.JSONDecodeError, and int() past sys.get_int_max_str_digits()
        msg = str(e)
        raise JSONRejected(msg if len(msg) <= 200 else msg[:197] + "...") from None
