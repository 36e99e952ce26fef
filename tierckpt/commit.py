"""The cross-rank commit protocol, the ``latest`` resolution and the listing of checkpoints, per tier.

Protocol for one checkpoint on one tier (run by background threads; no collective on the
training process group is ever issued here):

1. Every rank makes its data durable on the tier (fsync + rename, or multipart completion) and
   publishes a *rank report* on the :class:`Channel`: its file size and the CRC32C pieces of its
   items, or the error that stopped it.
2. The coordinator (rank 0) waits for all reports (up to ``[job] commit_timeout``), merges them
   into DCP's Metadata and publishes the *outcome*: the metadata JSON, or the reason for failure.
3. Each rank reads the outcome. The *metadata writer* of each distinct tier root (the lowest
   rank using it: one per node for node-local paths, one in all for a shared path or S3) writes
   ``ID/metadata.json`` last, with create-if-absent (``os.link`` / ``If-None-Match``). That put
   is the commit: before it, the checkpoint is never loaded, never ``latest``, and is never a
   reason to delete an older one.

The channel is the process group's key-value store (``dist`` default store), polled with short
``check`` calls so the background thread never holds the store for long; in a single process it
is an in-memory dict.
"""

from __future__ import annotations

import abc
import json
import logging
import threading
import time
from typing import Any

from .errors import CaptureError, TierckptError

__all__ = ["Channel", "LocalChannel", "StoreChannel", "default_channel", "encode_report", "decode_report",
           "gather_reports"]

log = logging.getLogger("tierckpt.commit")


class Channel(abc.ABC):
    """A tiny key-value rendezvous between the ranks of one job."""

    @abc.abstractmethod
    def publish(self, key: str, value: bytes) -> None:
        """Make ``value`` visible to every rank under ``key``."""

    @abc.abstractmethod
    def try_get(self, key: str) -> bytes | None:
        """The value under ``key``, or ``None`` if not published yet."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Forget ``key`` (best effort)."""

    def wait_get(self, key: str, timeout: float, what: str, cancelled=lambda: False) -> bytes:
        """Poll until ``key`` is published; raise :class:`CaptureError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            v = self.try_get(key)
            if v is not None:
                return v
            if cancelled():
                raise CaptureError(f"{what}: cancelled")
            if time.monotonic() > deadline:
                raise CaptureError(f"{what}: nothing arrived within {timeout:.0f} s (a rank died or hung?)")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)


class LocalChannel(Channel):
    """In-process channel (``no_dist`` and single-process saves)."""

    def __init__(self) -> None:
        self._d: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def publish(self, key: str, value: bytes) -> None:
        with self._lock:
            self._d[key] = value

    def try_get(self, key: str) -> bytes | None:
        with self._lock:
            return self._d.get(key)

    def delete(self, key: str) -> None:
        with self._lock:
            self._d.pop(key, None)


class StoreChannel(Channel):
    """A channel over a ``torch.distributed.Store`` (thread-safe client calls, never collectives).

    TCPStore refuses values over 8 MiB (and drops the connection), so a larger value (the merged
    metadata of a big checkpoint) goes out in parts under ``KEY/#i``, and ``KEY`` itself, set
    last, names them.
    """

    PART = 4 << 20
    _PARTS = b"\x00tierckpt-parts:"

    def __init__(self, store: Any) -> None:
        self._store = store

    def publish(self, key: str, value: bytes) -> None:
        if len(value) <= self.PART:
            self._store.set(key, value)
            return
        n = (len(value) + self.PART - 1) // self.PART
        for i in range(n):
            self._store.set(f"{key}/#{i}", value[i * self.PART:(i + 1) * self.PART])
        self._store.set(key, self._PARTS + str(n).encode())

    def try_get(self, key: str) -> bytes | None:
        if not self._store.check([key]):
            return None
        v = bytes(self._store.get(key))
        if v.startswith(self._PARTS):
            v = b"".join(bytes(self._store.get(f"{key}/#{i}")) for i in range(int(v[len(self._PARTS):])))
        return v

    def delete(self, key: str) -> None:
        try:
            v = bytes(self._store.get(key)) if self._store.check([key]) else b""
            if v.startswith(self._PARTS):
                for i in range(int(v[len(self._PARTS):])):
                    self._store.delete_key(f"{key}/#{i}")
            self._store.delete_key(key)
        except Exception:  # noqa: BLE001 - some stores cannot delete; keys are small
            pass


_local_channel = LocalChannel()


def default_channel(distributed: bool) -> Channel:
    """The default process group's store when distributed, else the process-local channel."""
    if distributed:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if dist.is_available() and dist.is_initialized():
            return StoreChannel(c10d._get_default_store())
    return _local_channel


# -- rank reports and outcomes ---------------------------------------------------------------

def encode_report(ok: bool, *, size: int = 0, crcs: list[list[int]] | None = None, error: str = "", seq: int = 0) -> bytes:
    """A rank report: ok or the error, the file size and CRC pieces, and the highest commit
    sequence number the rank has seen (the coordinator numbers the checkpoint above all of them)."""
    return json.dumps({"ok": ok, "size": size, "crcs": crcs or [], "error": error, "seq": seq}).encode()


def decode_report(raw: bytes, who: str) -> dict:
    try:
        d = json.loads(raw)
        if not isinstance(d, dict) or "ok" not in d:
            raise ValueError("not a report")
        return d
    except ValueError as e:
        raise TierckptError(f"{who}: malformed report on the commit channel ({e})") from None


def gather_reports(channel: Channel, prefix: str, world: int, timeout: float, what: str,
                   cancelled=lambda: False) -> list[dict]:
    """Coordinator: wait for every rank's report under ``prefix``; raise on the first failure."""
    deadline = time.monotonic() + timeout
    reports: list[dict] = []
    for r in range(world):
        left = max(0.0, deadline - time.monotonic())
        raw = channel.wait_get(f"{prefix}/rank{r}", left, f"{what}: report of rank {r}", cancelled)
        rep = decode_report(raw, f"{what} rank {r}")
        if not rep["ok"]:
            raise CaptureError(f"{what}: rank {r} failed: {rep['error']}")
        reports.append(rep)
    for r in range(world):
        channel.delete(f"{prefix}/rank{r}")
    return reports

