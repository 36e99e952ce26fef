"""Sequential writes of an object whose size is known only at the end, with server-side copies.

An encoding hop (:mod:`tierckpt.codec.hop`) produces a data file's stored form frame by frame:
coded frames of sizes known only once coded, and runs of frames unchanged since the previous
checkpoint, whose stored bytes already sit in that checkpoint's object on the same tier.
:meth:`Tier.open_stream <tierckpt.tiers.base.Tier.open_stream>` returns a :class:`StreamSink`
for it; :class:`Encoding` is how a tier says it wants its files stored that way.
"""

from __future__ import annotations

import abc
import os
import tempfile
from dataclasses import dataclass
from typing import Any

__all__ = ["Encoding", "StreamSink", "SpoolStream"]


@dataclass(frozen=True)
class Encoding:
    """How a tier stores the data files a hop copies into it (from its configuration section).

    ``compression``: ``"zstd"`` (byte planes + zstd at ``level``) or ``"none"``;
    ``copy_unchanged``: frames equal to the previous checkpoint's are copied by the tier itself
    (S3 ``UploadPartCopy``), never sent again.
    """

    compression: str = "none"
    level: int = 1
    copy_unchanged: bool = True


class StreamSink(abc.ABC):
    """An object written front to back (one thread), visible under its key only after :meth:`close`.

    ``uploaded`` / ``copied`` count the bytes sent to the tier and the bytes the tier copied from
    another of its objects (:meth:`append_copy`).
    """

    uploaded: int = 0
    copied: int = 0

    @abc.abstractmethod
    def append(self, data: memoryview | bytes) -> None:
        """Append ``data`` (the caller may reuse its buffer once this returns)."""

    def append_copy(self, key: str, start: int, end: int) -> None:
        """Append bytes ``[start, end)`` of object ``key`` of the same tier. The default reads
        and appends them; a tier with server-side copies overrides it."""
        self.append(memoryview(self._tier.get(key, start, end)))

    @abc.abstractmethod
    def close(self) -> int:
        """Make the object durable and visible; return its size."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard everything written. Never raises."""

    _tier: Any = None


class SpoolStream(StreamSink):
    """The default :class:`StreamSink`: bytes spooled to a temporary file, then written through
    the tier's :meth:`~tierckpt.tiers.base.Tier.open_sink` at :meth:`close` (any tier can do it)."""

    def __init__(self, tier: Any, key: str) -> None:
        self._tier, self._key = tier, key
        self._f = tempfile.TemporaryFile(prefix="tierckpt-stream-")
        self.size = 0

    def append(self, data: memoryview | bytes) -> None:
        self._f.write(data)
        self.size += len(data)
        self.uploaded += len(data)

    def close(self) -> int:
        try:
            self._f.flush()
            sink = self._tier.open_sink(self._key, self.size)
            try:
                step = 8 << 20
                buf = bytearray(min(step, max(1, self.size)))
                at = 0
                while at < self.size:
                    n = os.preadv(self._f.fileno(), [memoryview(buf)[: min(step, self.size - at)]], at)
                    if n <= 0:
                        raise OSError(f"spool file of {self._key} shrank")
                    sink.write_at(at, memoryview(buf)[:n])
                    at += n
                sink.close()
            except BaseException:
                sink.abort()
                raise
            return self.size
        finally:
            self._f.close()

    def abort(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass
