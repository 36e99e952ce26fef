"""A framework's checkpoint dict as one DCP state dict: every tensor an item, the rest one pickle.

Frameworks hand over nested dicts with int keys (optimizer states), ``OrderedDict``\\ s, tuples,
empty containers and plain values (Lightning's ``checkpoint`` dict). DCP's own flattening turns
int keys into strings and drops empty containers, so such a dict would not come back as it was
saved. Here instead::

    flat = split(checkpoint)      # {"__tree__": bytes (the skeleton, torch.save'd), "<dotted path>": tensor, ...}
    dcp.save(flat, ...)           # each tensor is an item: captured lazily, checksummed, in the tiers
    ...
    checkpoint = join(loaded, weights_only=True)   # the same structure, types and keys

The skeleton is the dict with every tensor replaced by ``None`` plus the path of each tensor (a
tuple of the keys and indices leading to it), pickled with ``torch.save`` into a ``bytes`` value
(DCP keeps ``bytes`` whole, as one item): :func:`join` unpickles it with ``weights_only`` unless
told otherwise, so it loads under ``weights_only=True`` whenever the original dict would. Containers walked: ``dict``,
``OrderedDict``, ``list`` and ``tuple`` (exact types); anything else is a leaf, pickled whole
(tensors inside it too). Tensor keys are the dotted paths (``state_dict.layer.weight``,
``optimizer_states.0.state.0.exp_avg``), made unique with ``#n`` when two paths print alike.
Pure functions; no I/O.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["TREE_KEY", "split", "join", "tensor_bytes"]

TREE_KEY = "__tree__"
"""The item holding the pickled skeleton."""

_Path = tuple


def _walk(obj: Any, path: _Path, out: dict[_Path, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        out[path] = obj
        return None
    t = type(obj)
    if t is dict or t is OrderedDict:
        return t((k, _walk(v, path + (k,), out)) for k, v in obj.items())
    if t is list or t is tuple:
        return t(_walk(v, path + (i,), out) for i, v in enumerate(obj))
    return obj


def split(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as a flat DCP state dict: ``{TREE_KEY: bytes, <key>: tensor, ...}``.

    The tensors are ``state``'s own (no copy); the skeleton is pickled now, so later changes to
    non-tensor values do not reach the checkpoint."""
    found: dict[_Path, torch.Tensor] = {}
    tree = _walk(state, (), found)
    flat: dict[str, Any] = {}
    keys: list[tuple[_Path, str]] = []
    used = {TREE_KEY}
    for path, t in found.items():
        key = ".".join(str(p) for p in path) or "_"
        n = 1
        base = key
        while key in used:
            key = f"{base}#{n}"
            n += 1
        used.add(key)
        keys.append((path, key))
        flat[key] = t
    buf = io.BytesIO()
    torch.save({"version": 1, "tree": tree, "tensors": keys}, buf)
    flat[TREE_KEY] = buf.getvalue()
    return flat


def _fill(obj: Any, path: _Path, at: dict[_Path, torch.Tensor]) -> Any:
    if path in at:
        return at[path]
    t = type(obj)
    if t is dict or t is OrderedDict:
        return t((k, _fill(v, path + (k,), at)) for k, v in obj.items())
    if t is list or t is tuple:
        return t(_fill(v, path + (i,), at) for i, v in enumerate(obj))
    return obj


def join(flat: dict[str, Any], *, weights_only: bool = True) -> dict[str, Any]:
    """The dict :func:`split` was given, from the loaded flat dict (its tensors loaded). The
    skeleton is unpickled with ``torch.load(..., weights_only=weights_only)``: it raises what
    ``torch.load`` raises for a value that ``weights_only`` refuses."""
    raw = flat.get(TREE_KEY)
    if not isinstance(raw, (bytes, bytearray)):
        raise ValueError(f"{TREE_KEY!r} is missing or not bytes: not a tierckpt state tree")
    skel = torch.load(io.BytesIO(raw), weights_only=weights_only)
    if not isinstance(skel, dict) or skel.get("version") != 1:
        raise ValueError(f"{TREE_KEY!r} is not a tierckpt state tree (version 1)")
    at = {tuple(path): flat[key] for path, key in skel["tensors"]}
    return _fill(skel["tree"], (), at)


def tensor_bytes(flat: dict[str, Any]) -> int:
    """Bytes of the tensors in a flat dict (for logs and benchmarks)."""
    return sum(t.numel() * t.element_size() for t in flat.values() if isinstance(t, torch.Tensor))
