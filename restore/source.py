"""One committed checkpoint, readable item by item, for the restore tools (consolidate).

:class:`CheckpointSource` resolves an id (``latest`` over all tiers), leases it on every tier
holding a committed copy (:func:`tierckpt.readback.hold`), reads the metadata from the first of
them with a valid copy, and reads items through :class:`tierckpt.readback.Readback`, the same
verified multi-tier engine ``dcp.load`` uses: per data file the fastest tier holding it, merged
parallel reads, every CRC32C checked, a failing item read again from the next tier.
"""

from __future__ import annotations

import logging

from torch.distributed.checkpoint.metadata import Metadata

from tierckpt.catalog import lease as leases
from tierckpt.config import TierConfig
from tierckpt.format.metadata import CheckpointManifest
from tierckpt.load.readback import MAX_GAP, RUN_BYTES, Readback, Request, hold
from tierckpt.tiers.base import Tier

from .catalog import open_tiers, read_metadata_any, resolve_id

__all__ = ["MAX_GAP", "MAX_RUN", "CheckpointSource", "ReadRequest"]

log = logging.getLogger("tierckpt.restore")

MAX_RUN = RUN_BYTES
ReadRequest = Request
"""Read item ``rec`` into ``buf`` (``ReadRequest(rec, buf, what)``): :class:`tierckpt.readback.Request`."""


class CheckpointSource:
    """One committed checkpoint, readable item by item. Use as a context manager (releases the
    leases, closes the tiers).

    Args:
        cfg: the configuration; ``tier`` keeps only the tier of that configuration section.
        checkpoint_id: an id or ``"latest"``.
        purpose: said in the leases (``"consolidate"``).
    """

    metadata: Metadata
    manifest: CheckpointManifest

    def __init__(
        self, cfg: TierConfig, checkpoint_id: str = "latest", tier: str | None = None, purpose: str = ""
    ) -> None:
        self.cfg = cfg
        self.tiers = open_tiers(cfg, tier)
        self._leases: list[leases.Lease] = []
        try:
            self.checkpoint_id = resolve_id(self.tiers, checkpoint_id)
            self.holding, self._leases = hold(self.tiers, self.checkpoint_id, f"restore {purpose}".strip())
            self.meta_tier, self.metadata, self.manifest = read_metadata_any(self.holding, self.checkpoint_id)
            self._engine = Readback(self.checkpoint_id, self.holding, self.manifest.chunk_size)
        except BaseException:
            self.close()
            raise

    @property
    def served(self) -> dict[str, str]:
        """Data file -> name of the tier that served it."""
        return self._engine.served

    def __enter__(self) -> CheckpointSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for lease in self._leases:
            lease.release()
        self._leases = []
        for t in self.tiers:
            t.close()

    def tiers_for(self, file: str) -> list[Tier]:
        """The tiers ``file`` is read from, fastest first."""
        return self._engine.tiers_for(file)

    def read(self, requests: list[Request], threads: int | None = None) -> None:
        """Fill every request's buffer with its verified item bytes (:meth:`Readback.read`)."""
        self._engine.read(requests, threads)
