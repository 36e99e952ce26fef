"""The byte layer: what every storage tier provides.

A tier stores opaque objects under relative keys such as ``"step-100/rank-00000.data"`` or
``"step-100/metadata.json"``. It never sees a DCP plan; the DCP layer (``writer.py``,
``reader.py``, ``commit.py``) never touches file handles or boto3. A new tier is a new module
implementing :class:`Tier`.

Keys are validated by :func:`check_key`: relative, ``/``-separated, no ``..``, no empty parts,
no backslashes, so that a hostile manifest can never name something outside the tier's root.

Thread safety: every method may be called from several threads at once.
"""

from __future__ import annotations

import abc
import builtins
import errno
import re
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from ..errors import CorruptCheckpoint, TierError
from .streams import Encoding, SpoolStream, StreamSink

__all__ = [
    "Tier",
    "DataSink",
    "Encoding",
    "ObjectInfo",
    "ResumableSink",
    "Spare",
    "StreamSink",
    "check_key",
    "spared_ids",
]

#: The checkpoint ids :meth:`Tier.abort_stale` leaves alone: a collection, or a callable the tier
#: calls once it has listed the leftovers (so that the leases it reads are at least as new as the
#: listing: a save takes its lease before it creates anything, so every leftover listed by then
#: belongs to a lease the callable sees).
Spare = Collection[str] | Callable[[], Collection[str]]


def spared_ids(spare: Spare) -> Collection[str]:
    """The ids in ``spare``, calling it when it is a callable (the tier does, after listing)."""
    return spare() if callable(spare) else spare


_KEY_PART = re.compile(r"^[A-Za-z0-9._\-=+@,]+$")


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise :class:`CorruptCheckpoint`."""
    if not isinstance(key, str) or not key or len(key) > 1024:
        raise CorruptCheckpoint(f"invalid storage key {key!r}")
    parts = key.split("/")
    for part in parts:
        if part in ("", ".", "..") or not _KEY_PART.match(part):
            raise CorruptCheckpoint(f"invalid storage key {key!r}: part {part!r} is not allowed")
    return key


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key (relative to the tier root), size in bytes, mtime (epoch s)."""

    key: str
    size: int
    mtime: float


class DataSink(abc.ABC):
    """A large object written at known offsets, possibly from several threads at once.

    Created by :meth:`Tier.open_sink` with the object's final size. ``write_at`` may be called
    concurrently for disjoint ranges; ``close`` makes the bytes durable (fsync, or the multipart
    completion) and visible under the key; ``abort`` discards everything written. After either,
    the sink is unusable. Until ``close`` returns, nothing is visible under the key.
    """

    @abc.abstractmethod
    def write_at(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset``; blocks until the bytes are handed to the tier."""

    @abc.abstractmethod
    def close(self) -> None:
        """Make all written bytes durable and visible under the key."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard the partial object. Never raises."""


class ResumableSink(abc.ABC):
    """A large object written block by block, resumable after an interruption, even a crash.

    Created by :meth:`Tier.open_resumable` with the object's final ``size``, a ``block`` size and
    a ``tag``. Block ``i`` covers bytes ``[i * block, min(size, (i + 1) * block))``.

    * ``recorded``: the blocks an earlier, interrupted writer of the same key recorded as landed
      (written and, where the tier makes writes durable, durable), under the same tag, size and
      block. They are candidates: callers re-check them (:meth:`read_block`) and :meth:`keep`
      the good ones. Tiers that cannot keep a partial object across processes record nothing.
    * :meth:`write_block` may run on several threads at once for different blocks.
    * Until :meth:`close` returns nothing is visible under the key (an object already there stays
      as it was, unless it was adopted); :meth:`suspend` keeps the partial object and its record
      for a later open; :meth:`abort` discards them. After any of the three the sink is unusable.
    """

    recorded: set[int]
    size: int
    block: int

    def blocks(self) -> int:
        """How many blocks the object has."""
        return -(-self.size // self.block) if self.size else 0

    def span(self, i: int) -> tuple[int, int]:
        """Bytes ``[start, end)`` of block ``i``."""
        return i * self.block, min(self.size, (i + 1) * self.block)

    @abc.abstractmethod
    def read_block(self, i: int, buf: memoryview) -> None:
        """Read back recorded block ``i`` (``len(buf)`` = its length) from the partial object."""

    @abc.abstractmethod
    def keep(self, blocks: set[int]) -> None:
        """Forget (durably) every recorded block not in ``blocks``: they will be written again."""

    @abc.abstractmethod
    def write_block(self, i: int, data: memoryview) -> None:
        """Write all of block ``i``. A block is recorded (kept by a resumed write) only once durable
        where the tier can make it so; a tier may record blocks in batches (the local tier: every
        few hundred MiB, after one ``fdatasync``), so an interruption may cost the unrecorded
        blocks, never correctness (a resumed write re-checks what it keeps)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Every block is recorded: make the object durable and visible under the key (replacing
        what was there); the record goes. Raises :class:`CorruptCheckpoint` if a block is missing."""

    @abc.abstractmethod
    def suspend(self) -> None:
        """Stop for now, keeping the partial object and its record for a later open. Never raises."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard the partial object and its record. Never raises."""


class _StreamingResumable(ResumableSink):
    """The default :class:`ResumableSink`: a plain :class:`DataSink` that never resumes (nothing
    recorded; :meth:`suspend` discards), exclusive per key within this process only."""

    _open: set[tuple[str, str]] = set()
    _open_lock = threading.Lock()

    def __init__(self, tier: Tier, key: str, size: int, block: int) -> None:
        self._id = (tier.url, key)
        with self._open_lock:
            if self._id in self._open:
                raise TierError(errno.EBUSY, f"{tier.url}/{key} is being written by another resumable sink")
            self._open.add(self._id)
        self.size, self.block, self.recorded = size, block, set()
        self._url = f"{tier.url}/{key}"
        self._done: set[int] = set()
        self._lock = threading.Lock()
        try:
            self._sink = tier.open_sink(key, size)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        with self._open_lock:
            self._open.discard(self._id)

    def read_block(self, i: int, buf: memoryview) -> None:
        raise CorruptCheckpoint(f"{self._url}: block {i} is not recorded")

    def keep(self, blocks: set[int]) -> None:
        self.recorded &= set(blocks)

    def write_block(self, i: int, data: memoryview) -> None:
        s, e = self.span(i)
        if len(data) != e - s:
            raise CorruptCheckpoint(f"{self._url}: block {i} has {e - s} bytes, got {len(data)}")
        self._sink.write_at(s, data)
        with self._lock:
            self._done.add(i)

    def close(self) -> None:
        missing = self.blocks() - len(self._done)
        if missing:
            raise CorruptCheckpoint(f"{self._url}: {missing} of {self.blocks()} blocks were never written")
        try:
            self._sink.close()
        finally:
            self._release()

    def suspend(self) -> None:
        self.abort()

    def abort(self) -> None:
        try:
            self._sink.abort()
        finally:
            self._release()


class Tier(abc.ABC):
    """A storage tier: put / ranged get / list / delete over relative keys.

    Attributes:
        name: short name used in logs and messages (``"local"``, ``"s3"``).
        url: where it lives, for messages (a directory path or ``s3://bucket/prefix``).
        cheap_listing: listing and ``exists`` cost no network round trip (a local file system):
            callers may check every data file of a checkpoint before choosing the tier.
        node_local: each node sees its own copy of this tier (``{node}`` in a local path): a
            node holds only the data files of its own ranks. False: one root shared by all.
        durable: a committed object survives the crash of the writing process (fsync'd files,
            object stores). A checkpoint is committed only on durable tiers.
        conditional_create: ``put(..., if_absent=True)`` is atomic (rename-without-replace,
            ``If-None-Match``); the commit protocol needs it for the metadata write.
        read_range: preferred bytes per read request (a multipart part on object stores).
        read_concurrency: how many range reads of one file pay off in parallel.
        keep / keep_every: the retention policy of this tier, from its configuration section
            (``keep`` newest committed checkpoints, 0 = all; every ``keep_every``-th step kept).
        encoding: how a hop stores data files here (:class:`Encoding`: compression, copies of
            unchanged parts; :mod:`tierckpt.codec`), or None: as they are.
        may_encode: this tier can hold encoded data files (written now or by an earlier
            configuration): readers look for a stored index in its metadata.

    Code outside ``tiers/`` decides by these flags, never by ``name``.
    """

    name: str = "tier"
    url: str = ""
    cheap_listing: bool = False
    node_local: bool = False
    durable: bool = True
    conditional_create: bool = True
    read_range: int = 32 << 20
    read_concurrency: int = 4
    keep: int = 0
    keep_every: int = 0
    encoding: Encoding | None = None
    may_encode: bool = False

    # -- writes ---------------------------------------------------------------------------
    @abc.abstractmethod
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Store a small object atomically (readers see all of it or nothing).

        With ``if_absent=True`` the put fails with :class:`~tierckpt.errors.CommitConflict` if the
        key already exists; this is the commit primitive (rename-without-replace on file systems,
        ``If-None-Match: *`` on object stores).
        """

    def put_volatile(self, key: str, data: bytes) -> None:
        """Store a small object that need not survive a machine crash (leases): like
        :meth:`put` without ``if_absent``, minus the durability cost where a tier has one."""
        self.put(key, data)

    @abc.abstractmethod
    def open_sink(self, key: str, size: int) -> DataSink:
        """Start writing a large object of exactly ``size`` bytes at ``key``."""

    def open_stream(self, key: str, size_hint: int = 0) -> StreamSink:
        """Start writing an object at ``key`` front to back, its size unknown until the end
        (an encoding hop; :class:`StreamSink`). The default spools it to a temporary file and
        writes it through :meth:`open_sink` on close; tiers with multipart uploads override it."""
        return SpoolStream(self, check_key(key))

    def upload_file(self, key: str, path: str, *, progress: callable | None = None) -> None:  # type: ignore[valid-type]
        """Copy a local file to ``key`` (promotion). The default streams it through a sink."""
        import os

        size = os.path.getsize(path)
        sink = self.open_sink(key, size)
        try:
            with open(path, "rb", buffering=0) as f:
                off = 0
                step = 8 << 20
                buf = bytearray(min(step, max(size, 1)))
                while off < size:
                    n = f.readinto(memoryview(buf)[: min(step, size - off)])
                    if not n:
                        raise CorruptCheckpoint(f"{path}: file shrank while uploading to {self.url}/{key}")
                    sink.write_at(off, memoryview(buf)[:n])
                    off += n
                    if progress is not None:
                        progress(n)
            sink.close()
        except BaseException:
            sink.abort()
            raise

    def copy_from(self, src: Tier, key: str) -> int:
        """Copy object ``key`` from ``src`` to this tier under the same key (replication down the
        chain); return its size. Nothing is visible under ``key`` here until the copy is complete.

        The default reads ``src`` in ``self.read_range`` pieces (a multipart part on object
        stores, so each write is uploaded straight from the buffer), ``self.read_concurrency`` at
        a time, each thread reusing one buffer, and writes them through :meth:`open_sink`; on any
        failure the sink is aborted. Tiers with a server-side copy may override it.
        """
        import threading
        from concurrent.futures import ThreadPoolExecutor

        size = src.size(key)
        piece = max(1 << 20, int(self.read_range))
        n = -(-size // piece)
        sink = self.open_sink(key, size)
        bufs = threading.local()
        stop = threading.Event()

        def one(i: int) -> None:
            if stop.is_set():
                return
            off = i * piece
            ln = min(piece, size - off)
            buf = getattr(bufs, "b", None)
            if buf is None or len(buf) < ln:
                buf = bufs.b = bytearray(max(ln, min(piece, size)))
            view = memoryview(buf)[:ln]
            src.read_into(key, off, view)
            sink.write_at(off, view)

        try:
            if n:
                with ThreadPoolExecutor(
                    max(1, min(int(self.read_concurrency), n)), thread_name_prefix="tierckpt-copy"
                ) as pool:
                    futures = [pool.submit(one, i) for i in range(n)]
                    try:
                        for f in futures:
                            f.result()
                    except BaseException:
                        stop.set()
                        raise
            sink.close()
        except BaseException:
            sink.abort()
            raise
        return size

    # -- reads ----------------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Return bytes ``[start, end)`` of ``key`` (``end=None``: to the end of the object).

        Raises :class:`~tierckpt.errors.CheckpointNotFound` if the key does not exist and
        :class:`~tierckpt.errors.CorruptCheckpoint` if the range goes past the end.
        """

    def read_into(self, key: str, start: int, buf: memoryview) -> None:
        """Fill ``buf`` with bytes ``[start, start+len(buf))`` of ``key``. Default uses ``get``."""
        data = self.get(key, start, start + len(buf))
        buf[:] = data

    def read_ranges(self, key: str, start: int, bufs: list[memoryview]) -> None:
        """Fill consecutive buffers from ``start`` on (a scatter read of one contiguous range).

        The default reads the whole range into one temporary buffer and splits it; tiers with
        a native scatter read (``preadv``) override it.
        """
        if len(bufs) == 1:
            self.read_into(key, start, bufs[0])
            return
        total = sum(len(b) for b in bufs)
        tmp = bytearray(total)
        self.read_into(key, start, memoryview(tmp))
        at = 0
        for b in bufs:
            b[:] = memoryview(tmp)[at : at + len(b)]
            at += len(b)

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object exists at ``key``."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes of ``key`` (:class:`~tierckpt.errors.CheckpointNotFound` if absent)."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in no particular order."""

    def list_dirs(self) -> builtins.list[str]:
        """The first path components of all keys (checkpoint ids), sorted."""
        return sorted({info.key.split("/", 1)[0] for info in self.list("") if "/" in info.key})

    def list_tops(self) -> builtins.list[str]:
        """The first path components of all keys, sorted; may include a name with nothing under it
        any more. A tier with a delimited listing answers with one request per 1,000 names,
        whatever the number of objects (the default lists every key)."""
        return self.list_dirs()

    def read_head(self, key: str, n: int) -> tuple[bytes, int, float]:
        """The first ``min(n, size)`` bytes of ``key``, its size and its modification time
        (:class:`~tierckpt.errors.CheckpointNotFound` if absent). Object stores answer with one
        ranged GET; the default asks for the size first."""
        size = self.size(key)
        return self.get(key, 0, min(n, size)), size, 0.0

    # -- deletes --------------------------------------------------------------------------
    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete one object; a missing key is not an error."""

    def delete_many(self, keys: builtins.list[str]) -> int:
        """Delete exactly these objects (missing ones are skipped); return how many existed.

        Unlike :meth:`delete_prefix`, objects created under the same prefix after the caller
        listed it are left alone (a save of the same id that just started)."""
        n = 0
        for key in keys:
            if self.exists(key):
                n += 1
            self.delete(key)
        return n

    def abort_stale(self, older_than_s: float, spare: Spare = ()) -> int:
        """Discard leftovers of interrupted writes older than ``older_than_s`` seconds (incomplete
        multipart uploads, half-written files of a killed process), except under the checkpoint
        ids in ``spare`` (those with a live lease: a fetch or save may still resume them; a
        callable is called after the leftovers are listed, see :data:`Spare`); return how many.
        Tiers without such leftovers return 0. Called by retention after each commit and by
        ``gc``."""
        return 0

    def free_bytes(self) -> int | None:
        """Free space for new objects, when the tier has a meaningful figure (a disk); else None."""
        return None

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix`` (which must end with ``/``); return how many."""
        if not prefix.endswith("/"):
            raise ValueError(f"delete_prefix needs a prefix ending with '/', got {prefix!r}")
        n = 0
        for info in list(self.list(prefix)):
            self.delete(info.key)
            n += 1
        return n

    def probe(self) -> None:
        """Check, with one cheap operation, that checkpoints can be stored here: the writer calls it
        once per process when it is created (:mod:`tierckpt.save.preflight`), so that a tier that
        cannot work is reported at once, not by the first save's background thread.

        Raises :class:`~tierckpt.errors.TierUnreachable` when the tier cannot be reached now (it may
        come back: an outage), any other :class:`~tierckpt.errors.TierckptError` when it answers but
        cannot be used as configured (:class:`~tierckpt.errors.TierAccessDenied` for refused or
        missing credentials, a missing bucket, a path that cannot be a directory); the message names
        the tier's url and never a secret. Bounded in time by the tier's own timeouts, without
        retries. Stores nothing that outlives the call (a leftover of a crash is one temporary
        object that listings skip and ``abort_stale`` removes). Default: nothing to check (a tier
        that cannot tell cheaply is found out by its first write).
        """

    def root_id(self) -> str:
        """What identifies this tier's root across processes (ranks writing to the same root
        elect one metadata writer). The default is :attr:`url`."""
        return self.url

    def close(self) -> None:
        """Release clients, pools and handles. The tier may not be used afterwards."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- resumable writes and background work (added with the one read engine) -----------------
    def open_resumable(
        self, key: str, size: int, *, block: int, tag: dict | None = None, adopt: bool = False
    ) -> ResumableSink:
        """Start, or resume, writing a large object of ``size`` bytes at ``key`` in ``block``-byte blocks.

        ``tag``: a small JSON-able dict naming what is written (e.g. the save it comes from); a
        partial object left by an earlier writer is resumed only when its tag, size and block
        are the same, else discarded. ``adopt``: an object already stored at ``key`` with exactly
        ``size`` bytes becomes the partial object, every block recorded (repair in place: the
        caller checks them and keeps the good ones); tiers that cannot do this leave it visible
        until :meth:`ResumableSink.close` replaces it. One resumable sink per key at a time: a
        second open raises :class:`~tierckpt.errors.TierError` (``EBUSY``) naming the key
        (across processes where the tier can tell: a local file lock; else within this process).

        The default writes through :meth:`open_sink` and never resumes; a tier that can keep a
        partial object durably (a file system) overrides it. See :class:`ResumableSink`.
        """
        if block <= 0:
            raise ValueError(f"block must be positive, got {block}")
        return _StreamingResumable(self, check_key(key), size, block)

    def wait_deletions(self, timeout_s: float = 600.0) -> None:
        """Block until deletions this process handed to background work on this tier are done
        (the local tier unlinks large files in a background thread). Default: nothing to wait for."""
