"""The read side of :mod:`tierckpt.codec`: a tier seen through one checkpoint's stored index.

:func:`decoding` wraps a tier that may hold encoded files (:attr:`Tier.may_encode
<tierckpt.tiers.base.Tier.may_encode>`) for one checkpoint. The wrapper is a :class:`Tier`
whose reads of that checkpoint's encoded data files return *logical* bytes: the stored frames a
range touches are fetched in one ranged read and decoded in the calling thread (the read
engine's workers), straight into the caller's buffer where a frame lies inside it. Their
:meth:`size` and :meth:`list` sizes are logical too, as long as the stored object has the size
the index says (else the stored size shows, and every size check downstream reports the
mismatch). Everything else goes to the tier unchanged.

The index comes from the tier's own ``metadata.json`` of the checkpoint, read on the first data
read (one small GET); a checkpoint without an index (plain files, or written before encoding
existed) reads straight through. A frame that does not decode raises
:class:`~tierckpt.errors.CorruptCheckpoint` naming the tier, file and frame: the read engine
treats it as that tier's read error and serves the item from the next tier.

The index and the frames are input from the tier, which someone else may have written: a read
of ``n`` logical bytes holds at most ``n`` plus the stored bytes of the frames it touches plus
one frame's logical bytes (a partly read frame is decoded aside), whatever the index or the
frames' headers say (:data:`~tierckpt.format.stored.MAX_FRAME`,
:func:`~tierckpt.codec.frames.decode_into`).
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import CorruptCheckpoint
from ..format.layout import is_data_file, metadata_key, split_key
from ..format.metadata import parse_metadata
from ..format.stored import StoredFile
from ..tiers.base import ObjectInfo, Spare, Tier
from .frames import decode_into

__all__ = ["decoding", "DecodingTier"]

_FLAGS = (
    "name",
    "url",
    "cheap_listing",
    "node_local",
    "durable",
    "conditional_create",
    "read_range",
    "read_concurrency",
    "keep",
    "keep_every",
    "encoding",
)


def decoding(tier: Tier, checkpoint_id: str, doc: Any = None) -> Tier:
    """``tier`` as readers of ``checkpoint_id`` should see it: wrapped when it may hold encoded
    files (see the module docstring), itself otherwise. ``doc``: that checkpoint's metadata
    document as read from this very tier (:func:`tierckpt.layout.parse_metadata`), when the
    caller has it: its index is used and the tier's ``metadata.json`` is not read again."""
    if not tier.may_encode or isinstance(tier, DecodingTier):
        return tier
    return DecodingTier(tier, checkpoint_id, doc)


def _encoded(doc: Any) -> dict[str, StoredFile]:
    """The encoded files of a parsed metadata document, by data file name."""
    return {f: s for f, s in doc.manifest.stored.items() if not s.plain}


class DecodingTier(Tier):
    """``tier`` with checkpoint ``checkpoint_id``'s encoded data files read as logical bytes."""

    def __init__(self, tier: Tier, checkpoint_id: str, doc: Any = None) -> None:
        self.inner = tier
        self.checkpoint_id = checkpoint_id
        for f in _FLAGS:
            setattr(self, f, getattr(tier, f))
        self.may_encode = False
        self._index: dict[str, StoredFile] | None = None if doc is None else _encoded(doc)
        self._lock = threading.Lock()

    # -- the index ------------------------------------------------------------------------------
    def _stored(self, key: str) -> StoredFile | None:
        sk = split_key(key)
        if sk is None or sk[0] != self.checkpoint_id or not is_data_file(sk[1]):
            return None
        with self._lock:
            if self._index is None:
                mkey = metadata_key(self.checkpoint_id)
                self._index = _encoded(parse_metadata(self.inner.get(mkey), f"{self.inner.url}/{mkey}"))
            return self._index.get(sk[1])

    def _decode(self, key: str, idx: StoredFile, start: int, buf: memoryview) -> None:
        end = start + len(buf)
        if start < 0 or end > idx.size:
            raise CorruptCheckpoint(f"{self.url}/{key}: bytes [{start}, {end}) run past its {idx.size} bytes")
        if not len(buf):
            return
        i0, i1 = start // idx.frame, (end - 1) // idx.frame
        o = idx.offsets
        stored = bytearray(o[i1 + 1] - o[i0])
        self.inner.read_into(key, o[i0], memoryview(stored))
        sv = memoryview(stored)
        tmp: bytearray | None = None
        for i in range(i0, i1 + 1):
            a, b = idx.span(i)
            frame = sv[o[i] - o[i0] : o[i + 1] - o[i0]]
            where = f"{self.url}/{key} frame {i}"
            if a >= start and b <= end:
                decode_into(frame, buf[a - start : b - start], where)
            else:
                if tmp is None or len(tmp) < b - a:  # the frame's own bytes, never ``idx.frame``: at most the file
                    tmp = bytearray(b - a)
                decode_into(frame, memoryview(tmp)[: b - a], where)
                s, e = max(a, start), min(b, end)
                buf[s - start : e - start] = memoryview(tmp)[s - a : e - a]

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        idx = self._stored(key)
        if idx is None:
            return self.inner.get(key, start, end)
        end = idx.size if end is None else end
        buf = bytearray(max(0, end - start))
        self._decode(key, idx, start, memoryview(buf))
        return bytes(buf)

    def read_into(self, key: str, start: int, buf: memoryview) -> None:
        idx = self._stored(key)
        if idx is None:
            self.inner.read_into(key, start, buf)
        else:
            self._decode(key, idx, start, buf)

    def read_ranges(self, key: str, start: int, bufs: list[memoryview]) -> None:
        idx = self._stored(key)
        if idx is None:
            self.inner.read_ranges(key, start, bufs)
            return
        total = sum(len(b) for b in bufs)
        tmp = bytearray(total)
        self._decode(key, idx, start, memoryview(tmp))
        at = 0
        for b in bufs:
            b[:] = memoryview(tmp)[at : at + len(b)]
            at += len(b)

    def size(self, key: str) -> int:
        n = self.inner.size(key)
        idx = self._stored(key)
        return idx.size if idx is not None and n == idx.stored else n

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for info in self.inner.list(prefix):
            sk = split_key(info.key)
            if sk is not None and sk[0] == self.checkpoint_id and is_data_file(sk[1]):
                idx = self._stored(info.key)
                if idx is not None and info.size == idx.stored:
                    info = ObjectInfo(info.key, idx.size, info.mtime)
            yield info

    # -- everything else: the tier's own ------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def put_volatile(self, key: str, data: bytes) -> None:
        self.inner.put_volatile(key, data)

    def open_sink(self, key: str, size: int):  # noqa: ANN201
        return self.inner.open_sink(key, size)

    def open_stream(self, key: str, size_hint: int = 0):  # noqa: ANN201
        return self.inner.open_stream(key, size_hint)

    def open_resumable(self, key: str, size: int, **kw):  # noqa: ANN003, ANN201
        return self.inner.open_resumable(key, size, **kw)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_many(self, keys: builtins.list[str]) -> int:
        return self.inner.delete_many(keys)

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(prefix)

    def list_dirs(self) -> builtins.list[str]:
        return self.inner.list_dirs()

    def abort_stale(self, older_than_s: float, spare: Spare = ()) -> int:
        return self.inner.abort_stale(older_than_s, spare)

    def free_bytes(self) -> int | None:
        return self.inner.free_bytes()

    def root_id(self) -> str:
        return self.inner.root_id()

    def wait_deletions(self, timeout_s: float = 600.0) -> None:
        self.inner.wait_deletions(timeout_s)

    def close(self) -> None:
        """The view owns nothing: the tier is closed by whoever opened it."""

    def __repr__(self) -> str:
        return f"DecodingTier({self.inner!r}, {self.checkpoint_id!r})"

    def __eq__(self, other: object) -> bool:
        """The same tier, seen decoded: equal to the tier it wraps (``tier in tiers`` holds)."""
        inner = other.inner if isinstance(other, DecodingTier) else other
        return inner is self.inner

    def __hash__(self) -> int:
        return hash(self.inner)
