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

Stage ``tiers`` (the byte layer). May import ``config`` and the base modules (:mod:`tierckpt.errors`,
:mod:`tierckpt.checksum`) only; it never sees a ``SavePlan`` or parses a checkpoint. May be
imported by every stage above it (``format`` upward), integrations, testing and ``restore/``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import DataSink, ObjectInfo, Tier, check_key

if TYPE_CHECKING:
    from ..config import Config

__all__ = [
    "Tier",
    "DataSink",
    "ObjectInfo",
    "check_key",
    "TierKind",
    "register_tier",
    "tier_kinds",
    "make_tier",
    "make_tiers",
    "make_local",
    "make_s3",
    "make_node_tiers",
    "is_node_name",
    "Chain",
]


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
        for_node: for node-local kinds, ``(cfg, node)`` -> the tier as node ``node`` sees it
            (its ``{node}`` filled with that name) and ``nodes(cfg)`` -> the node names whose
            tiers exist where this process can see them (:func:`make_node_tiers`).
    """

    name: str
    order: int
    build: Callable[[Config], Tier]
    config_cls: type | None = None
    required: tuple[str, ...] = ()
    sizes: tuple[str, ...] = ()
    for_node: Callable[[Config, str], Tier] | None = None
    nodes: Callable[[Config], list[str]] | None = None


_KINDS: dict[str, TierKind] = {}


def register_tier(kind: TierKind) -> None:
    """Add ``kind`` to the registry (idempotent for the same kind); its section becomes valid in
    configuration files. Call at import time of the module defining the tier."""
    if kind.config_cls is not None:
        from ..config import register_section

        register_section(kind.name, kind.config_cls, required=kind.required, sizes=kind.sizes)
    _KINDS[kind.name] = kind


def tier_kinds(cfg: Config) -> list[TierKind]:
    """The registered kinds configured in ``cfg``, in chain order."""
    return sorted((k for k in _KINDS.values() if cfg.section(k.name) is not None), key=lambda k: k.order)


def make_tier(cfg: Config, name: str) -> Tier | None:
    """The tier of section ``name`` (``{node}`` filled for this process), or None if not configured."""
    kind = _KINDS.get(name)
    if kind is None or cfg.section(name) is None:
        return None
    return kind.build(cfg)


_warned_first: set[str] = set()


def make_tiers(cfg: Config) -> list[Tier]:
    """The configured tiers, fastest first. A first tier with an encoding (``[s3] compression``
    without ``[local]``) stores its files as written: encoding happens on hops (logged once)."""
    tiers = [k.build(cfg) for k in tier_kinds(cfg)]
    if tiers and tiers[0].encoding is not None and tiers[0].name not in _warned_first:
        _warned_first.add(tiers[0].name)
        logging.getLogger("tierckpt").warning(
            "[%s] compression / copy_unchanged apply to the copy into it from an earlier tier; as the first tier "
            "it stores files as written (docs/compression.md)",
            tiers[0].name,
        )
    return tiers


_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def is_node_name(name: object) -> bool:
    """Whether ``name`` can be a node name filled into a tier's ``{node}`` (no path separators,
    no ``..``): names read from files (``peers.json``) are checked with it before use."""
    return isinstance(name, str) and bool(_NODE_RE.match(name)) and ".." not in name


def make_node_tiers(cfg: Config, nodes: Iterable[str] = ()) -> dict[str, Tier]:
    """Other nodes' copies of the first configured tier, when it is node-local: node name ->
    the tier as that node sees it, for the names in ``nodes`` and those its kind finds (e.g.
    the directories next to this node's). Only tiers this process can see are built (a shared or
    NFS-mounted node directory); whether they can be read is for the caller to find out. This
    node's own name is left out; invalid names (:func:`is_node_name`) are ignored. Empty when
    the first tier is not node-local or its kind cannot be built for another node.
    """
    from ..config.values import node_name

    kinds = tier_kinds(cfg)
    for_node = kinds[0].for_node if kinds else None
    if for_node is None:
        return {}
    kind = kinds[0]
    names = set(nodes) | set(kind.nodes(cfg) if kind.nodes is not None else [])
    me = node_name()
    return {n: for_node(cfg, n) for n in sorted(names) if is_node_name(n) and n != me}


def make_local(cfg: Config) -> Tier | None:
    """The local tier of ``cfg``, or None."""
    return make_tier(cfg, "local")


def make_s3(cfg: Config) -> Tier | None:
    """The S3 tier of ``cfg``, or None. Raises TierUnavailable with an install hint if boto3 is missing."""
    return make_tier(cfg, "s3")


class Chain:
    """The ordered tiers of one configuration (fastest first), each built on first use.

    Building a tier may be slow (an S3 client imports boto3 and resolves credentials), so the
    engine builds the chain at once but each tier only when a thread first needs it. ``tiers``
    given explicitly (tests, the chaos harness) are used as they are. Thread-safe.
    """

    def __init__(self, cfg: Config, tiers: list[Tier] | None = None) -> None:
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


def _build_local(cfg: Config) -> Tier:
    from .local import LocalTier

    lc = cfg.local
    assert lc is not None
    return LocalTier(
        lc.resolved_path(),
        fsync=lc.fsync,
        node_local=lc.node_local,
        direct_io=lc.direct_io,
        keep=lc.keep,
        read_concurrency=lc.flush_threads,
    )


def _local_for_node(cfg: Config, node: str) -> Tier:
    """The local tier of node ``node`` (``{node}`` in ``[local] path`` filled with it)."""
    from .local import LocalTier

    lc = cfg.local
    assert lc is not None
    other = dataclasses.replace(lc, path=lc.path.replace("{node}", node))
    return LocalTier(
        other.resolved_path(),
        fsync=lc.fsync,
        node_local=True,
        direct_io=lc.direct_io,
        keep=lc.keep,
        read_concurrency=lc.flush_threads,
    )


def _local_nodes(cfg: Config) -> list[str]:
    """Node names whose ``[local]`` directories exist here: the path with ``{node}`` as a
    wildcard, matched against the directories of the path's fixed part (``/nvme/ckpt/{node}``:
    the entries of ``/nvme/ckpt``). Unreadable parents give no names."""
    import glob
    import os
    import socket

    lc = cfg.local
    if lc is None or "{node}" not in lc.path:
        return []
    path = os.path.expanduser(lc.path.replace("{hostname}", socket.gethostname()))
    pattern = glob.escape(path).replace("{node}", "*")
    pre, _, post = path.partition("{node}")
    rx = re.compile(re.escape(pre) + r"([^/]+)" + re.escape(post).replace(re.escape("{node}"), r"[^/]+"))
    found = []
    for p in glob.glob(pattern):
        m = rx.fullmatch(p)
        if m and os.path.isdir(p) and is_node_name(m.group(1)):
            found.append(m.group(1))
    return found


def _build_s3(cfg: Config) -> Tier:
    try:
        from .s3 import S3Tier
    except ImportError as e:  # pragma: no cover - boto3 is a declared dependency
        from ..errors import TierUnavailable

        raise TierUnavailable(f"the [s3] tier needs boto3 ({e}): pip install boto3") from None
    assert cfg.s3 is not None
    return S3Tier(cfg.s3)


register_tier(TierKind("local", 10, _build_local, for_node=_local_for_node, nodes=_local_nodes))
register_tier(TierKind("s3", 30, _build_s3))
