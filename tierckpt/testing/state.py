"""Deterministic state builders: tensors whose every byte is random, rebuilt from a seed.

Random bytes (not random values) give NaN payloads, signed zeros and subnormals in float dtypes,
so a round trip that is not bit-exact shows. Every builder is a pure function of its arguments:
another process (a rank, a forked trainer, the test itself) rebuilds the same state.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["bits", "placeholder", "clone_state"]


def bits(shape: tuple[int, ...] | list[int], dtype: torch.dtype, seed: int | torch.Generator) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` whose bytes are uniformly random.

    ``seed``: an int (a fresh generator seeded with it: the same tensor every time) or a
    ``torch.Generator`` (consumed: successive calls give successive tensors). Either way exactly
    ``numel * element_size`` bytes are drawn with ``torch.randint(0, 256, ...)``.
    """
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).reshape(tuple(shape))


def placeholder(x: Any, fill: int | None = None) -> Any:
    """The load target for ``x``: the same nested dicts, each tensor replaced by a new tensor of the
    same dtype and shape, every other value by None.

    ``fill``: None zeroes the tensors; a byte value (0..255) fills every byte with it (e.g. 0x5A,
    so that a load which skips a tensor cannot pass for one that wrote zeros).
    """
    if isinstance(x, torch.Tensor):
        if fill is None:
            return torch.zeros_like(x)
        t = torch.empty_like(x)
        t.detach().reshape(-1).view(torch.uint8).fill_(fill)
        return t
    if isinstance(x, dict):
        return {k: placeholder(v, fill) for k, v in x.items()}
    return None


def clone_state(x: Any) -> Any:
    """A deep copy of the tensors of nested dicts (other values are shared, not copied)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: clone_state(v) for k, v in x.items()}
    return x
