"""Sequential writes of an object whose size is known only at the end, with server-side copies.

An encoding hop (:mod:`tierckpt.codec.hop`) produces a data file's stored form frame by frame:
coded frames of sizes known only once coded, and runs of frames unchanged since the previous
checkpoint, whose stored bytes already sit in that checkpoint's object on the same tier.
:meth:`Tier.open_stream <tierckpt.tiers.base.Tier.open_stream>` returns a :class:`StreamSink`
for it; :class:`Encoding` is how a tier says it wants its files stored that way.

A copy is never trusted: :meth:`StreamSink.append_copy` raises :class:`CopySourceError` (naming
the source object) when the source cannot be read or copied, and :meth:`StreamSink.close` raises
it when an object assembled with copies does not have the size its appends add up to (a source
shorter than the range asked). The encoding hop reads back what was copied before it commits
(:func:`tierckpt.codec.hop.copy_encoded`).
"""

from __future__ import annotations

import abc
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from ..errors import TierckptError, TierError

__all__ = ["CopySourceError", "Encoding", "StreamSink", "SpoolStream"]


class CopySourceError(TierError):
    """Bytes that :meth:`StreamSink.append_copy` was to take from another object of the tier could
    not be copied (the source is missing, shorter than the range, or unreadable). The message
    names the source object. The stream is failed (:meth:`StreamSink.abort` it); the caller may
    write the same object again without copying."""


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
        and appends them; a tier with server-side copies overrides it. Raises
        :class:`CopySourceError` (naming ``key``) when they cannot be read whole."""
        try:
            data = self._tier.get(key, start, end)
        except TierckptError as e:
            raise CopySourceError(f"copy of bytes [{start}, {end}) of {self._tier.url}/{key}: {e}") from e
        if len(data) != end - start:
            raise CopySourceError(
                f"copy of bytes [{start}, {end}) of {self._tier.url}/{key}: only {len(data)} bytes were read"
            )
        self.append(memoryview(data))

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
