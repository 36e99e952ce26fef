"""Filling the local tier while a load reads from a slower one (``[local] fill_on_load``).

After a node is lost or replaced its local tier is empty, and ``dcp.load`` reads the state from
S3 (or another shared tier) or receives it from other nodes (:mod:`tierckpt.peers`). The bytes
pass through this process anyway: :class:`LoadFill` writes them into the local tier as the items
arrive, so the next restart on this node (and the peer tier, which serves other nodes from local
copies) finds the checkpoint local, without a separate ``tierckpt-restore fetch`` that would
download it a second time.

Contract (driven by :class:`tierckpt.TieredReader` in ``read_data``, on the rank's calling
thread; nothing here is collective):

* :meth:`LoadFill.plan` picks the data files this rank reads *whole* (the items it reads and
  those other nodes send it cover the file from byte 0 to its end, padding included) from
  somewhere other than the local tier; in a distributed job only the files this rank wrote
  (``rank-0000R-…``) are picked, so that two ranks of a node never write one file. Nothing is
  picked when the local tier holds another save under the same id, when it has less free space
  than twice the bytes to write, or when another process is writing the same file (``.partial``
  created exclusively).
* Each verified item (:class:`~tierckpt.readback.Request` ``done`` on a reader thread, or
  :meth:`LoadFill.received` for an item another node sent) is handed to :data:`THREADS` writer
  threads that write it, and its padding, at its offset into the file's ``.partial``. Where the
  local tier writes with ``O_DIRECT`` (``[local] direct_io``), a thread copies the item piece by
  piece into its own page-aligned staging buffer (:data:`STAGE_BYTES`, reused) at the file
  offset's alignment, so that whole pages go to the device without the page cache and only the
  edges of an item are buffered; otherwise its writes are buffered. The load waits for those
  writes (so they never read the destination tensors after ``read_data`` returns).
* :meth:`LoadFill.finish` then commits in a background thread (not a daemon: the interpreter
  waits for it at exit): each complete file is fsync'd and renamed into place, then
  ``ID/metadata.json`` is written last (unless already there), byte-identical to the source's
  copy (same ``committed`` time), exactly as ``tierckpt-restore fetch --rank`` leaves a partial
  local copy: the reader reads what is local from the local tier and the rest from elsewhere.
* A fill never fails a load: any error (disk full, a write refused, a commit raced) is logged
  as a warning and that file's ``.partial`` removed. A crash leaves at most a ``.partial``, which
  ``tierckpt-restore gc`` removes. A lease on the local tier keeps retention and gc away meanwhile.
"""

from __future__ import annotations

import errno
import logging
import mmap
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..catalog import lease as leases
from ..codec import strip_stored
from ..errors import CheckpointNotFound, CommitConflict, CorruptCheckpoint, TierckptError
from ..format.layout import MAX_METADATA_BYTES, data_key, metadata_key, padded, rank_of_file
from ..format.metadata import ItemRecord, parse_metadata
from ..tiers.base import DataSink, Tier
from ..tiers.localfs import DIO_ALIGN
from .readback import Request

__all__ = ["THREADS", "LoadFill"]

log = logging.getLogger("tierckpt")

THREADS = 2
"""Writer threads of one fill (each with its own staging buffer)."""
STAGE_BYTES = 8 << 20
"""Bytes per staged write: a thread's page-aligned staging buffer, reused for every item it writes."""


class _File:
    def __init__(self, name: str, size: int, sink: DataSink, items: int) -> None:
        self.name = name
        self.size = size
        self.sink = sink
        self.left = items  # items not yet written
        self.failed: BaseException | None = None


class LoadFill:
    """One load's fill of the local tier (see the module docstring). Build it with :meth:`plan`."""

    def __init__(self, local: Tier, cid: str, raw_metadata: bytes, lease: leases.Lease) -> None:
        self.local = local
        self.cid = cid
        self._raw = raw_metadata
        self._lease = lease
        self._files: dict[str, _File] = {}
        self._lock = threading.Lock()
        self._stage = threading.local()
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="tierckpt-fill")
        self._pending: list[Future] = []
        self._t0 = time.perf_counter()
        self.thread: threading.Thread | None = None
        self.committed: list[str] = []  # files in place once :attr:`thread` has finished
        self._result: tuple[float, float, int, str | None] | None = None  # see when_done
        self._callbacks: list[Callable[[float, float, int, str | None], None]] = []

    # -- choosing the files (calling thread) --------------------------------------------------
    @classmethod
    def plan(
        cls,
        local: Tier,
        cid: str,
        requests: list[Request],
        received: list[ItemRecord],
        files: dict[str, int],
        token: str,
        rank: int | None,
        lacks: Callable[[str], bool],
        shared: list[Tier],
        raw: bytes | None = None,
    ) -> LoadFill | None:
        """A fill for the files worth filling (module docstring), or None.

        ``requests`` are the items read from the tiers (their ``done`` callbacks are wrapped),
        ``received`` those other nodes send (hand each to :meth:`received` once verified);
        ``files`` maps data files to their sizes (the manifest), ``token`` is the checkpoint's save
        token, ``rank`` this process's rank in a distributed job (None: alone); ``lacks(file)``
        tells whether this read takes ``file`` from somewhere else than ``local``; the metadata
        committed locally is ``raw`` (as other nodes sent it) or the first ``shared`` tier's copy.
        Call :meth:`finish` after the reads.
        """
        by_file: dict[str, list[ItemRecord]] = {}
        for rec in [r.rec for r in requests] + list(received):
            by_file.setdefault(rec.file, []).append(rec)
        picked = [
            f
            for f, recs in by_file.items()
            if (rank is None or rank_of_file(f) == rank) and f in files and _covers(recs, files[f]) and lacks(f)
        ]
        if not picked:
            return None
        need = sum(files[f] for f in picked)
        free = local.free_bytes()
        if free is not None and free < 2 * need:
            log.info(
                "checkpoint %s: not filling %s during the load: %d bytes free, %d to write", cid, local.url, free, need
            )
            return None
        try:
            meta = _metadata_to_commit(local, cid, token, shared, raw)
            if meta is None:
                return None
            lease = leases.acquire(local, cid, kind="fetch", purpose="fill during a load", require_committed=False)
        except (TierckptError, OSError) as e:
            log.warning("checkpoint %s: not filling %s during the load: %s", cid, local.url, e)
            return None
        fill = cls(local, cid, meta, lease)
        for file in picked:
            try:
                sink = local.open_sink(data_key(cid, file), files[file], exclusive=True)  # type: ignore[call-arg]
            except (TierckptError, OSError) as e:
                busy = getattr(e, "errno", None) == errno.EEXIST
                (log.info if busy else log.warning)(
                    "checkpoint %s: not filling %s/%s: %s",
                    cid,
                    local.url,
                    data_key(cid, file),
                    "another process is writing it" if busy else e,
                )
                continue
            fill._files[file] = _File(file, files[file], sink, len(by_file[file]))
        for r in requests:
            f = fill._files.get(r.rec.file)
            if f is not None:
                r.done = fill._wrap(f, r.done)
        if not fill._files:
            fill._lease.release()
            fill._pool.shutdown()
            return None
        return fill

    def received(self, rec: ItemRecord, buf: memoryview) -> None:
        """An item another node sent, verified (its padding is zeros, as every writer leaves it)."""
        f = self._files.get(rec.file)
        if f is not None:
            self._submit(f, rec.pos, buf, bytes(padded(rec.length) - rec.length))

    def _submit(self, f: _File, pos: int, buf: memoryview, pad: bytes) -> None:
        fut = self._pool.submit(self._write, f, pos, buf, pad)
        with self._lock:
            self._pending.append(fut)

    def _wrap(self, f: _File, done):  # noqa: ANN001, ANN202 - the Request.done callable
        def wrapped(r: Request) -> None:
            self._submit(f, r.rec.pos, r.buf, bytes(r.pad))  # before done() may release the buffer
            if done is not None:
                done(r)

        return wrapped

    # -- writing (fill threads) ---------------------------------------------------------------
    def _write(self, f: _File, pos: int, buf: memoryview, pad: bytes) -> None:
        if f.failed is not None:
            return
        try:
            if getattr(f.sink, "direct", False) and len(buf) + len(pad) >= 2 * DIO_ALIGN:
                self._write_staged(f, pos, buf, pad)
            else:
                f.sink.write_at(pos, buf)
                if pad:
                    f.sink.write_at(pos + len(buf), memoryview(pad))
        except BaseException as e:  # noqa: BLE001 - a fill never fails the load
            f.failed = e
            return
        with self._lock:
            f.left -= 1

    def _write_staged(self, f: _File, pos: int, buf: memoryview, pad: bytes) -> None:
        """Copy into this thread's page-aligned staging buffer at the file offset's alignment, so
        that the sink writes the whole pages with ``O_DIRECT`` (no page cache), the edges buffered."""
        stage = getattr(self._stage, "mv", None)
        if stage is None:
            stage = self._stage.mv = memoryview(mmap.mmap(-1, STAGE_BYTES))
        src = np.frombuffer(buf, dtype=np.uint8) if len(buf) else np.zeros(0, np.uint8)
        dst = np.frombuffer(stage, dtype=np.uint8)
        end = len(src) + len(pad)
        done = 0
        while done < end:
            at = (pos + done) % DIO_ALIGN
            n = min(STAGE_BYTES - at, end - done)  # every piece after the first starts on a page
            k = max(0, min(n, len(src) - done))
            np.copyto(dst[at : at + k], src[done : done + k])  # numpy copies without the GIL
            if k < n:
                stage[at + k : at + n] = pad[done + k - len(src) : done + n - len(src)]
            f.sink.write_at(pos + done, stage[at : at + n])
            done += n

    # -- the end ------------------------------------------------------------------------------
    def finish(self, ok: bool) -> None:
        """Calling thread, after the reads (``ok``: all of them succeeded). Waits for the writes in
        flight, then commits the complete files (fsync, rename) and the metadata in :attr:`thread`."""
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            fut.exception()
        self._pool.shutdown(wait=True)
        done = [f for f in self._files.values() if ok and f.failed is None and f.left == 0]
        for f in self._files.values():
            if f not in done:
                f.sink.abort()
                if f.failed is not None:
                    log.warning(
                        "checkpoint %s: filling %s/%s failed: %s",
                        self.cid,
                        self.local.url,
                        data_key(self.cid, f.name),
                        f.failed,
                    )
        if not done:
            self._lease.release()
            self._settle(0, "nothing filled")
            return
        self.thread = threading.Thread(target=self._commit, args=(done,), name="tierckpt-fill-commit", daemon=False)
        self.thread.start()

    def _commit(self, files: list[_File]) -> None:
        error: str | None = None
        try:
            for f in files:
                try:
                    f.sink.close()  # fsync, rename
                    self.committed.append(f.name)
                except (TierckptError, OSError) as e:
                    log.warning(
                        "checkpoint %s: cannot commit %s/%s: %s",
                        self.cid,
                        self.local.url,
                        data_key(self.cid, f.name),
                        e,
                    )
            if self.committed:
                self._put_metadata()
                log.info(
                    "checkpoint %s: filled %d file(s) (%d bytes) into %s during the load in %.2f s",
                    self.cid,
                    len(self.committed),
                    sum(f.size for f in files if f.name in self.committed),
                    self.local.url,
                    time.perf_counter() - self._t0,
                )
        except BaseException as e:  # noqa: BLE001 - a fill never fails the load; logged
            log.warning("checkpoint %s: filling %s failed: %s", self.cid, self.local.url, e)
            error = str(e)
        finally:
            self._lease.release()
            self._settle(sum(f.size for f in files if f.name in self.committed), error)

    def when_done(self, callback: Callable[[float, float, int, str | None], None]) -> None:
        """Call ``callback(t0, t1, bytes, error)`` once the fill is over (``time.perf_counter``
        readings from the start of the fill to the end of its commit, the bytes committed, None or
        why it failed): now if it is over, else on the commit thread (telemetry's fill span)."""
        with self._lock:
            if self._result is None:
                self._callbacks.append(callback)
                return
            result = self._result
        callback(*result)

    def _settle(self, nbytes: int, error: str | None) -> None:
        with self._lock:
            self._result = (self._t0, time.perf_counter(), nbytes, error)
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(*self._result)
            except Exception as e:  # noqa: BLE001 - telemetry never fails a fill
                log.debug("fill callback failed: %s", e)

    def _put_metadata(self) -> None:
        key = metadata_key(self.cid)
        try:
            self.local.put(key, self._raw, if_absent=True)
        except CommitConflict:
            try:
                same = self.local.get(key) == self._raw
            except TierckptError:
                same = False
            if not same:  # another save's files stay orphans of no checkpoint: gc removes them
                log.warning(
                    "checkpoint %s: %s committed another copy meanwhile; the filled files are left to gc",
                    self.cid,
                    self.local.url,
                )

    def wait(self, timeout: float | None = None) -> None:
        """Block until the commit thread is done (tests, and callers that want the copy now)."""
        if self.thread is not None:
            self.thread.join(timeout)


def _covers(recs: list[ItemRecord], size: int) -> bool:
    """Whether ``recs`` (items of one file) cover ``[0, size)`` exactly, padding included."""
    at = 0
    for rec in sorted((r for r in recs if r.length), key=lambda r: r.pos):  # empty items hold no bytes
        if rec.pos != at:
            return False
        at += padded(rec.length)
    return at == size


def _metadata_to_commit(local: Tier, cid: str, token: str, shared: list[Tier], raw: bytes | None) -> bytes | None:
    """The metadata bytes to commit locally: the local copy's (same save), ``raw`` (other nodes'),
    or the first shared tier's; None when the local tier holds another save of ``cid``."""
    key = metadata_key(cid)
    try:
        mine_raw = local.get(key)
        mine = parse_metadata(mine_raw, f"{local.url}/{key}").manifest
    except CheckpointNotFound:
        mine = None
    except CorruptCheckpoint as e:
        log.warning("checkpoint %s: not filling %s during the load: %s", cid, local.url, e)
        return None
    if mine is not None:
        if mine.save_token != token:
            log.info("checkpoint %s: not filling %s: it holds another save under this id", cid, local.url)
            return None
        return mine_raw
    if raw is not None and parse_metadata(raw, f"metadata of {cid} from another node").manifest.save_token == token:
        return strip_stored(raw)  # the local copy holds plain files: no stored index
    errors = []
    for tier in shared:
        try:
            if tier.size(key) > MAX_METADATA_BYTES:
                raise CorruptCheckpoint(f"{tier.url}/{key}: larger than {MAX_METADATA_BYTES} bytes")
            got = tier.get(key)
            if parse_metadata(got, f"{tier.url}/{key}").manifest.save_token != token:
                raise CorruptCheckpoint(f"{tier.url}/{key}: another save of {cid}")
            return strip_stored(got)
        except (TierckptError, OSError) as e:
            errors.append(f"{tier.url}: {e}")
    raise CheckpointNotFound(f"checkpoint {cid}: no metadata to copy ({'; '.join(errors) or 'no shared tier'})")
