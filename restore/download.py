"""Downloading a checkpoint's data files for ``tierckpt-restore fetch``: the per-file plan and the
ranged, resumable, verified download.

A :class:`FilePlan` is one data file to fetch: its resumable sink on the local tier, the ranges
already present and verified there (recorded in the sink's sidecar tag, re-checked against the
items' CRC32C pieces), and its sources in order (other nodes first, then shared tiers).
:func:`download` fetches the missing ranges of every plan in parallel (``[s3] concurrency``
readers over a pool of page-aligned buffers, :data:`WRITERS` threads writing them at their
offsets), each range checked before it is written and read from the next source on a mismatch.
Called by :func:`restore.fetch.fetch_checkpoint`, which decides what to fetch and commits the
local copy after.
"""

from __future__ import annotations

import errno
import logging
import mmap
import queue
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tierckpt.errors import CheckpointNotFound, ChecksumMismatch, TierckptError, TierError
from tierckpt.format.layout import data_key
from tierckpt.load.readback import TRIES, read_checked, workers
from tierckpt.tiers.base import ResumableSink, Tier

from .pieces import FileCheck
from .work import progress_bar, run_all

log = logging.getLogger("tierckpt.restore")

SIDECAR_FORMAT = "tierckpt-restore/fetch-ranges/1"  # the tag's format: a resumed file must come from the same save


class Counts(Protocol):
    """Where :func:`download` adds what it did (a :class:`restore.fetch.FetchResult`)."""

    bytes_downloaded: int
    ranges_retried: int


@dataclass
class Source:
    """One place a data file can be read from: another node's tier or a shared tier."""

    label: str  # "node NAME" or the tier's name ("s3")
    tier: Tier


class FilePlan:
    """One data file being fetched into ``local``: its resumable sink, the ranges still missing,
    the sources holding it (fastest first) and those that served it."""

    def __init__(
        self, local: Tier, cid: str, token: str, fc: FileCheck, range_size: int, sources: list[Source]
    ) -> None:
        self.local = local
        self.cid = cid
        self.fc = fc
        self.file = fc.file
        self.size = fc.size
        self.key = data_key(cid, fc.file)
        self.range_size = range_size
        self.tag = {"format": SIDECAR_FORMAT, "checkpoint_id": cid, "save_token": token, "file": fc.file}
        self.ranges = fc.ranges(range_size)
        self.sources = sources
        self.used: set[str] = set()
        self.sink: ResumableSink | None = None
        self.state = "fresh"  # "skipped", "resumed", "repaired", "fresh"
        self.reused = 0

    # -- preparation (main thread) ------------------------------------------------------
    def prepare(self) -> None:
        """Decide what is still missing, checking whatever the local tier holds already."""
        adopt = False
        if self.local.exists(self.key):
            got = self.local.size(self.key)
            if got == self.size:
                good = self._check(range(len(self.ranges)), lambda i, s, buf: self.local.read_into(self.key, s, buf))
                if len(good) == len(self.ranges):
                    self.state = "skipped"
                    self.reused = self.size
                    return
                log.warning(
                    "%s/%s: %d of %d ranges fail their checksums; downloading them again",
                    self.local.url,
                    self.key,
                    len(self.ranges) - len(good),
                    len(self.ranges),
                )
                adopt = True
                self.state = "repaired"
            else:
                log.warning(
                    "%s/%s has %d bytes, the manifest says %d; downloading it again",
                    self.local.url,
                    self.key,
                    got,
                    self.size,
                )
                self.local.delete(self.key)
        try:
            self.sink = self.local.open_resumable(self.key, self.size, block=self.range_size, tag=self.tag, adopt=adopt)
        except TierError as e:
            if e.errno == errno.EBUSY:
                raise TierckptError(
                    f"another fetch of {self.cid} into {self.local.url} is running ({e}); wait for it, or stop it"
                ) from None
            raise
        sink = self.sink
        if adopt:
            sink.keep(sink.recorded & good)
        elif sink.recorded:
            sink.keep(self._check(sorted(sink.recorded), lambda i, _s, buf: sink.read_block(i, buf)))
            if sink.recorded:
                self.state = "resumed"
        self.reused = sum(self.ranges[i][1] - self.ranges[i][0] for i in sink.recorded)
        if not self.missing():
            self.state = "skipped" if self.state == "fresh" else self.state

    def _check(self, indices: Iterable[int], read) -> set[int]:
        """The ranges among ``indices`` whose bytes (``read(i, start, buf)``) pass their CRC32C."""
        good: set[int] = set()
        for i in indices:
            s, e = self.ranges[i]
            buf = np.empty(e - s, dtype=np.uint8)
            try:
                read(i, s, memoryview(buf))
            except (TierckptError, OSError) as err:
                log.warning("%s/%s: cannot re-check bytes [%d, %d): %s", self.local.url, self.key, s, e, err)
                continue
            if not self.fc.check(s, buf):
                good.add(i)
        return good

    # -- downloading (worker threads) ---------------------------------------------------
    def missing(self) -> list[int]:
        done = self.sink.recorded if self.sink is not None else set(range(len(self.ranges)))
        return [i for i in range(len(self.ranges)) if i not in done]

    def source_label(self) -> str:
        if self.state == "skipped":
            return self.local.name
        labels = [s.label for s in self.sources if s.label in self.used]
        if self.reused and not labels:
            return self.local.name
        return "+".join(labels) or self.local.name

    # -- the end ------------------------------------------------------------------------
    def finish(self) -> None:
        """All ranges are in: the file becomes durable under its final name."""
        if self.sink is not None:
            self.sink.close()
            self.sink = None

    def close(self) -> None:
        """Interrupted: keep what landed for the next run."""
        if self.sink is not None:
            self.sink.suspend()
            self.sink = None


class _Buffers:
    """Page-aligned range buffers (anonymous maps), one per worker, reused: the local tier writes
    them with ``O_DIRECT`` and fresh memory is slow to touch."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._all: list[mmap.mmap] = []
        for _ in range(count):
            m = mmap.mmap(-1, max(size, 1))
            self._all.append(m)
            self._free.put(m)

    def take(self) -> mmap.mmap:
        return self._free.get()

    def give(self, m: mmap.mmap) -> None:
        self._free.put(m)

    def close(self) -> None:
        for m in self._all:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere: the map goes with it
                pass


WRITERS = 2
"""Threads writing fetched ranges to the local tier, apart from the readers: a range is read
(and checked) into one buffer while earlier ones are still being written, so a fetch takes about
the longer of downloading and writing, not their sum."""


def download(cid: str, plans: list[FilePlan], res: Counts, progress: bool) -> None:
    """Fetch every missing range of ``plans``: reader workers (the sources' parallelism) read and
    check ranges of all files at once into page-aligned buffers, :data:`WRITERS` threads write
    them (direct I/O where the local tier can). Returns once every range is written; the first
    error stops both, waits for the writes in flight, and propagates."""
    # Ranges of different files interleaved: every file's first range, then every second one...
    per_file = [[(p, i) for i in p.missing()] for p in plans]
    tasks = [t for row in _interleave(per_file) for t in row]
    if not tasks:
        return
    lock = threading.Lock()
    stop = threading.Event()
    total = sum(p.ranges[i][1] - p.ranges[i][0] for p, i in tasks)
    bar = progress_bar(total, f"fetch {cid}", progress)
    rsize = max(p.range_size for p in plans)
    tiers = {id(s.tier): s.tier for p in plans for s in p.sources}
    n = max(workers(t, rsize) for t in tiers.values()) if tiers else 1
    n = max(1, min(n, len(tasks)))
    bufs = _Buffers(min(len(tasks), n + 2 * WRITERS), rsize)
    writes = ThreadPoolExecutor(WRITERS, thread_name_prefix="tierckpt-fetch-write")
    pending: list[Future] = []
    errors: list[BaseException] = []

    def write(p: FilePlan, i: int, m: mmap.mmap, view: memoryview) -> None:
        try:
            if errors:  # a write failed: the local tier is in trouble. (After a read error or an
                return  # interruption the ranges already read and checked are still written: progress kept.)
            assert p.sink is not None
            p.sink.write_block(i, view)
            nbytes = len(view)
            with lock:
                res.bytes_downloaded += nbytes
            bar.update(nbytes)
        except BaseException as e:  # noqa: BLE001 - handed to the readers' loop and raised there
            with lock:
                errors.append(e)
            stop.set()
        finally:
            view.release()
            bufs.give(m)

    def one(task: tuple[FilePlan, int]) -> int:
        p, i = task
        if errors:
            raise errors[0]
        if stop.is_set():
            return 0
        s, e = p.ranges[i]
        m = bufs.take()
        view = memoryview(m)[: e - s]
        try:
            label, retried = _read_range(cid, p, s, view)
            with lock:
                res.ranges_retried += retried
                p.used.add(label)
            fut = writes.submit(write, p, i, m, view)
        except BaseException:
            view.release()
            bufs.give(m)
            raise
        with lock:
            pending.append(fut)
        return e - s

    try:
        run_all(one, tasks, n, None, stop)
    finally:
        writes.shutdown(wait=True)  # no write in flight once this returns (the sinks may be suspended)
        bar.close()
        bufs.close()
    if errors:
        raise errors[0]


def _interleave(rows: list[list]) -> list[list]:
    """Columns of ``rows`` (the i-th element of every row, for i = 0, 1, ...)."""
    width = max((len(r) for r in rows), default=0)
    return [[r[i] for r in rows if i < len(r)] for i in range(width)]


def _read_range(cid: str, p: FilePlan, start: int, view: memoryview) -> tuple[str, int]:
    """Read range ``[start, start + len(view))`` of ``p``'s file into ``view`` from the first source
    that gives intact bytes; return its label and the reads beyond the first."""
    retried = 0
    failures: list[str] = []
    bad_everywhere = True
    for src in p.sources:
        try:
            bad, reads = read_checked(src.tier, p.key, start, view, p.fc.check)
        except (TierckptError, OSError) as e:
            if src is p.sources[-1]:
                raise
            bad_everywhere = False
            failures.append(f"{src.label}: {e}")
            log.warning(
                "%s/%s [%d, %d): cannot read it from %s (%s); trying the next source",
                cid,
                p.file,
                start,
                start + len(view),
                src.label,
                e,
            )
            continue
        retried += reads - 1
        if not bad:
            return src.label, retried
        failures.append(f"{src.label}: {bad[0].describe()}")
        if src is not p.sources[-1]:
            log.warning(
                "%s/%s: %s from %s fails its CRC32C after %d reads; trying the next source",
                cid,
                p.file,
                bad[0].describe(),
                src.label,
                reads,
            )
    if not p.sources:
        raise CheckpointNotFound(f"checkpoint {cid}: data file {p.file} is on no readable node and on no shared tier")
    names = [s.label if s.tier.node_local else s.tier.name.upper() for s in p.sources]
    if not bad_everywhere:
        what = "no source gave intact bytes"
    elif len(names) == 1:
        what = f"the {names[0]} copy is corrupt"
    else:
        what = f"every source's copy is corrupt ({', '.join(names)})"
    raise ChecksumMismatch(f"checkpoint {cid}: {p.key}: " + "; ".join(failures) + f"; downloaded {TRIES} times: {what}")
