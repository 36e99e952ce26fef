"""A throwaway third tier for ``tests/test_third_tier.py``: a second directory standing in for a
colder storage class (``[archive]``), after ``[local]`` in the chain.

This module is all it takes to add a tier: the tier class (here a :class:`LocalTier` under
another name), its configuration section, and one registry entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierckpt.config import Config, ConfigError
from tierckpt.tiers import TierKind, register_tier
from tierckpt.tiers.local import LocalTier


class ArchiveTier(LocalTier):
    """A directory tier named ``archive``."""

    name = "archive"


@dataclass
class ArchiveConfig:
    """``[archive]``: ``path`` (a directory), ``keep`` (committed checkpoints kept; 0 keeps all)."""

    path: str = ""
    keep: int = 0

    def validate(self, where: str = "[archive]") -> None:
        if not self.path:
            raise ConfigError(f"{where} path: must not be empty")
        if self.keep < 0:
            raise ConfigError(f"{where} keep: must not be negative, got {self.keep}")


def _build(cfg: Config) -> ArchiveTier:
    sec = cfg.section("archive")
    return ArchiveTier(sec.path, fsync=False, keep=sec.keep)


register_tier(TierKind("archive", 40, _build, config_cls=ArchiveConfig, required=("path",)))
