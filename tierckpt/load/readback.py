"""The one verified multi-tier read engine: ``dcp.load`` (:mod:`tierckpt.reader`) and the restore
tools (verify, fetch, consolidate) read committed checkpoints through it.

Contract of :class:`Readback` (item reads)::

    rb = Readback(checkpoint_id, holding_tiers, chunk_size)   # tiers fastest first
    rb.read([Request(rec, buf, "item 'model.w'"), ...])        # fills and verifies every buf

* Per data file, the fastest tier holding it is read first: a tier with ``cheap_listing`` is
  asked (``exists``) whether it has the file; a tier without is assumed to have it (an absent
  file there is found by the read itself, at no extra round trip).
* Items of one file are read in offset order, neighbours (gaps up to :data:`MAX_GAP`) merged
  into one scatter read of at most :data:`RUN_BYTES` (``tier.read_ranges``), runs in parallel on
  ``threads`` workers (default: the largest ``read_concurrency`` of the tiers serving first).
* Every item's CRC32C pieces, its padding included, are checked against its record
  (:func:`tierckpt.layout.item_intact`). An item that fails its check, or whose read failed, is
  read again, alone, from each next tier holding its file, fastest first; after a read error
  (not an absence, not a CRC mismatch) the same tier is tried once more, alone (a truncated
  file still serves the items before the cut). A fallback that worked is logged (warning).
* A tier's read failing with any error, not only ``TierckptError``/``OSError`` (a ``MemoryError``
  out of a hostile stored index, say), is that tier's read error: the next tier serves, and the
  error that no tier served reports it (chained as ``__cause__``); tiers' bytes and indexes are
  input from outside the process.
* When no tier serves an item: :class:`ChecksumMismatch` if some tier returned bytes that failed
  their check, :class:`CheckpointNotFound` if no tier has the file (or the checkpoint was deleted
  meanwhile), :class:`CorruptCheckpoint` otherwise; each message names the checkpoint, item,
  file, writing rank and every tier tried.

Range reads (the restore tools): :func:`range_size` and :func:`workers` define the size and
parallelism of aligned range reads once; :func:`read_checked` reads one range from one tier and
re-reads it up to :data:`TRIES` times while it fails its check. :func:`hold` takes the leases
(:mod:`tierckpt.lease`) that keep retention and gc away from a checkpoint while it is read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from ..catalog import lease as leases
from ..codec.view import decoding
from ..errors import CheckpointBeingDeleted, CheckpointNotFound, ChecksumMismatch, CorruptCheckpoint, TierckptError
from ..format.layout import data_key, metadata_key, padded, rank_of_file
from ..format.metadata import ItemRecord, item_intact
from ..tiers.base import Tier

__all__ = [
    "BUFFER_BUDGET",
    "MAX_GAP",
    "RUN_BYTES",
    "TRIES",
    "Readback",
    "Request",
    "hold",
    "range_size",
    "read_checked",
    "workers",
    "writer_rank",
]

log = logging.getLogger("tierckpt")

RUN_BYTES = 16 << 20
"""Bytes per merged item read: small enough to keep every reader thread busy."""
MAX_GAP = 256 << 10
"""Items separated by at most this many bytes are read in one request (the gap is read and dropped)."""
TRIES = 3
"""Reads of one range from one tier while its bytes fail their CRC32C (a bad transfer heals; a bad copy not)."""
BUFFER_BUDGET = 1 << 30
"""Bytes of range buffers in flight at once (workers x range size) in range reads."""


# -- sizes and parallelism, defined once ------------------------------------------------------


def range_size(tier: Tier, chunk_size: int) -> int:
    """Bytes per aligned range read on ``tier``: the multiple of ``chunk_size`` nearest to
    ``tier.read_range`` (at least one chunk), so that every range holds whole CRC32C pieces."""
    return max(1, round(tier.read_range / chunk_size)) * chunk_size


def workers(tier: Tier, task_bytes: int, budget: int = BUFFER_BUDGET) -> int:
    """Parallel reads on ``tier``: its ``read_concurrency``, capped so that ``workers x task_bytes``
    stays within ``budget`` bytes (at least 1)."""
    return max(1, min(tier.read_concurrency, budget // max(1, task_bytes)))


def writer_rank(file: str) -> str:
    """The writing rank encoded in a data file name (``rank-00003-ab12.data`` -> ``"3"``), or ``"?"``."""
    r = rank_of_file(file)
    return "?" if r is None else str(r)


# -- leases ------------------------------------------------------------------------------------


def hold(tiers: list[Tier], checkpoint_id: str, purpose: str) -> tuple[list[Tier], list[leases.Lease]]:
    """Lease ``checkpoint_id`` on every tier of ``tiers`` holding a committed copy.

    Returns the holding tiers (order kept; a tier that may hold encoded files as the checkpoint's
    :func:`~tierckpt.codec.view.decoding` view, which reads logical bytes) and the leases (release
    them when the read is done).
    A tier that cannot be reached is skipped with a warning. Raises :class:`CheckpointNotFound`
    (naming the tiers) when no tier holds a copy, :class:`CheckpointBeingDeleted` when a deletion
    under way (or a crashed one's tombstone) is why.
    """
    holding: list[Tier] = []
    held: list[leases.Lease] = []
    gone: list[CheckpointNotFound] = []
    for tier in tiers:
        try:
            if not tier.exists(metadata_key(checkpoint_id)):
                continue
            held.append(leases.acquire(tier, checkpoint_id, purpose=purpose))
            holding.append(decoding(tier, checkpoint_id))
        except CheckpointNotFound as e:  # deleted meanwhile, or a deletion under way
            gone.append(e)
            log.warning("%s", e)
        except TierckptError as e:
            log.warning("tier %s unreachable while reading %s: %s", tier.url, checkpoint_id, e)
    if not holding:
        why = f" ({'; '.join(map(str, gone))})" if gone else ""
        if any(isinstance(e, CheckpointBeingDeleted) for e in gone):
            # also a CorruptCheckpoint: a resume loop falls back to an older checkpoint
            raise CheckpointBeingDeleted("; ".join(map(str, gone)))
        raise CheckpointNotFound(
            f"checkpoint {checkpoint_id} is not committed on any tier reachable from here: "
            + ", ".join(t.url for t in tiers)
            + why
        )
    return holding, held


# -- range reads --------------------------------------------------------------------------------


def read_checked(
    tier: Tier, key: str, start: int, buf: memoryview, check: Callable[[int, memoryview], list[Any]], tries: int = TRIES
) -> tuple[list[Any], int]:
    """Read ``[start, start + len(buf))`` of ``key`` from ``tier`` into ``buf`` and check it.

    ``check(start, buf)`` returns what is wrong (empty: intact; items with a ``describe()``). A
    range that fails is read again, up to ``tries`` reads in all. Returns the last ``check``
    result (empty on success) and how many reads it took. Read errors propagate (the tier has
    already retried its transport).
    """
    bad: list[Any] = []
    for attempt in range(1, tries + 1):
        tier.read_into(key, start, buf)
        bad = check(start, buf)
        if not bad:
            return [], attempt
        if attempt < tries:
            log.warning(
                "%s/%s: %s; reading the range again",
                tier.url,
                key,
                bad[0].describe() if hasattr(bad[0], "describe") else bad[0],
            )
    return bad, tries


# -- item reads -----------------------------------------------------------------------------------


@dataclass
class Request:
    """Read item ``rec`` (its ``length`` bytes) into ``buf`` and verify it.

    ``what`` names the item in messages (``"item 'model.w' (offset [0, 0])"``); ``done``, if
    given, is called with the request on a worker thread once its bytes are verified.
    """

    rec: ItemRecord
    buf: memoryview
    what: str
    done: Callable[[Request], None] | None = None
    pad: bytearray = field(default_factory=bytearray)


@dataclass
class _Failure:
    tier: Tier
    kind: str  # "crc", "absent", "read"
    error: BaseException | None = None


class Readback:
    """Verified reads of one committed checkpoint's items over its holding tiers (module docstring).

    Args:
        checkpoint_id: the (resolved) checkpoint.
        tiers: the tiers holding a committed copy, fastest first (see :func:`hold`).
        chunk_size: the checkpoint's chunk size (from its manifest): the CRC piece grid.
        threads: parallel runs (default: see the module docstring).

    ``served`` maps each data file to the name of the tier that served it. Thread-safe ``read``.
    """

    def __init__(self, checkpoint_id: str, tiers: list[Tier], chunk_size: int, *, threads: int | None = None) -> None:
        if not tiers:
            raise CheckpointNotFound(f"checkpoint {checkpoint_id}: no tier to read it from")
        self.checkpoint_id = checkpoint_id
        self.tiers = list(tiers)
        self.chunk_size = chunk_size
        self.threads = threads
        self.served: dict[str, str] = {}  # data file -> the tier its (first) run was read from
        self.recovered: dict[str, str] = {}  # data file -> the tier that served an item its first tier failed
        self._order: dict[str, list[Tier]] = {}
        self._lock = threading.Lock()

    def tiers_for(self, file: str) -> list[Tier]:
        """The tiers to read ``file`` from, fastest first: those with ``cheap_listing`` only when
        they have it, the others always (an absence there costs no extra round trip)."""
        with self._lock:
            order = self._order.get(file)
        if order is None:
            key = data_key(self.checkpoint_id, file)
            order = []
            for t in self.tiers:
                try:
                    if not t.cheap_listing or t.exists(key):
                        order.append(t)
                except TierckptError as e:
                    log.warning(
                        "checkpoint %s: cannot tell whether %s holds %s: %s", self.checkpoint_id, t.url, file, e
                    )
            with self._lock:
                self._order[file] = order
        return order

    def read(self, requests: list[Request], threads: int | None = None) -> None:
        """Fill every request's ``buf`` with its verified bytes; raises as the module docstring says.

        Requests without bytes (and without padding) are done at once. On the first error the
        runs not started are dropped and the error propagates once the running ones finished.
        """
        todo: list[Request] = []
        for r in requests:
            if len(r.buf) != r.rec.length:
                raise ValueError(f"{r.what}: buffer of {len(r.buf)} bytes for an item of {r.rec.length}")
            if padded(r.rec.length):
                r.pad = bytearray(padded(r.rec.length) - r.rec.length)
                todo.append(r)
            elif r.done is not None:
                r.done(r)
        runs = plan_runs(todo)
        if not runs:
            return
        n = threads or self.threads
        if not n:
            first = {id(t): t for run in runs for t in self.tiers_for(run[0].rec.file)[:1]}
            n = max((workers(t, RUN_BYTES) for t in first.values()), default=1)
        n = max(1, min(n, len(runs)))
        if n == 1:
            for run in runs:
                self._read_run(run)
            return
        ex = ThreadPoolExecutor(max_workers=n, thread_name_prefix="tierckpt-read")
        futs: list[Any] = []
        try:
            futs = [ex.submit(self._read_run, run) for run in runs]
            wait(futs, return_when=FIRST_EXCEPTION)
            for f in futs:
                if f.done() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
        except BaseException:
            for f in futs:
                f.cancel()
            raise
        finally:
            ex.shutdown(wait=True, cancel_futures=True)

    # -- one merged read ----------------------------------------------------------------------
    def _read_run(self, run: list[Request]) -> None:
        file = run[0].rec.file
        key = data_key(self.checkpoint_id, file)
        order = self.tiers_for(file)
        failures: list[_Failure] = []
        bad = list(run)
        if order:
            tier = order[0]
            bufs: list[memoryview] = []
            at = run[0].rec.pos
            for r in run:
                if r.rec.pos > at:
                    bufs.append(memoryview(bytearray(r.rec.pos - at)))
                bufs.append(r.buf)
                if r.pad:
                    bufs.append(memoryview(r.pad))
                at = r.rec.pos + padded(r.rec.length)
            try:
                tier.read_ranges(key, run[0].rec.pos, bufs)
            except Exception as e:  # noqa: BLE001 - whatever a tier's copy raises, the next tier serves (_failed)
                absent = isinstance(e, CheckpointNotFound)
                (log.info if absent else log.error)(
                    "checkpoint %s: reading %s from %s failed: %s",
                    self.checkpoint_id,
                    file,
                    tier.name,
                    _describe(e),
                    exc_info=_unexpected(e),
                )
                failures.append(_Failure(tier, "absent" if absent else "read", e))
            else:
                bad = [r for r in run if not self._ok(r)]
                if bad:
                    failures.append(_Failure(tier, "crc"))
                with self._lock:
                    self.served[file] = tier.name
        for r in bad:
            self._recover(r, key, order, failures)
        for r in run:
            if r.done is not None:
                r.done(r)

    def _ok(self, r: Request) -> bool:
        return item_intact(r.rec, r.buf, memoryview(r.pad), self.chunk_size)

    def _recover(self, r: Request, key: str, order: list[Tier], failures: list[_Failure]) -> None:
        """Serve one item after the merged read of its run failed on ``failures[0].tier``."""
        first = failures[0] if failures else None
        tried = [] if first is None else [first]
        candidates = [t for t in order if first is None or t is not first.tier]
        if first is not None and first.kind == "read":
            candidates.append(first.tier)  # once more, alone: a truncated file serves what precedes the cut
        for tier in candidates:
            try:
                tier.read_ranges(key, r.rec.pos, [r.buf] + ([memoryview(r.pad)] if r.pad else []))
            except Exception as e:  # noqa: BLE001 - as in _read_run: this tier failed, the next may serve
                absent = isinstance(e, CheckpointNotFound)
                if not absent:
                    log.error(
                        "checkpoint %s: %s from %s also failed: %s",
                        self.checkpoint_id,
                        r.rec.file,
                        tier.name,
                        _describe(e),
                        exc_info=_unexpected(e),
                    )
                tried.append(_Failure(tier, "absent" if absent else "read", e))
                continue
            if self._ok(r):
                if first is not None and tier is not first.tier:
                    how = "failed its CRC32C check" if first.kind == "crc" else "could not be read"
                    log.warning(
                        "checkpoint %s: %s in %s %s on %s; served from %s",
                        self.checkpoint_id,
                        r.what,
                        r.rec.file,
                        how,
                        first.tier.name,
                        tier.name,
                    )
                with self._lock:
                    self.served.setdefault(r.rec.file, tier.name)
                    if first is not None and tier is not first.tier:
                        self.recovered[r.rec.file] = tier.name
                return
            tried.append(_Failure(tier, "crc"))
        odd = [f.error for f in tried if f.error is not None and _unexpected(f.error)]
        raise self._error(r, tried) from (odd[0] if odd else None)

    def _error(self, r: Request, tried: list[_Failure]) -> TierckptError:
        where = f"{r.what} in {r.rec.file} (written by rank {writer_rank(r.rec.file)})"
        cid = self.checkpoint_id
        urls = {id(f.tier): f.tier.url for f in tried}
        skipped = [t.url for t in self.tiers if id(t) not in urls]
        crc = [f.tier.url for f in tried if f.kind == "crc"]
        reads = [f for f in tried if f.kind == "read"]
        absent = [f.tier.url for f in tried if f.kind == "absent"] + skipped
        gone = [t.url for t in self.tiers if not _committed(t, cid)]
        if gone and not crc and absent:
            return CheckpointNotFound(
                f"checkpoint {cid} was deleted from {', '.join(gone)} while it was being read "
                f"(by a process that ignores leases?): cannot read {where}"
            )
        if crc:
            also = "".join(f"; {f.tier.url}: {_describe(f.error)}" for f in reads) + (
                f"; absent from {', '.join(absent)}" if absent else ""
            )
            return ChecksumMismatch(f"checkpoint {cid}: {where} failed its CRC32C check on {', '.join(crc)}{also}")
        if not reads:
            return CheckpointNotFound(
                f"checkpoint {cid}: data file {r.rec.file} is on no tier holding the checkpoint "
                f"({', '.join(absent)}): cannot read {where}"
            )
        return CorruptCheckpoint(
            f"checkpoint {cid}: cannot read {where}: "
            + "; ".join(f"{f.tier.url}: {_describe(f.error)}" for f in reads)
            + (f"; absent from {', '.join(absent)}" if absent else "")
        )


def _unexpected(e: BaseException) -> bool:
    """Whether a tier read raised something other than a tier's own errors (``TierckptError``,
    ``OSError``): a ``MemoryError`` or ``ValueError`` out of a copy's bytes or index that no
    check foresaw, or a bug. It still fails only that tier; it is logged with its traceback."""
    return not isinstance(e, (TierckptError, OSError))


def _describe(e: BaseException | None) -> str:
    """An error for messages: a tier's own errors name what failed; others get their type
    (``MemoryError()`` says nothing by itself)."""
    return f"{type(e).__name__}: {e}" if e is not None and _unexpected(e) else str(e)


def _committed(tier: Tier, cid: str) -> bool:
    try:
        return tier.exists(metadata_key(cid))
    except TierckptError:
        return True


def plan_runs(reqs: list[Request]) -> list[list[Request]]:
    """Requests grouped into merged reads: same file, offset order, gaps up to :data:`MAX_GAP`,
    at most :data:`RUN_BYTES` each (a larger item is a run of its own); largest runs first."""
    by_file: dict[str, list[Request]] = {}
    for r in reqs:
        by_file.setdefault(r.rec.file, []).append(r)
    runs: list[list[Request]] = []
    for items in by_file.values():
        items.sort(key=lambda r: r.rec.pos)
        cur: list[Request] = []
        for r in items:
            if cur:
                end = cur[-1].rec.pos + padded(cur[-1].rec.length)
                if (
                    r.rec.pos < end
                    or r.rec.pos - end > MAX_GAP
                    or r.rec.pos + r.rec.length - cur[0].rec.pos > RUN_BYTES
                ):
                    runs.append(cur)
                    cur = []
            cur.append(r)
        if cur:
            runs.append(cur)
    runs.sort(key=lambda run: -sum(r.rec.length for r in run))
    return runs
