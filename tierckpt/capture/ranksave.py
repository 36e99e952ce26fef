"""This rank's part of one checkpoint: what the coordinator assigned it, its futures and its figures.

A :class:`RankSave` is built by ``TieredWriter.write_data`` on the thread running ``dcp.save``
and then owned by the engine's threads (:mod:`tierckpt.engine`): capture, flush, commit,
replication. Its futures settle in that order (``captured``, ``durable``, ``committed``,
``replicated``); a failure sets the exception on every future not yet done.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from ..catalog import lease as leases
from ..errors import CommitError, TornCaptureError
from ..format.layout import step_of
from ..format.metadata import CheckpointManifest, metadata_to_json, read_header
from ..telemetry.phases import PhaseLog
from ..tiers.base import DataSink
from .copier import Piece, Source
from .planning import SaveInputs
from .verify import CaptureCheck

__all__ = ["RankAssign", "SaveStats", "RankSave", "build_metadata"]


@dataclass
class RankAssign:
    """What the coordinator decided for one rank in ``prepare_global_plan``."""

    checkpoint_id: str
    token: str
    rank: int
    world: int
    file: str
    meta_writer_rank: int  # the rank that writes metadata.json on this rank's local root
    distributed: bool
    created: float
    step: int | None


@dataclass
class SaveStats:
    """Per-checkpoint, per-rank figures (seconds and bytes). ``None`` until the stage ran.

    ``save_blocked_s``: time inside tierckpt's own hooks of ``dcp.save`` (from
    ``set_up_storage_writer`` to ``write_data``/``finish``; DCP's planning around them is not
    included: time the call itself for the full stall). ``prestep_wait_s``: time the optimizer
    pre-step hook (or ``wait_captured``) waited for this capture. ``capture_s``/``flush_s``: from
    ``write_data`` until every chunk landed in host memory / the file was durable.
    ``commit_s``: from durable until committed. ``promote_s``: replication down the chain (every
    hop after the first tier: copy and commit), until committed on the last tier.

    CPU seconds (user+system, per thread: ``time.thread_time``) that tierckpt's own threads
    spent on this checkpoint: ``plan_cpu_s`` (cutting chunks and checksum pieces, capture
    thread), ``capture_cpu_s`` (opening the file, zeroing padding, issuing or doing the copies
    into the pool: on CPU the memcpy itself), ``crc_cpu_s`` (CRC32C, flush threads),
    ``write_cpu_s`` (waiting for copies to land, the writes, fsync and rename, flush threads),
    ``verify_cpu_s`` (``[job] verify_capture``/``nonfinite``: the source digests on the capture
    thread and the host digests and NaN/Inf scans on the flush threads, fused with the CRC32C
    pass, :mod:`tierckpt.capture.verify`; on CPU single-threaded numpy, all of it counted here; a
    GPU source's reductions are GPU time). ``cpu_s`` is their sum. Not included: DCP's planning on the training thread (within
    ``save_blocked_s``), the commit protocol and retention.

    ``phases``: the same stages with wall-clock start and end (:mod:`tierckpt.telemetry.phases`),
    for the timeline and the spans. :meth:`as_dict` flattens all of it for metric loggers.

    Encoded hops (:mod:`tierckpt.codec`): ``compress_cpu_s`` (coding frames, background
    threads; not in ``cpu_s``), ``stored_bytes`` (this rank's object on the encoding tier),
    ``uploaded_bytes`` (sent to it) and ``copied_bytes`` (copied by its server from the previous
    checkpoint: frames that did not change).
    """

    checkpoint_id: str
    rank: int
    bytes: int = 0
    items: int = 0
    chunks: int = 0
    save_blocked_s: float = 0.0
    prestep_wait_s: float = 0.0
    capture_s: float | None = None
    flush_s: float | None = None
    commit_s: float | None = None
    promote_s: float | None = None
    error: str | None = None
    plan_cpu_s: float = 0.0
    capture_cpu_s: float = 0.0
    crc_cpu_s: float = 0.0
    write_cpu_s: float = 0.0
    verify_cpu_s: float = 0.0
    compress_cpu_s: float = 0.0
    stored_bytes: int | None = None
    uploaded_bytes: int | None = None
    copied_bytes: int | None = None
    phases: PhaseLog = field(default_factory=PhaseLog, repr=False, compare=False)

    @property
    def cpu_s(self) -> float:
        """CPU seconds of tierckpt's threads for this checkpoint (plan + capture + CRC + write)."""
        return self.plan_cpu_s + self.capture_cpu_s + self.crc_cpu_s + self.write_cpu_s + self.verify_cpu_s

    def throughput(self, stage: str) -> float | None:
        """Bytes per second of a stage (``capture``, ``flush``, ``promote``)."""
        t = getattr(self, f"{stage}_s")
        return self.bytes / t if t else None

    def add_cpu(self, **secs: float) -> None:
        """Add CPU seconds to the ``*_cpu_s`` fields named (any thread)."""
        with _cpu_lock:
            for k, v in secs.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self, prefix: str = "tierckpt/") -> dict[str, float | int]:
        """The figures as one flat ``{name: number}`` dict that metric loggers take as they are
        (torchtitan's ``MetricsProcessor``, Lightning's ``log_dict``, TensorBoard, W&B). Key names
        are stable (documented in docs/telemetry.md); a stage's keys appear once it ran::

            bytes items chunks failed cpu_s plan_cpu_s capture_cpu_s crc_cpu_s write_cpu_s
            save_blocked_s prestep_wait_s blocked_s                     always
            step                                                        when the id has a step
            capture_s flush_s commit_s promote_s                        once that stage ran
            capture_bytes_per_s flush_bytes_per_s                       once that stage ran
            hop_<tier>_s                                                each hop that committed
            compress_cpu_s stored_bytes uploaded_bytes copied_bytes     an encoded hop ran (tierckpt.codec)
            verify_cpu_s                                                verify_capture/nonfinite ran

        each prefixed with ``prefix``. Integers stay ``int``, everything else is ``float``."""
        out: dict[str, float | int] = {
            "bytes": self.bytes,
            "items": self.items,
            "chunks": self.chunks,
            "failed": int(self.error is not None),
            "cpu_s": self.cpu_s,
            "save_blocked_s": self.save_blocked_s,
            "prestep_wait_s": self.prestep_wait_s,
            "blocked_s": self.save_blocked_s + self.prestep_wait_s,
        }
        for k in ("plan_cpu_s", "capture_cpu_s", "crc_cpu_s", "write_cpu_s"):
            out[k] = float(getattr(self, k))
        step = step_of(self.checkpoint_id)
        if step is not None:
            out["step"] = step
        for stage in ("capture", "flush", "commit", "promote"):
            t = getattr(self, f"{stage}_s")
            if t is not None:
                out[f"{stage}_s"] = float(t)
                if stage in ("capture", "flush") and t > 0:
                    out[f"{stage}_bytes_per_s"] = self.bytes / t
        if self.verify_cpu_s:
            out["verify_cpu_s"] = float(self.verify_cpu_s)
        if self.compress_cpu_s:
            out["compress_cpu_s"] = float(self.compress_cpu_s)
        for k in ("stored_bytes", "uploaded_bytes", "copied_bytes"):  # an encoded hop ran
            if getattr(self, k) is not None:
                out[k] = int(getattr(self, k))
        for p in self.phases.snapshot():
            if p.tier is not None and p.error is None:
                out[f"hop_{p.tier}_s"] = p.seconds
        return {prefix + k: v for k, v in out.items()}

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "phases"}
        return dict(d, cpu_s=self.cpu_s, phases=[p.to_json() for p in self.phases.snapshot()])


_cpu_lock = threading.Lock()


class RankSave:
    """This rank's part of one checkpoint, from ``write_data`` until it is committed everywhere.

    Built by ``TieredWriter.write_data`` on the thread running ``dcp.save`` from the save's
    :class:`~tierckpt.planning.SaveInputs` (cached layout plus this save's tensors). Until
    :meth:`plan` ran on the capture thread, ``sources`` holds only one source per CUDA device (for
    the ready events ``Engine.submit`` records on the training thread); :meth:`plan` replaces it
    with every item's source.
    """

    def __init__(self, assign: RankAssign, inputs: SaveInputs, chunk_size: int) -> None:
        self.assign = assign
        self.inputs: SaveInputs | None = inputs
        self.size = inputs.size
        self.chunk_size = chunk_size
        self.sources: list[Source] = inputs.ready_sources()
        self.hold: Any = None  # has wait(timeout): returns when the capture may start (see TieredWriter)
        self.hold_timeout = 2.0
        self.captured: Future[None] = Future()
        self.durable: Future[None] = Future()
        self.committed: Future[None] = Future()
        self.await_commit = False  # finish() waits for the first-tier commit ([job] async_future = "committed_local")
        self.replicated: Future[None] = Future()  # committed on every tier of the chain
        self.global_md: Future[tuple[Metadata, list[list[WriteResult]]]] = Future()
        self.owner: Any = None  # weakref to the TieredWriter that saved it (whose wait() gets its error)
        self.stats = SaveStats(assign.checkpoint_id, assign.rank, bytes=self.size, items=inputs.n_items)
        # Filled by plan(), on the capture thread, to keep the training thread's share small.
        self.crcs: list[list[int]] = []
        self.crc_pieces: list[list[tuple[int, int, int, int]]] = []
        self.chunks: list[list[Piece]] = []
        self.ready_events: dict = {}
        self.check: CaptureCheck | None = None  # verify_capture / nonfinite (set by plan when on)
        self.check_modes: tuple[str, str, int] = ("off", "ignore", 0)  # (verify_capture, nonfinite, save number)
        self.sink: DataSink | None = None
        self.lease: leases.Lease | None = None  # this save's lease on the first tier (until committed or failed)
        self.reported_ok = False  # this rank told the coordinator its file is good: it may commit from now on
        self.metadata_json: bytes | None = None
        self._lock = threading.Lock()
        self._hops_left: dict[str, threading.Event] = {}  # hop name -> set once the hop is done with it
        self._landed = 0
        self._flushed = 0
        self._failed: BaseException | None = None
        self.t_start = time.perf_counter()
        self.t_captured = 0.0
        self.t_durable = self.t_start

    def plan(self) -> None:
        """Capture thread, before the first copy: every item's source, the pieces of every chunk
        and the CRC pieces (from the layout's cached plan; only this save's serialized items and
        the sources are new). First waits for ``hold`` (at most ``hold_timeout`` seconds): the
        writer releases it once ``dcp.save`` no longer needs this process's CPU."""
        if self.hold is not None:
            self.hold.wait(self.hold_timeout)
        if self.inputs is None:  # failed before planning: nothing to capture
            return
        self.sources, self.chunks, self.crc_pieces, self.crcs = self.inputs.capture_plan()
        self.inputs = None  # the sources hold what is still needed
        verify, nonfinite, save_no = self.check_modes
        if verify != "off" or nonfinite != "ignore":
            check = CaptureCheck(
                self.id, self.assign.rank, self.sources, self.chunks, len(self.crcs), verify, nonfinite, save_no
            )
            self.check = check if check.active else None
        self.stats.chunks = len(self.chunks)

    def chunk_len(self, k: int) -> int:
        return min(self.chunk_size, self.size - k * self.chunk_size)

    @property
    def id(self) -> str:
        return self.assign.checkpoint_id

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def claim_failure(self, exc: BaseException) -> bool:
        """Record ``exc`` as this checkpoint's failure; False if another failure came first."""
        with self._lock:
            if self._failed is not None:
                return False
            self._failed = exc
        self.stats.error = str(exc)
        return True

    def settle_failure(self) -> None:
        """After :meth:`claim_failure`: fail every pending future and discard the partial file."""
        exc = self._failed
        assert exc is not None
        for f in (self.captured, self.durable, self.committed, self.replicated):
            if not f.done():
                f.set_exception(exc)
        if self.sink is not None:
            self.sink.abort()  # safe while flush workers still write: sinks refuse late writes
        self.sources = []
        self.inputs = None

    def hop_done(self, name: str) -> threading.Event:
        """The event the engine sets once the hop ``name`` is done with this checkpoint (copied
        and committed there, or failed: see :attr:`failed`); a preemption drain waits on it."""
        with self._lock:
            return self._hops_left.setdefault(name, threading.Event())

    def release_lease(self) -> None:
        if self.lease is not None:
            self.lease.release()

    @property
    def nonfinite(self) -> list[int | None] | None:
        """Per item, its NaN/Inf count (None: not scanned); None when nothing was scanned."""
        if self.check is None or self.check.mode == "ignore":
            return None
        return list(self.check.counts)

    @property
    def seq(self) -> int:
        """The commit sequence number (0 until the coordinator's outcome arrived)."""
        h = read_header(self.metadata_json) if self.metadata_json else None
        return h.seq if h is not None else 0

    def landed(self) -> bool:
        """Count one chunk as landed in host memory; True when it was the last one."""
        with self._lock:
            self._landed += 1
            return self._landed == len(self.chunks)

    def flushed(self) -> bool:
        with self._lock:
            self._flushed += 1
            return self._flushed == len(self.chunks)

    def check_versions(self) -> None:
        """The torn-capture guard: no tensor may have been modified in place before its copy landed."""
        for s in self.sources:
            if s.guard is not None and s.guard._version != s.version:
                raise TornCaptureError(
                    f"checkpoint {self.id}: rank {self.assign.rank}: tensor {s.fqn!r} was modified in place "
                    "while its copy to host memory was pending (call writer.attach(optimizer) or "
                    "writer.wait_captured() before the optimizer step); the checkpoint will not be committed"
                )


def build_metadata(
    md: Metadata, results: list[list[WriteResult]], reports: list[dict], job: RankSave, chunk_size: int, seq: int
) -> bytes:
    """Coordinator: merge DCP's metadata, every rank's write results and reported CRCs into JSON."""
    storage: dict = {}
    files: dict[str, int] = {}
    for r, (res, rep) in enumerate(zip(results, reports)):
        crcs = rep["crcs"]
        if len(crcs) != len(res):
            raise CommitError(f"checkpoint {job.id}: rank {r} reported {len(crcs)} checksums for {len(res)} items")
        counts = rep.get("nonfinite") or [None] * len(crcs)
        if len(counts) != len(res):
            raise CommitError(
                f"checkpoint {job.id}: rank {r} reported {len(counts)} NaN/Inf counts for {len(res)} items"
            )
        for wr, c, nf in zip(res, crcs, counts):
            rec = replace(wr.storage_data, crcs=list(c), nonfinite=nf)
            storage[wr.index] = rec
            files[rec.file] = rep["size"]
    md = replace(md, storage_data=storage)
    manifest = CheckpointManifest(
        checkpoint_id=job.id,
        world_size=job.assign.world,
        chunk_size=chunk_size,
        files=files,
        created=job.assign.created,
        committed=time.time(),
        step=job.assign.step,
        save_token=job.assign.token,
        seq=seq,
    )
    return metadata_to_json(md, manifest)
