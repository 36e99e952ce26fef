"""The byte layer: one module per tier (``local``, ``s3``), all implementing :class:`~.base.Tier`.

:func:`make_tiers` builds the configured tiers, fastest first, importing the S3 tier (and
boto3) only when an ``[s3]`` section exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import DataSink, ObjectInfo, Tier, check_key

if TYPE_CHECKING:
    from ..config import TierConfig

__all__ = ["Tier", "DataSink", "ObjectInfo", "check_key", "make_local", "make_s3", "make_tiers"]


def make_local(cfg: "TierConfig") -> Tier | None:
    """The local tier of ``cfg`` (``{node}`` filled for this process), or None."""
    if cfg.local is None:
        return None
    from .local import LocalTier

    return LocalTier(cfg.local.resolved_path(), fsync=cfg.local.fsync, node_local=cfg.local.node_local,
                     direct_io=cfg.local.direct_io, keep=cfg.local.keep, read_concurrency=cfg.local.flush_threads)


def make_s3(cfg: "TierConfig") -> Tier | None:
    """The S3 tier of ``cfg``, or None. Raises TierUnavailable with an install hint if boto3 is missing."""
    if cfg.s3 is None:
        return None
    try:
        from .s3 import S3Tier
    except ImportError as e:  # pragma: no cover - boto3 is a declared dependency
        from ..errors import TierUnavailable

        raise TierUnavailable(f"the [s3] tier needs boto3 ({e}): pip install boto3") from None
    return S3Tier(cfg.s3)


def make_tiers(cfg: "TierConfig") -> list[Tier]:
    """The configured tiers, fastest first."""
    return [t for t in (make_local(cfg), make_s3(cfg)) if t is not None]
