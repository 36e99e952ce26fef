"""Reading items of one committed checkpoint from the fastest tier that holds each data file.

:class:`CheckpointSource` resolves an id (``latest`` over all tiers), reads the metadata from
the first tier holding a valid committed copy, and notes which holding tier has which data file
(one listing per tier). :meth:`CheckpointSource.read` fills caller-supplied buffers with items:
items of a file are read in offset order, neighbours merged into one scatter read (at most
:data:`MAX_RUN` bytes, gaps up to :data:`MAX_GAP`), runs in parallel; every item's CRC32C pieces
(padding included) are checked, and an item that fails is read again from the next tier holding
its file. Only when every tier fails does it raise ``ChecksumMismatch``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from torch.distributed.checkpoint.metadata import Metadata

from tierckpt import lease as leases
from tierckpt.config import TierConfig
from tierckpt.errors import CheckpointNotFound, ChecksumMismatch, CorruptCheckpoint, TierckptError
from tierckpt.layout import CheckpointManifest, ItemRecord, data_key, item_intact, padded
from tierckpt.tiers.base import Tier

from .catalog import checkpoint_objects, holding_tiers, open_tiers, read_metadata_any, resolve_id
from .work import run_all, workers_for

__all__ = ["MAX_GAP", "MAX_RUN", "CheckpointSource", "ReadRequest"]

log = logging.getLogger("tierckpt.restore")

MAX_RUN = 64 << 20
MAX_GAP = 256 << 10


@dataclass
class ReadRequest:
    """Read item ``rec`` (its ``length`` bytes) into ``buf``; ``what`` names it in messages."""

    rec: ItemRecord
    buf: memoryview
    what: str
    pad: bytearray = field(default_factory=bytearray)


class CheckpointSource:
    """One committed checkpoint, readable item by item. Use as a context manager (closes the tiers)."""

    def __init__(self, cfg: TierConfig, checkpoint_id: str = "latest", tier: str | None = None, purpose: str = "") -> None:
        self.cfg = cfg
        self.tiers = open_tiers(cfg, tier)
        self._leases: list[leases.Lease] = []
        try:
            self.checkpoint_id = resolve_id(self.tiers, checkpoint_id)
            self.holding = []
            for t in holding_tiers(self.tiers, self.checkpoint_id):
                try:  # held until close(): retention and gc anywhere leave the checkpoint alone
                    self._leases.append(leases.acquire(t, self.checkpoint_id, purpose=f"restore {purpose}".strip()))
                    self.holding.append(t)
                except CheckpointNotFound as e:
                    log.warning("%s", e)
            if not self.holding:
                raise CheckpointNotFound(f"checkpoint {self.checkpoint_id} is no longer committed on any tier (deleted?)")
            self.meta_tier, self.metadata, self.manifest = read_metadata_any(self.holding, self.checkpoint_id)
            self._files: dict[str, set[str]] = {}
            for t in self.holding:
                self._files[t.name] = set(checkpoint_objects(t, self.checkpoint_id))
        except BaseException:
            self.close()
            raise
        self.served: dict[str, str] = {}  # file -> tier that served it
        self._lock = threading.Lock()

    metadata: Metadata
    manifest: CheckpointManifest

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
        """Holding tiers that have ``file``, fastest first."""
        return [t for t in self.holding if file in self._files.get(t.name, ())]

    def read(self, requests: list[ReadRequest], threads: int | None = None) -> None:
        """Fill every request's buffer with its verified item bytes (see the module docstring)."""
        todo = [r for r in requests if r.rec.length or padded(r.rec.length)]
        for r in todo:
            r.pad = bytearray(padded(r.rec.length) - r.rec.length)
        runs = _runs(todo)
        if not runs:
            return
        workers = threads or max(workers_for(self.cfg, t, MAX_RUN) for t in self.holding)
        run_all(self._read_run, runs, workers)

    def _read_run(self, run: list[ReadRequest]) -> None:
        file = run[0].rec.file
        key = data_key(self.checkpoint_id, file)
        tiers = self.tiers_for(file)
        if not tiers:
            raise CheckpointNotFound(f"checkpoint {self.checkpoint_id}: data file {file} is on no tier holding it: "
                                     + ", ".join(t.url for t in self.holding))
        first = tiers[0]
        bufs: list[memoryview] = []
        at = run[0].rec.pos
        for r in run:
            if r.rec.pos > at:
                bufs.append(memoryview(bytearray(r.rec.pos - at)))
            bufs.append(r.buf)
            if r.pad:
                bufs.append(memoryview(r.pad))
            at = r.rec.pos + padded(r.rec.length)
        try:
            first.read_ranges(key, run[0].rec.pos, bufs)
            bad = [r for r in run if not self._ok(r)]
        except (CorruptCheckpoint, CheckpointNotFound, TierckptError, OSError) as e:
            log.error("checkpoint %s: reading %s from %s failed: %s", self.checkpoint_id, file, first.name, e)
            bad = list(run)
        else:
            with self._lock:
                self.served.setdefault(file, first.name)
        for r in bad:
            self._recover(r, key, tiers[1:], first)

    def _ok(self, r: ReadRequest) -> bool:
        return item_intact(r.rec, r.buf, memoryview(r.pad), self.manifest.chunk_size)

    def _recover(self, r: ReadRequest, key: str, others: list[Tier], failed: Tier) -> None:
        for t in others:
            try:
                t.read_ranges(key, r.rec.pos, [r.buf] + ([memoryview(r.pad)] if r.pad else []))
            except (TierckptError, OSError) as e:
                log.error("checkpoint %s: %s from %s also failed: %s", self.checkpoint_id, r.rec.file, t.name, e)
                continue
            if self._ok(r):
                log.warning("checkpoint %s: %s in %s failed its CRC32C check on %s; read it from %s",
                            self.checkpoint_id, r.what, r.rec.file, failed.name, t.name)
                return
        raise ChecksumMismatch(f"checkpoint {self.checkpoint_id}: {r.what} in {r.rec.file} failed its CRC32C check on "
                               + ", ".join([failed.url] + [t.url for t in others]))


def _runs(reqs: list[ReadRequest]) -> list[list[ReadRequest]]:
    """Requests grouped into merged reads: same file, offset order, small gaps, bounded size."""
    by_file: dict[str, list[ReadRequest]] = {}
    for r in reqs:
        by_file.setdefault(r.rec.file, []).append(r)
    runs: list[list[ReadRequest]] = []
    for items in by_file.values():
        items.sort(key=lambda r: r.rec.pos)
        cur: list[ReadRequest] = []
        for r in items:
            if cur:
                end = cur[-1].rec.pos + padded(cur[-1].rec.length)
                if (r.rec.pos < end or r.rec.pos - end > MAX_GAP
                        or r.rec.pos + padded(r.rec.length) - cur[0].rec.pos > MAX_RUN):
                    runs.append(cur)
                    cur = []
            cur.append(r)
        if cur:
            runs.append(cur)
    runs.sort(key=lambda run: -sum(r.rec.length for r in run))
    return runs
