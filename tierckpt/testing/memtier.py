"""An in-memory tier that counts what each operation would cost: the many-rank simulator's store.

:class:`MemoryTier` keeps objects in a dict (values are shared, never copied: thousands of
simulated nodes may hold the same metadata bytes) and counts, per simulated rank
(:attr:`MemoryTier.who`), the requests each call would send to an object store, named as S3
names them and counted as :class:`~tierckpt.tiers.s3.tier.S3Tier` sends them for small objects:

==============================  =====================================================
call                            requests
==============================  =====================================================
``put``, ``put_volatile``       PutObject (conditional create is one request)
``get`` (a non-empty range)     GetObject
``read_head``                   GetObject (one ranged GET)
``exists``, ``size``            HeadObject
``list``                        ListObjectsV2 per 1,000 objects listed
``list_tops``                   ListObjectsV2 per 1,000 names (a delimited listing)
``delete``                      DeleteObject
``delete_many``                 DeleteObjects per 1,000 keys
``open_sink`` + ``close``       PutObject (the simulated files are small)
==============================  =====================================================

With ``cheap_listing=True`` it stands for a node's local disk: the same calls are counted as
file-system operations (``ops``), never as requests. Never used by the library itself.
"""

from __future__ import annotations

import builtins
import threading
import time
from collections import Counter
from collections.abc import Iterator

from ..errors import CheckpointNotFound, CommitConflict, CorruptCheckpoint
from ..tiers.base import DataSink, ObjectInfo, Tier

__all__ = ["MemoryTier"]

PAGE = 1000


class _Sink(DataSink):
    def __init__(self, tier: MemoryTier, key: str, size: int) -> None:
        self.tier, self.key, self.buf = tier, key, bytearray(size)

    def write_at(self, offset: int, data: memoryview) -> None:
        self.buf[offset : offset + len(data)] = data

    def close(self) -> None:
        self.tier._count("PutObject")
        self.tier._store(self.key, bytes(self.buf))

    def abort(self) -> None:
        self.buf = bytearray()


class MemoryTier(Tier):
    """Objects in memory, with request counts (see the module docstring).

    Args:
        name, url: as any tier's.
        node_local, cheap_listing: the capability flags (a node's disk: both True).
        root: what :meth:`root_id` answers (one per simulated node).
    """

    def __init__(
        self, name: str, url: str, *, node_local: bool = False, cheap_listing: bool = False, root: str = ""
    ) -> None:
        self.name, self.url = name, url
        self.node_local, self.cheap_listing = node_local, cheap_listing
        self._root = root or url
        self._objects: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()
        self.who: int = -1  # the simulated rank the next calls are counted for
        self.requests: Counter[tuple[int, str]] = Counter()  # (rank, S3 operation) -> count

    # -- accounting ---------------------------------------------------------------------------
    def _count(self, op: str, n: int = 1) -> None:
        self.requests[(self.who, op if not self.cheap_listing else f"fs:{op}")] += n

    def by_op(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (_who, op), n in self.requests.items():
            out[op] += n
        return out

    def by_rank(self) -> Counter[int]:
        out: Counter[int] = Counter()
        for (who, _op), n in self.requests.items():
            out[who] += n
        return out

    def _store(self, key: str, data: bytes) -> None:
        with self._lock:
            self._objects[key] = (data, time.time())

    def _find(self, key: str) -> bytes:
        with self._lock:
            got = self._objects.get(key)
        if got is None:
            raise CheckpointNotFound(f"{self.url}/{key}: no such object")
        return got[0]

    # -- the Tier contract -----------------------------------------------------------------------
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._count("PutObject")
        with self._lock:
            if if_absent and key in self._objects:
                raise CommitConflict(f"{self.url}/{key} already exists")
            self._objects[key] = (bytes(data), time.time())

    def put_volatile(self, key: str, data: bytes) -> None:
        self.put(key, data)

    def open_sink(self, key: str, size: int) -> DataSink:
        return _Sink(self, key, size)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        self._count("HeadObject" if end is not None and end == start else "GetObject")
        data = self._find(key)
        end = len(data) if end is None else end
        if start < 0 or end < start or end > len(data):
            raise CorruptCheckpoint(
                f"{self.url}/{key}: range [{start}, {end}) is outside the object ({len(data)} bytes)"
            )
        return data[start:end]

    def read_ranges(self, key: str, start: int, bufs: list[memoryview]) -> None:
        n = sum(len(b) for b in bufs)
        data = self.get(key, start, start + n)
        at = 0
        for b in bufs:
            b[:] = data[at : at + len(b)]
            at += len(b)

    def read_into(self, key: str, start: int, buf: memoryview) -> None:
        self.read_ranges(key, start, [buf])

    def read_head(self, key: str, n: int) -> tuple[bytes, int, float]:
        self._count("GetObject")
        with self._lock:
            got = self._objects.get(key)
        if got is None:
            raise CheckpointNotFound(f"{self.url}/{key}: no such object")
        return got[0][:n], len(got[0]), got[1]

    def exists(self, key: str) -> bool:
        self._count("HeadObject")
        with self._lock:
            return key in self._objects

    def size(self, key: str) -> int:
        self._count("HeadObject")
        return len(self._find(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._lock:
            found = [ObjectInfo(k, len(v), t) for k, (v, t) in self._objects.items() if k.startswith(prefix)]
        self._count("ListObjectsV2", max(1, -(-len(found) // PAGE)))
        return iter(found)

    def list_tops(self) -> builtins.list[str]:
        with self._lock:
            tops = sorted({k.split("/", 1)[0] for k in self._objects if "/" in k})
        self._count("ListObjectsV2", max(1, -(-len(tops) // PAGE)))
        return tops

    def delete(self, key: str) -> None:
        self._count("DeleteObject")
        with self._lock:
            self._objects.pop(key, None)

    def delete_many(self, keys: builtins.list[str]) -> int:
        self._count("DeleteObjects", max(1, -(-len(keys) // PAGE)))
        with self._lock:
            return sum(self._objects.pop(k, None) is not None for k in keys)

    def root_id(self) -> str:
        return self._root

    # -- for the simulator --------------------------------------------------------------------
    def seed(self, key: str, data: bytes) -> None:
        """Place an object without counting it (the state before the simulated run)."""
        self._store(key, data)

    def clear(self) -> None:
        """Lose every object (a node's disk lost)."""
        with self._lock:
            self._objects.clear()

    def keys(self) -> builtins.list[str]:
        with self._lock:
            return list(self._objects)
