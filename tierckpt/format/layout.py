"""Where a checkpoint lives on a tier: ids, file names, keys, the aligned layout and its CRC pieces.

On every tier a checkpoint ``ID`` is a directory (or key prefix) holding::

    _00/ID/rank-00000-<token>.data   one coalesced data file per rank: raw tensor bytes at aligned
    _01/ID/rank-00001-<token>.data   offsets (and serialized non-tensor items), laid out before any
                                     byte is written; ``_XX`` spreads ranks over 16 key prefixes
    ID/metadata.json       the commit marker, written last: DCP's Metadata plus, for every item,
                           its file, offset, length, dtype, shape and CRC32C pieces
                           (:mod:`tierckpt.format.metadata`)

Checksums are CRC32C over *pieces*: an item's bytes and the padding after it, cut at the file's
chunk grid (multiples of ``chunk_size`` from the file start), so that each chunk's writer can
checksum its part independently and every byte of a data file is covered; a reader recomputes the
same cut from ``chunk_size`` (:func:`piece_bounds`).

This module is the only parser of ids, keys and file names. It does not import torch.
"""

from __future__ import annotations

import re

from ..errors import InvalidCheckpointId

__all__ = [
    "FORMAT",
    "METADATA",
    "PEERS",
    "ALIGN",
    "MAX_METADATA_BYTES",
    "MAX_HEADER_BYTES",
    "ID_CHARS",
    "check_checkpoint_id",
    "is_valid_checkpoint_id",
    "data_key",
    "checkpoint_prefixes",
    "split_key",
    "FANOUT",
    "metadata_key",
    "rank_file",
    "rank_of_file",
    "is_data_file",
    "step_of",
    "piece_bounds",
    "padded",
]

FORMAT = "tierckpt/1"
METADATA = "metadata.json"
PEERS = "peers.json"
"""The peer hop's commit record inside a checkpoint: which node holds a copy of which data file."""
ALIGN = 64  # every item starts at a multiple of this (cache line; any dtype's alignment)
MAX_METADATA_BYTES = 1 << 30
MAX_HEADER_BYTES = 64 * 1024  # the header line of metadata.json (a few fields)

ID_CHARS = "letters, digits and ._-=+@"
"""The characters of a checkpoint id, as messages and docs state them (:func:`check_checkpoint_id`)."""
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-=+@]{0,199}")
_FILE_RE = re.compile(r"^rank-\d{5,7}(-[0-9a-f]{8})?\.data$")
_RESERVED_IDS = {"latest"}


def check_checkpoint_id(checkpoint_id: str) -> str:
    """Return ``checkpoint_id`` if it can name a checkpoint (a directory / key prefix): 1-200
    characters of :data:`ID_CHARS`, the first a letter or digit, not ``latest``; else raise
    :class:`~tierckpt.errors.InvalidCheckpointId` naming it. The whole string is checked (a
    trailing newline is refused, never kept)."""
    if not isinstance(checkpoint_id, str) or _ID_RE.fullmatch(checkpoint_id) is None or checkpoint_id in _RESERVED_IDS:
        shown = repr(checkpoint_id) if isinstance(checkpoint_id, str) else f"of type {type(checkpoint_id).__name__}"
        raise InvalidCheckpointId(
            f"invalid checkpoint id {shown[:220]}: use 1-200 characters of {ID_CHARS}, "
            "starting with a letter or digit (and not 'latest')"
        )
    return checkpoint_id


def is_valid_checkpoint_id(checkpoint_id: str) -> bool:
    """Whether :func:`check_checkpoint_id` accepts ``checkpoint_id`` (never raises)."""
    try:
        check_checkpoint_id(checkpoint_id)
        return True
    except InvalidCheckpointId:
        return False


def rank_file(rank: int, token: str = "") -> str:
    """The data file of ``rank``; the save token's first 8 hex digits keep concurrent writers apart."""
    return f"rank-{rank:05d}-{token[:8]}.data" if token else f"rank-{rank:05d}.data"


FANOUT = 16  # data files are spread over this many key prefixes (S3 partitions request rates by prefix)


_RANK_RE = re.compile(r"^rank-(\d+)")


def rank_of_file(file: str) -> int | None:
    """The writer rank in a data file name: ``rank-00003-ab12cd34.data`` (or ``rank-00003.data``,
    or either's ``.partial``) -> 3; None for any other name.

    With :func:`is_data_file` and :func:`rank_file`, the only code that knows how data files are
    named: everything else (reader messages, restore's rank filter, listings) asks these.
    """
    m = _RANK_RE.match(file)
    return int(m.group(1)) if m else None


def is_data_file(name: str) -> bool:
    """Whether ``name`` (a file name inside a checkpoint) is a committed data file's name."""
    return bool(_FILE_RE.match(name))


def data_key(checkpoint_id: str, file: str) -> str:
    """Where a data file lives: ``_XX/ID/file`` with ``XX`` = writer rank mod :data:`FANOUT` in hex.

    The shard comes first so that the same :data:`FANOUT` key ranges carry the writes of every
    checkpoint (S3 keeps them partitioned); ``_`` cannot start a checkpoint id, so shard
    directories never look like checkpoints.
    """
    return f"_{(rank_of_file(file) or 0) % FANOUT:02x}/{checkpoint_id}/{file}"


def checkpoint_prefixes(checkpoint_id: str) -> list[str]:
    """Every key prefix that can hold objects of ``checkpoint_id`` (for deletion and listing)."""
    return [f"{checkpoint_id}/"] + [f"_{i:02x}/{checkpoint_id}/" for i in range(FANOUT)]


def split_key(key: str) -> tuple[str, str] | None:
    """``(checkpoint id, rest)`` of a tier key, or None for keys outside any checkpoint."""
    parts = key.split("/")
    if len(parts) >= 3 and re.match(r"^_[0-9a-f]{2}$", parts[0]):
        return parts[1], "/".join(parts[2:])
    if len(parts) >= 2 and not parts[0].startswith("_"):
        return parts[0], "/".join(parts[1:])
    return None


def metadata_key(checkpoint_id: str) -> str:
    return f"{checkpoint_id}/{METADATA}"


def step_of(checkpoint_id: str) -> int | None:
    """The training step encoded in an id: its last run of digits (``step-000100`` -> 100)."""
    m = re.findall(r"\d+", checkpoint_id)
    return int(m[-1]) if m else None


def padded(length: int) -> int:
    """An item's length rounded up to :data:`ALIGN`: its bytes plus the padding that follows it.

    Items are laid out back to back at aligned offsets, so the padded ranges of a file's items
    tile the whole file: checksumming padded ranges covers every byte of every data file.
    """
    return length + (-length) % ALIGN


def piece_bounds(pos: int, length: int, chunk_size: int) -> list[tuple[int, int]]:
    """The (start, end) file offsets of CRC pieces: ``[pos, pos+length)`` cut at the chunk grid.

    Callers pass the *padded* length of an item (see :func:`padded`).
    """
    out = []
    start, end = pos, pos + length
    while start < end:
        cut = min(end, (start // chunk_size + 1) * chunk_size)
        out.append((start, cut))
        start = cut
    return out
