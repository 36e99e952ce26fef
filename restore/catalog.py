"""What is where: checkpoints per tier, ``latest`` over all tiers, and which tiers hold a copy.

The restore tools work on the tiers of one :class:`~tierckpt.config.TierConfig`, fastest first
(local, then S3). A checkpoint is *committed* on a tier when ``ID/metadata.json`` exists there;
``latest`` is the committed checkpoint with the newest ``committed`` timestamp (from the
metadata) over all tiers, as :class:`tierckpt.TieredReader` resolves it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.commit import CheckpointInfo, list_checkpoints, resolve_latest
from tierckpt.config import TierConfig, load_config
from tierckpt.errors import CheckpointNotFound, CorruptCheckpoint
from tierckpt.layout import CheckpointManifest, check_checkpoint_id, metadata_key
from tierckpt.reader import read_checkpoint_metadata
from tierckpt.tiers import make_tiers
from tierckpt.tiers.base import ObjectInfo, Tier, check_key

from .errors import UsageError

__all__ = [
    "Latest",
    "Listing",
    "TierEntry",
    "as_config",
    "checkpoint_objects",
    "find_latest",
    "holding_tiers",
    "key_path",
    "list_all",
    "open_tiers",
    "rank_of_file",
    "read_metadata_any",
    "resolve_id",
]


def as_config(config: TierConfig | str | os.PathLike | None) -> TierConfig:
    """A :class:`TierConfig` from a config object, a TOML path, or ``None`` (``$TIERCKPT_CONFIG``)."""
    return config if isinstance(config, TierConfig) else load_config(config)


def open_tiers(cfg: TierConfig, only: str | None = None) -> list[Tier]:
    """The configured tiers, fastest first; ``only`` ("local" or "s3") keeps one of them."""
    tiers = make_tiers(cfg)
    if only:
        picked = [t for t in tiers if t.name == only]
        for t in tiers:
            if t not in picked:
                t.close()
        if not picked:
            raise UsageError(f"--tier {only}: the configuration{(' ' + cfg.source) if cfg.source else ''} has no [{only}] section")
        return picked
    return tiers


def rank_of_file(file: str) -> int | None:
    """The writer rank encoded in a data file name (``rank-00003-ab12cd34.data`` -> 3)."""
    try:
        return int(file.split("-")[1].split(".")[0])
    except (IndexError, ValueError):
        return None


def checkpoint_objects(tier: Tier, checkpoint_id: str) -> dict[str, ObjectInfo]:
    """The objects of ``checkpoint_id`` on ``tier`` by their name inside the checkpoint
    (``metadata.json``, ``rank-00000-xxxxxxxx.data``, leftovers such as ``*.partial``), wherever
    the layout puts them (:func:`tierckpt.layout.checkpoint_prefixes`)."""
    prefixes = getattr(layout, "checkpoint_prefixes", lambda cid: [f"{cid}/"])(checkpoint_id)
    split = getattr(layout, "split_key", lambda key: tuple(key.split("/", 1)) if "/" in key else None)
    out: dict[str, ObjectInfo] = {}
    for prefix in prefixes:
        for info in tier.list(prefix):
            sk = split(info.key)
            if sk is not None and sk[0] == checkpoint_id:
                out[sk[1]] = info
    return out


def key_path(root: Path, key: str) -> Path:
    """The file of tier key ``key`` under a local tier rooted at ``root``."""
    return root.joinpath(*check_key(key).split("/"))


# -- list --------------------------------------------------------------------------------------

@dataclass
class TierEntry:
    """One checkpoint on one tier."""

    tier: str
    committed: bool
    size: int
    rank_files: int
    mtime: float  # commit time when committed, newest file time otherwise

    def to_json(self) -> dict:
        return {"state": "committed" if self.committed else "partial", "size": self.size,
                "rank_files": self.rank_files, "mtime": self.mtime}


@dataclass
class Listing:
    """One checkpoint id over all tiers."""

    checkpoint_id: str
    step: int | None
    tiers: dict[str, TierEntry] = field(default_factory=dict)

    @property
    def committed_anywhere(self) -> bool:
        return any(e.committed for e in self.tiers.values())

    @property
    def first_seen(self) -> float:
        return min(e.mtime for e in self.tiers.values())

    @property
    def newest(self) -> float:
        return max(e.mtime for e in self.tiers.values())

    def to_json(self, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        best = self.best()
        return {
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "committed": self.committed_anywhere,
            "size": best.size,
            "rank_files": best.rank_files,
            "age_s": round(max(0.0, now - self.newest), 3),
            "tiers": {name: e.to_json() for name, e in self.tiers.items()},
        }

    def best(self) -> TierEntry:
        """The entry that best describes the checkpoint: a committed one, the largest."""
        return max(self.tiers.values(), key=lambda e: (e.committed, e.rank_files, e.size))


def _entry(tier: Tier, c: CheckpointInfo) -> TierEntry:
    return TierEntry(tier=tier.name, committed=c.committed, size=c.size,
                     rank_files=c.files - (1 if c.committed else 0), mtime=c.mtime)


def list_all(tiers: list[Tier]) -> list[Listing]:
    """Every checkpoint on every tier, oldest first (by the earliest time any tier saw it)."""
    by_id: dict[str, Listing] = {}
    for tier in tiers:
        for c in list_checkpoints(tier):
            lst = by_id.setdefault(c.checkpoint_id, Listing(c.checkpoint_id, c.step))
            lst.tiers[tier.name] = _entry(tier, c)
    return sorted(by_id.values(), key=lambda l: (l.first_seen, l.step if l.step is not None else -1, l.checkpoint_id))


# -- latest ------------------------------------------------------------------------------------

@dataclass
class Latest:
    """The newest committed checkpoint over the tiers, and where it is committed."""

    checkpoint_id: str
    committed: float
    step: int | None
    tiers: list[str]

    def to_json(self) -> dict:
        return {"checkpoint_id": self.checkpoint_id, "step": self.step, "committed": self.committed, "tiers": self.tiers}


def find_latest(tiers: list[Tier]) -> Latest:
    """The newest committed checkpoint over ``tiers`` (by the ``committed`` time in its metadata).

    Raises :class:`CheckpointNotFound` when no tier holds a committed checkpoint.
    """
    best: tuple[float, str, CheckpointManifest] | None = None
    per_tier: dict[str, str] = {}
    for tier in tiers:
        try:
            cid = resolve_latest(tier)
        except CheckpointNotFound:
            continue
        _md, man = read_checkpoint_metadata(tier, cid)
        per_tier[tier.name] = cid
        if best is None or man.committed > best[0]:
            best = (man.committed, cid, man)
    if best is None:
        raise CheckpointNotFound("no committed checkpoint on any tier: " + ", ".join(t.url for t in tiers))
    cid = best[1]
    holding = [t.name for t in tiers if per_tier.get(t.name) == cid or t.exists(metadata_key(cid))]
    return Latest(checkpoint_id=cid, committed=best[0], step=best[2].step, tiers=holding)


def resolve_id(tiers: list[Tier], checkpoint_id: str) -> str:
    """``checkpoint_id`` itself (validated), or the id ``latest`` stands for over ``tiers``."""
    if checkpoint_id == "latest":
        return find_latest(tiers).checkpoint_id
    return check_checkpoint_id(checkpoint_id)


def holding_tiers(tiers: list[Tier], checkpoint_id: str) -> list[Tier]:
    """The tiers (fastest first) that hold a committed copy of ``checkpoint_id``.

    Raises :class:`CheckpointNotFound` (naming the tiers) when there is none.
    """
    out = [t for t in tiers if t.exists(metadata_key(checkpoint_id))]
    if not out:
        raise CheckpointNotFound(f"checkpoint {checkpoint_id} is not committed on any tier: "
                                 + ", ".join(t.url for t in tiers))
    return out


def read_metadata_any(tiers: list[Tier], checkpoint_id: str) -> tuple[Tier, Any, CheckpointManifest]:
    """Metadata of ``checkpoint_id`` from the first tier holding a valid committed copy."""
    errors = []
    for tier in holding_tiers(tiers, checkpoint_id):
        try:
            md, man = read_checkpoint_metadata(tier, checkpoint_id)
            return tier, md, man
        except CorruptCheckpoint as e:
            errors.append(str(e))
    raise CorruptCheckpoint(f"checkpoint {checkpoint_id}: no tier holds valid metadata: " + "; ".join(errors))


