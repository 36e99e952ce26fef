"""Bit-exact comparison of state dicts: dtype, shape and raw bytes (so NaN payloads, -0 and
subnormals must survive), never ``==`` on values."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["raw", "compare"]


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare(expected: dict, got: Any, prefix: str = "") -> list[str]:
    """The dotted keys of ``expected`` whose value differs in ``got`` (empty: identical).

    Nested dicts are walked (a missing or non-dict ``got`` counts as empty); tensors must match in
    type, dtype, shape and raw bytes; other values must compare equal. Keys only in ``got`` are
    ignored.
    """
    bad: list[str] = []
    for k, v in expected.items():
        g = got.get(k) if isinstance(got, dict) else None
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            bad += compare(v, g if isinstance(g, dict) else {}, name + ".")
        elif isinstance(v, torch.Tensor):
            if (
                not isinstance(g, torch.Tensor)
                or g.dtype != v.dtype
                or g.shape != v.shape
                or not torch.equal(raw(g), raw(v))
            ):
                bad.append(name)
        elif v != g:
            bad.append(name)
    return bad
