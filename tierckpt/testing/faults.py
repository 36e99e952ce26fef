"""A fault-injecting tier: wraps any :class:`~tierckpt.tiers.base.Tier` and fails chosen operations.

Used by the commit-protocol contract suite and by tests that need a tier to fail at a given
step (a full disk while writing, a lost connection at the metadata put, a missing object)::

    faulty = FaultyTier(LocalTier(tmp_path))
    faulty.arm("put", TierError(28, "disk full (injected)"), match="metadata.json")
    engine = register_engine(Engine(cfg, tiers=[faulty]))

Every other call goes to the wrapped tier unchanged; the capability flags are the wrapped tier's.
Thread-safe. Never used by the library itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..tiers.base import DataSink, ObjectInfo, Spare, Tier

__all__ = ["FaultyTier", "OPS"]

OPS = ("put", "open_sink", "write_at", "sink_close", "get", "read_into", "size", "exists", "list", "delete")
"""The operations :meth:`FaultyTier.arm` can fail."""


@dataclass
class _Fault:
    exc: BaseException | Callable[[], None]
    match: str
    skip: int
    times: int


class FaultyTier(Tier):
    """``inner`` with faults armed per operation (see :data:`OPS`). ``calls`` counts every call
    by operation (armed or not)."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        self.name, self.url = inner.name, inner.url
        for flag in (
            "cheap_listing",
            "node_local",
            "durable",
            "conditional_create",
            "read_range",
            "read_concurrency",
            "keep",
            "keep_every",
        ):
            setattr(self, flag, getattr(inner, flag))
        self._faults: dict[str, list[_Fault]] = {}
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {op: 0 for op in OPS}

    def arm(
        self, op: str, exc: BaseException | Callable[[], None], *, match: str = "", skip: int = 0, times: int = 1
    ) -> None:
        """Make the next ``times`` calls of ``op`` on a key containing ``match`` raise ``exc`` (or
        call it, when it is a function: e.g. one that kills the process), after letting ``skip``
        such calls through. ``times=0``: every call from then on."""
        if op not in OPS:
            raise ValueError(f"unknown operation {op!r} (one of {', '.join(OPS)})")
        with self._lock:
            self._faults.setdefault(op, []).append(_Fault(exc, match, skip, times))

    def disarm(self) -> None:
        with self._lock:
            self._faults.clear()

    def _check(self, op: str, key: str) -> None:
        action = None
        with self._lock:
            self.calls[op] += 1
            for f in self._faults.get(op, []):
                if f.match not in key:
                    continue
                if f.skip > 0:
                    f.skip -= 1
                    continue
                if f.times == 1:
                    self._faults[op].remove(f)
                elif f.times > 1:
                    f.times -= 1
                if isinstance(f.exc, BaseException):
                    raise f.exc
                action = f.exc
                break
        if action is not None:
            action()  # outside the lock: it may block or end the process

    # -- the contract, forwarded ------------------------------------------------------------
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._check("put", key)
        self.inner.put(key, data, if_absent=if_absent)

    def put_volatile(self, key: str, data: bytes) -> None:
        self._check("put", key)
        self.inner.put_volatile(key, data)

    def open_sink(self, key: str, size: int) -> DataSink:
        self._check("open_sink", key)
        return _FaultySink(self, key, self.inner.open_sink(key, size))

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        self._check("get", key)
        return self.inner.get(key, start, end)

    def read_into(self, key: str, start: int, buf: memoryview) -> None:
        self._check("read_into", key)
        self.inner.read_into(key, start, buf)

    def read_ranges(self, key: str, start: int, bufs: list[memoryview]) -> None:
        self._check("read_into", key)
        self.inner.read_ranges(key, start, bufs)

    def exists(self, key: str) -> bool:
        self._check("exists", key)
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        self._check("size", key)
        return self.inner.size(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._check("list", prefix)
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self._check("delete", key)
        self.inner.delete(key)

    def free_bytes(self) -> int | None:
        return self.inner.free_bytes()

    def abort_stale(self, older_than_s: float, spare: Spare = ()) -> int:
        return self.inner.abort_stale(older_than_s, spare)

    def root_id(self) -> str:
        return self.inner.root_id()

    def wait_deletions(self, timeout_s: float = 600.0) -> None:
        self.inner.wait_deletions(timeout_s)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"FaultyTier({self.inner!r})"


class _FaultySink(DataSink):
    def __init__(self, tier: FaultyTier, key: str, inner: DataSink) -> None:
        self._tier, self._key, self._inner = tier, key, inner

    def write_at(self, offset: int, data: memoryview) -> None:
        self._tier._check("write_at", self._key)
        self._inner.write_at(offset, data)

    def close(self) -> None:
        self._tier._check("sink_close", self._key)
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()
