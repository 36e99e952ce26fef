"""The byte layer: one module per tier, all implementing :class:`~.base.Tier`, and the registry
that turns a configuration into the ordered chain of tiers.

A tier kind is registered once (:func:`register_tier`) with the configuration section that
describes it, its place in the chain and a factory. :func:`make_tiers` builds the configured
tiers, fastest first; the rest of the library reads tiers only through the :class:`Tier`
contract and its capability flags, never by name. The built-in kinds are ``local`` (a directory,
``tiers/local.py``) and ``s3`` (an S3-compatible object store, ``tiers/s3.py``, whose module and
boto3 are imported only when an ``[s3]`` section exists).

Adding a tier: one module implementing :class:`Tier`, one :func:`register_tier` call (with a
config dataclass when its section is new), and a subclass of the tier contract suite.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .base import DataSink, ObjectInfo, Tier, check_key

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["Tier", "DataSink", "ObjectInfo", "check_key", "TierKind", "register_tier", "tier_kinds",
           "make_tier", "make_tiers", "make_local", "make_s3", "Chain"]


@dataclass(frozen=True)
class TierKind:
    """One kind of tier in the registry.

    Attributes:
        name: the configuration section that configures it (``[name]``), also its ``Tier.name``.
        order: its place in the chain, fastest first (local 10, peer node 20, object store 30).
        build: makes the tier from the configuration (called only when ``[name]`` is present).
        config_cls: the section's dataclass, for sections not built into :class:`Config`
            (registered with :func:`tierckpt.config.register_section`); None for built-ins.
        required / sizes: keys of ``config_cls`` that must be given / that accept sizes.
    """

    name: str
    order: int
    build: Callable[["Config"], Tier]
    config_cls: type | None = None
    required: tuple[str, ...] = ()
    sizes: tuple[str, ...] = ()


_KINDS: dict[str, TierKind] = {}


def register_tier(kind: TierKind) -> None:
    """Add ``kind`` to the registry (idempotent for the same kind); its section becomes valid in
    configuration files. Call at import time of the module defining the tier."""
    if kind.config_cls is not None:
        from ..config import register_section

        register_section(kind.name, kind.config_cls, required=kind.required, sizes=kind.sizes)
    _KINDS[kind.name] = kind


def tier_kinds(cfg: "Config") -> list[TierKind]:
    """The registered kinds configured in ``cfg``, in chain order."""
    return sorted((k for k in _KINDS.values() if cfg.section(k.name) is not None), key=lambda k: k.order)


def make_tier(cfg: "Config", name: str) -> Tier | None:
    """The tier of section ``name`` (``{node}`` filled for this process), or None if not configured."""
    kind = _KINDS.get(name)
    if kind is None or cfg.section(name) is None:
        return None
    return kind.build(cfg)


def make_tiers(cfg: "Config") -> list[Tier]:
    """The configured tiers, fastest first."""
    return [k.build(cfg) for k in tier_kinds(cfg)]


def make_local(cfg: "Config") -> Tier | None:
    """The local tier of ``cfg``, or None."""
    return make_tier(cfg, "local")


def make_s3(cfg: "Config") -> Tier | None:
    """The S3 tier of ``cfg``, or None. Raises TierUnavailable with an install hint if boto3 is missing."""
    return make_tier(cfg, "s3")


class Chain:
    """The ordered tiers of one configuration (fastest first), each built on first use.

    Building a tier may be slow (an S3 client imports boto3 and resolves credentials), so the
    engine builds the chain at once but each tier only when a thread first needs it. ``tiers``
    given explicitly (tests, the chaos harness) are used as they are. Thread-safe.
    """

    def __init__(self, cfg: "Config", tiers: "list[Tier] | None" = None) -> None:
        self._lock = threading.Lock()
        if tiers is not None:
            if not tiers:
                raise ValueError("a chain needs at least one tier")
            self.names = [t.name for t in tiers]
            self._built: list[Tier | None] = list(tiers)
            self._kinds: list[TierKind | None] = [None] * len(tiers)
        else:
            kinds = tier_kinds(cfg)
            self.names = [k.name for k in kinds]
            self._built = [None] * len(kinds)
            self._kinds = list(kinds)
        self._cfg = cfg

    def __len__(self) -> int:
        return len(self._built)

    def __getitem__(self, i: int) -> Tier:
        with self._lock:
            t = self._built[i]
            if t is None:
                kind = self._kinds[i]
                assert kind is not None
                t = self._built[i] = kind.build(self._cfg)
            return t

    def __setitem__(self, i: int, tier: Tier) -> None:
        """Replace the tier at ``i`` under a live engine (tests and the chaos harness wrap a tier
        in a fault-injecting one between saves)."""
        with self._lock:
            self._built[i] = tier

    @property
    def first(self) -> Tier:
        """Where captured chunks are flushed and checkpoints first committed."""
        return self[0]

    def named(self, name: str) -> Tier:
        """The tier configured by section ``name``."""
        if name not in self.names:
            from ..errors import TierUnavailable

            raise TierUnavailable(f"no [{name}] tier in this chain ({', '.join(self.names)})")
        return self[self.names.index(name)]

    def built(self) -> list[Tier]:
        """The tiers built so far (to close them)."""
        with self._lock:
            return [t for t in self._built if t is not None]


def _build_local(cfg: "Config") -> Tier:
    from .local import LocalTier

    lc = cfg.local
    assert lc is not None
    return LocalTier(lc.resolved_path(), fsync=lc.fsync, node_local=lc.node_local, direct_io=lc.direct_io,
                     keep=lc.keep, read_concurrency=lc.flush_threads)


def _build_s3(cfg: "Config") -> Tier:
    try:
        from .s3 import S3Tier
    except ImportError as e:  # pragma: no cover - boto3 is a declared dependency
        from ..errors import TierUnavailable

        raise TierUnavailable(f"the [s3] tier needs boto3 ({e}): pip install boto3") from None
    assert cfg.s3 is not None
    return S3Tier(cfg.s3)


register_tier(TierKind("local", 10, _build_local))
register_tier(TierKind("s3", 30, _build_s3))
