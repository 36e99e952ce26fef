"""A hop's encoded copies (:mod:`tierckpt.codec` on the chain): which previous checkpoint's
object unchanged frames are copied from, and the leases that keep it there meanwhile.

:class:`EncodedCopies` belongs to one :class:`~tierckpt.replicate.Replicator` whose destination
has an :attr:`~tierckpt.tiers.base.Tier.encoding`. For each data file it copies
(:meth:`EncodedCopies.copy`, on the hop's thread) it finds the *previous* file: the same writer
rank's file in the newest checkpoint committed on the destination with a stored index for it
(remembered from this process's last commit there; after a restart, read once from the
destination's newest committed checkpoint), leases that checkpoint on the destination for the
duration of the copy (retention and gc leave its objects alone; a checkpoint being deleted is
simply not used), and calls :func:`tierckpt.codec.hop.copy_encoded`. The new object is whole:
server-side copies are copies, so deleting the previous checkpoint later takes nothing from it.
"""

from __future__ import annotations

import logging
import threading

from ..catalog import lease as leases
from ..catalog.listing import committed_in_order, read_checkpoint_doc
from ..codec import frame_size
from ..codec.hop import CopyFigures, Previous, copy_encoded, width_runs
from ..errors import TierckptError
from ..format.layout import data_key, padded, rank_of_file
from ..format.metadata import CheckpointDoc
from ..format.stored import StoredFile
from ..tiers.base import Tier

__all__ = ["EncodedCopies"]

log = logging.getLogger("tierckpt.replicate")


class EncodedCopies:
    """Encoded copies into one destination tier (see the module docstring). Thread-safe."""

    def __init__(self, nice: int = 0) -> None:
        self._nice = nice
        self._last: dict[int, Previous] = {}  # writer rank -> its file in the newest commit on dst
        self._looked = False
        self._lock = threading.Lock()

    def committed(self, checkpoint_id: str, stored: dict[str, dict]) -> None:
        """Remember the files of ``checkpoint_id``, committed on the destination with ``stored``."""
        with self._lock:
            for file, d in stored.items():
                r = rank_of_file(file)
                if r is not None:
                    self._last[r] = Previous(
                        checkpoint_id, data_key(checkpoint_id, file), StoredFile.from_json(d, file, int(d["size"]))
                    )

    def _previous(self, dst: Tier, rank: int, exclude: str) -> Previous | None:
        with self._lock:
            if rank in self._last or self._looked:
                p = self._last.get(rank)
                return p if p is not None and p.checkpoint_id != exclude else None
            self._looked = True
        try:
            done = [c for c in committed_in_order(dst) if c.checkpoint_id != exclude]
            if done:
                cid = done[-1].checkpoint_id
                doc = read_checkpoint_doc(dst, cid)
                self.committed(cid, {f: s.to_json() for f, s in doc.manifest.stored.items()})
        except TierckptError as e:
            log.info("%s: no previous checkpoint to copy unchanged parts from: %s", dst.url, e)
        with self._lock:
            p = self._last.get(rank)
            return p if p is not None and p.checkpoint_id != exclude else None

    def copy(self, src: Tier, dst: Tier, doc: CheckpointDoc, file: str) -> tuple[StoredFile, CopyFigures]:
        """Copy ``file`` of the checkpoint ``doc`` describes from ``src`` to ``dst``, encoded."""
        assert dst.encoding is not None
        man = doc.manifest
        cid = man.checkpoint_id
        items = [(rec.pos, padded(rec.length), rec.dtype) for _i, rec in doc.items if rec.file == file]
        frame = frame_size(man.chunk_size)
        prev = self._previous(dst, rank_of_file(file) or 0, cid) if dst.encoding.copy_unchanged else None
        lease = None
        if prev is not None:
            try:
                lease = leases.acquire(dst, prev.checkpoint_id, purpose=f"unchanged parts of {cid} copied from it")
            except TierckptError as e:
                log.info("checkpoint %s: not copying unchanged parts from %s: %s", cid, prev.checkpoint_id, e)
                prev = None
        try:
            return copy_encoded(
                src,
                dst,
                data_key(cid, file),
                size=man.files[file],
                frame=frame,
                runs=width_runs(items),
                encoding=dst.encoding,
                prev=prev,
                nice=self._nice,
            )
        finally:
            if lease is not None:
                lease.release()
