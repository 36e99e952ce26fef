"""CRC32C pieces of a data file, and checking them range by range.

Every item's bytes plus its alignment padding are cut at the file's chunk grid (multiples of
``chunk_size``) into pieces, each with a CRC32C in the metadata (see
:func:`tierckpt.layout.piece_bounds`); the padded items tile the file, so the pieces cover every
byte of it. Because no piece crosses a multiple of ``chunk_size``, a byte range whose ends are
multiples of ``chunk_size`` (or the end of the file) contains whole pieces only: it can be
checked on its own, as soon as it arrives, in any order. :func:`aligned_range_size` picks such
a range size; :class:`FileCheck` checks one range.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tierckpt.checksum import crc32c
from tierckpt.format.layout import padded, piece_bounds
from tierckpt.format.metadata import CheckpointDoc, ItemRecord

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "BadPiece",
    "FileCheck",
    "Piece",
    "aligned_range_size",
    "files_items",
    "item_pieces",
]

MiB = 1 << 20


def item_pieces(rec: ItemRecord, chunk_size: int) -> list[tuple[int, int]]:
    """File offsets ``(start, end)`` of the CRC pieces of one item (its padding included)."""
    return piece_bounds(rec.pos, padded(rec.length), chunk_size)


def aligned_range_size(chunk_size: int, want: int) -> int:
    """The multiple of ``chunk_size`` nearest to ``want`` (at least one chunk)."""
    return max(1, round(want / chunk_size)) * chunk_size


@dataclass(frozen=True)
class Piece:
    start: int
    end: int
    crc: int
    item: int  # index into FileCheck.items


@dataclass(frozen=True)
class BadPiece:
    """A piece whose bytes did not match: which item it belongs to, and where."""

    file: str
    fqn: str
    offset: tuple[int, ...] | None
    start: int
    end: int

    def describe(self) -> str:
        off = "" if self.offset is None else f" at offset {list(self.offset)}"
        return f"item {self.fqn!r}{off}: CRC32C mismatch in bytes [{self.start}, {self.end})"


def files_items(md: Metadata | CheckpointDoc) -> dict[str, list[tuple[Any, ItemRecord]]]:
    """The items of each data file, in file order: ``(index, record)`` pairs, the index a DCP
    ``MetadataIndex`` or a :class:`tierckpt.layout.ItemIndex` (both have ``fqn`` and ``offset``)."""
    if isinstance(md, CheckpointDoc):
        return md.files_items()
    out: dict[str, list[tuple[Any, ItemRecord]]] = {}
    for idx, rec in (md.storage_data or {}).items():
        out.setdefault(rec.file, []).append((idx, rec))
    for items in out.values():
        items.sort(key=lambda x: x[1].pos)
    return out


class FileCheck:
    """The CRC pieces of one data file, for checking aligned ranges of it.

    Args:
        file: the data file's name (for messages).
        size: its size in bytes (from the manifest).
        items: its ``(index, record)`` pairs (the index has ``fqn`` and ``offset``).
        chunk_size: the checkpoint's chunk size (from the manifest).
    """

    def __init__(self, file: str, size: int, items: Iterable[tuple[Any, ItemRecord]], chunk_size: int) -> None:
        self.file = file
        self.size = size
        self.chunk_size = chunk_size
        self.items = list(items)
        pieces: list[Piece] = []
        for i, (_idx, rec) in enumerate(self.items):
            for (s, e), crc in zip(item_pieces(rec, chunk_size), rec.crcs):
                pieces.append(Piece(s, e, crc, i))
        pieces.sort(key=lambda p: p.start)
        self.pieces = pieces
        self._starts = [p.start for p in pieces]
        self.covered = sum(p.end - p.start for p in pieces)

    def ranges(self, range_size: int) -> list[tuple[int, int]]:
        """``[start, end)`` ranges of ``range_size`` bytes (a multiple of ``chunk_size``) covering the file."""
        if range_size % self.chunk_size:
            raise ValueError(f"range size {range_size} is not a multiple of the chunk size {self.chunk_size}")
        return [(s, min(self.size, s + range_size)) for s in range(0, self.size, range_size)]

    def check(self, start: int, buf: memoryview | np.ndarray) -> list[BadPiece]:
        """Check the pieces inside ``[start, start + len(buf))`` against ``buf``; return the bad ones.

        ``start`` must be a multiple of ``chunk_size`` and the range must end at one or at the
        end of the file, so that no piece is cut.
        """
        arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
        end = start + len(arr)
        bad: list[BadPiece] = []
        i = bisect.bisect_left(self._starts, start)
        while i < len(self.pieces) and self.pieces[i].start < end:
            p = self.pieces[i]
            i += 1
            if p.end > end:
                raise ValueError(f"{self.file}: piece [{p.start}, {p.end}) crosses the range end {end}")
            if crc32c(arr[p.start - start : p.end - start]) != p.crc:
                idx, _rec = self.items[p.item]
                bad.append(
                    BadPiece(self.file, idx.fqn, None if idx.offset is None else tuple(idx.offset), p.start, p.end)
                )
        return bad
