"""Compression by byte planes, and unchanged parts copied by the server: what a tier *stores* for
a data file, as opposed to what a save *wrote*.

Design (the whole of it; the modules below hold the parts):

* **Where.** Encoding happens on a hop of the chain (:mod:`tierckpt.replicate`), into a tier whose
  :attr:`~tierckpt.tiers.base.Tier.encoding` is set (``[s3] compression`` / ``copy_unchanged``).
  The first tier ([local], or [s3] in direct mode) always holds plain files: the flush writes
  captured chunks at their planned offsets with ``O_DIRECT``, at disk speed, and a codec there
  would sit on the save's path. The peer hop copies plain files between nodes' [local] tiers.
* **Frames.** A data file is cut into frames of a few MiB on a grid aligned with the checkpoint's
  chunk grid (:func:`frame_size`); each frame is coded on its own (:mod:`.frames`: byte planes by
  the items' element widths, zstd per plane, incompressible planes raw), so ranged reads,
  resumable fetches and parallel loads decode only the frames they touch.
* **Index.** The stored size and a 128-bit hash of every frame go into *that tier's*
  ``metadata.json`` (:mod:`.index`), added by the hop before its commit: the copy and its index
  become visible together. CRC32C pieces keep covering the *logical* bytes, so every check of
  every reader keeps its meaning; a frame that fails to decode or to match them is an error of
  that tier, served from the next.
* **Copy (write).** :func:`tierckpt.codec.hop.copy_encoded`: the hop's thread reads frames from the
  source tier, hashes them, and a pool of background threads (at the job's background priority)
  codes the frames whose hash differs from the same rank's file in the previous checkpoint on
  that tier; frames are appended in order to the tier's stream sink
  (:meth:`~tierckpt.tiers.base.Tier.open_stream`), which uploads parts, and for runs of unchanged
  frames asks the server to copy the previous object's bytes (S3 ``UploadPartCopy``). Each
  checkpoint's object is whole and self-contained: retention and gc are unchanged.
* **Read.** :func:`tierckpt.codec.view.decoding` wraps a tier for one checkpoint: reads of logical
  ranges fetch the stored frames they touch and decode them in the calling (read engine) thread;
  sizes of encoded files are reported logical. ``readback.hold`` wraps every tier that may hold
  encoded files, so ``dcp.load``, verify, fetch and consolidate read them unchanged.

Stage ``codec``: May import ``format`` (the stored index lives in :mod:`tierckpt.format.stored`),
``tiers``, ``config`` and the base modules. May be imported by ``catalog`` and every stage above
it (``chain``'s encoded hops, ``load``'s read engine), testing and ``restore/``.
"""

from __future__ import annotations

from ..format.stored import CODECS, StoredFile, add_stored, frame_hash, parse_stored, strip_stored

__all__ = ["CODECS", "FRAME", "StoredFile", "add_stored", "frame_hash", "frame_size", "parse_stored", "strip_stored"]

FRAME = 4 << 20
"""Preferred logical bytes per frame."""


def frame_size(chunk_size: int) -> int:
    """The frame size for a checkpoint with ``chunk_size``: the largest divisor of the chunk
    size that is a multiple of 4 KiB and at most :data:`FRAME` (the chunk size itself when it
    is not a multiple of 4 KiB and small), so that frames never straddle a chunk boundary."""
    if chunk_size <= FRAME or chunk_size % 4096:
        return max(4096, min(chunk_size, FRAME)) if chunk_size % 4096 == 0 else FRAME
    pages = chunk_size // 4096
    k = -(-chunk_size // FRAME)
    while pages % k:
        k += 1
    return chunk_size // k
