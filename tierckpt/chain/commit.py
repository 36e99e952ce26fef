"""The one commit protocol: how a checkpoint becomes committed on a tier, for every rank.

Run for the first durable tier after the flush, and again for every hop down the chain
(:mod:`tierckpt.replicate`), by background threads; no collective on the training process group
is ever issued here. One run is a :class:`Round`, named by the save's token and the tier:

1. Every rank does its part (makes its data file durable on the tier, or copies it there) and
   publishes a *rank report* (``rank<r>``): ok with its file size, CRC32C pieces and the highest
   commit sequence number it has seen, or the error that stopped it.
2. The coordinator (rank 0) gathers every report (up to ``[job] commit_timeout``), builds the
   metadata (for the first tier it merges DCP's metadata with the reports; a later hop reuses the
   committed metadata) and publishes the *outcome* (``outcome``): ``M`` + metadata, ``O`` (ok, the
   metadata every rank already has), or ``E`` + the reason.
3. The *metadata writer* of each distinct root of the tier (the lowest rank using it: one per node
   for a node-local tier, rank 0 for a shared one) writes ``ID/metadata.json`` last, with
   create-if-absent, and publishes ``written<w>``; the other ranks wait for their writer's. That
   put is the commit: before it the checkpoint is never loaded, never ``latest``, never a reason
   to delete an older one.
4. Every rank, done or failed, calls :meth:`Round.finish`: it deletes its own report, and the
   last rank to finish (a store counter, ``fin``) deletes the outcome, the ``written`` keys and the
   counter, so that a long job leaves nothing in the store.

The channel is the process group's key-value store (``dist`` default store), polled with short
``check`` calls so the background thread never holds the store for long; in a single process it
is an in-memory dict. Keys and tags are defined here only.
"""

from __future__ import annotations

import abc
import datetime
import json
import logging
import threading
import time
from typing import Any

from ..errors import CommitConflict, CommitError, TierckptError
from .jobstore import JobStore

__all__ = [
    "GRACE",
    "Channel",
    "LocalChannel",
    "StoreChannel",
    "default_channel",
    "encode_report",
    "decode_report",
    "gather_reports",
    "grace",
    "Round",
    "run_commit",
]

log = logging.getLogger("tierckpt.commit")


def _never() -> bool:
    return False


GRACE = 30.0
"""The most seconds a rank waits for the coordinator's verdict beyond the commit timeout (the
coordinator waits the commit timeout from its own arrival, which may be later): see :func:`grace`."""


def grace(timeout: float) -> float:
    """How long past ``timeout`` a rank waits for the coordinator's check-in verdict or commit
    outcome: :data:`GRACE`, or the timeout itself when shorter (a job that allows its ranks 15 s to
    report allows its coordinator as much to arrive late; the default 600 s gets the full 30 s)."""
    return min(GRACE, timeout)


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

    @abc.abstractmethod
    def add(self, key: str, n: int) -> int:
        """Atomically add ``n`` to the counter ``key`` (created at 0); return the new value."""

    def wait_get(self, key: str, timeout: float, what: str, cancelled=lambda: False) -> bytes:
        """Poll until ``key`` is published; raise :class:`CommitError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            v = self.try_get(key)
            if v is not None:
                return v
            if cancelled():
                raise CommitError(f"{what}: cancelled")
            if time.monotonic() > deadline:
                raise CommitError(f"{what}: nothing arrived within {timeout:.0f} s (a rank died or hung?)")
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

    def add(self, key: str, n: int) -> int:
        with self._lock:
            v = int(self._d.get(key, b"0")) + n
            self._d[key] = str(v).encode()
            return v

    def keys(self) -> list[str]:
        """Every key held (tests check that a protocol leaves none behind)."""
        with self._lock:
            return list(self._d)


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
            self._store.set(f"{key}/#{i}", value[i * self.PART : (i + 1) * self.PART])
        self._store.set(key, self._PARTS + str(n).encode())

    def try_get(self, key: str) -> bytes | None:
        if not self._store.check([key]):
            return None
        v = bytes(self._store.get(key))
        if v.startswith(self._PARTS):
            v = b"".join(bytes(self._store.get(f"{key}/#{i}")) for i in range(int(v[len(self._PARTS) :])))
        return v

    def delete(self, key: str) -> None:
        try:
            v = bytes(self._store.get(key)) if self._store.check([key]) else b""
            if v.startswith(self._PARTS):
                for i in range(int(v[len(self._PARTS) :])):
                    self._store.delete_key(f"{key}/#{i}")
            self._store.delete_key(key)
        except Exception:  # noqa: BLE001 - some stores cannot delete; keys are small
            pass

    def add(self, key: str, n: int) -> int:
        return int(self._store.add(key, n))

    def wait_get(self, key: str, timeout: float, what: str, cancelled=_never) -> bytes:
        """Block in the store's own wait (woken when ``key`` is set, no polling: three store
        operations per wait), in slices of a second when ``cancelled`` is given, to check it."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.try_get(key)
            if v is not None:
                return v
            if cancelled():
                raise CommitError(f"{what}: cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommitError(f"{what}: nothing arrived within {timeout:.0f} s (a rank died or hung?)")
            t0 = time.monotonic()
            try:
                self._store.wait([key], datetime.timedelta(seconds=left if cancelled is _never else min(1.0, left)))
            except Exception:  # noqa: BLE001 - the slice ran out (DistStoreError); a dead store fails try_get
                pass
            if time.monotonic() - t0 < 0.01:  # set right away, or a store whose wait returns at once
                v = self.try_get(key)
                if v is not None:
                    return v
                time.sleep(0.05)  # do not spin


_local_channel = LocalChannel()


def default_channel(distributed: bool) -> Channel:
    """The default process group's store when distributed (through each calling thread's own
    client: :mod:`tierckpt.chain.jobstore`), else the process-local channel."""
    if distributed:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return StoreChannel(JobStore())
    return _local_channel


# -- rank reports and outcomes ---------------------------------------------------------------


def encode_report(
    ok: bool,
    *,
    size: int = 0,
    crcs: list[list[int]] | None = None,
    error: str = "",
    seq: int = 0,
    writer: int = 0,
    stored: dict | None = None,
    nonfinite: list[int | None] | None = None,
) -> bytes:
    """A rank report: ok or the error, the file size and CRC pieces, the highest commit sequence
    number the rank has seen (the coordinator numbers the checkpoint above all of them), the
    rank that writes the metadata on this rank's root, and (an encoding hop) the stored index of
    the rank's file (:mod:`tierckpt.codec.index`)."""
    rep = {"ok": ok, "size": size, "crcs": crcs or [], "error": error, "seq": seq, "writer": writer}
    if nonfinite is not None:  # per item: NaN/Inf count or None ([job] nonfinite)
        rep["nonfinite"] = nonfinite
    if stored:
        rep["stored"] = stored
    return json.dumps(rep).encode()


def decode_report(raw: bytes, who: str) -> dict:
    try:
        d = json.loads(raw)
        if not isinstance(d, dict) or "ok" not in d:
            raise ValueError("not a report")
        return d
    except ValueError as e:
        raise TierckptError(f"{who}: malformed report on the commit channel ({e})") from None


def gather_reports(
    channel: Channel, prefix: str, world: int, timeout: float, what: str, cancelled=lambda: False
) -> list[dict]:
    """Coordinator: wait for every rank's report under ``prefix`` (deleting each once read); raise on
    the first failure."""
    deadline = time.monotonic() + timeout
    reports: list[dict] = []
    for r in range(world):
        left = max(0.0, deadline - time.monotonic())
        try:
            raw = channel.wait_get(f"{prefix}/rank{r}", left, f"{what}: report of rank {r}", cancelled)
        except CommitError:
            if cancelled():
                raise
            missing = [q for q in range(r, world) if channel.try_get(f"{prefix}/rank{q}") is None]
            raise CommitError(
                f"{what}: no report from {name_ranks(missing)} within {timeout:.0f} s "
                "(dead or hung; every other rank reported)"
            ) from None
        channel.delete(f"{prefix}/rank{r}")
        rep = decode_report(raw, f"{what} rank {r}")
        if not rep["ok"]:
            raise CommitError(f"{what}: rank {r} failed: {rep['error']}")
        reports.append(rep)
    return reports


def name_ranks(ranks: list[int]) -> str:
    """``"rank 3"``, ``"ranks 3, 7"``, at most 20 named."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:20])) + (f" and {len(ranks) - 20} more" if len(ranks) > 20 else "")


# -- one run of the protocol -----------------------------------------------------------------


class Round:
    """The keys of one protocol run under ``tierckpt/<token>/<hop>`` and the steps on them.

    Created by every rank with the same ``token`` (the save's) and ``hop`` (the tier's name, or
    another name for a different exchange such as a backlog pass). ``what`` names the checkpoint
    and tier in messages.
    """

    def __init__(
        self, channel: Channel, token: str, hop: str, rank: int, world: int, timeout: float, what: str
    ) -> None:
        self.ch = channel
        self.prefix = f"tierckpt/{token}/{hop}"
        self.rank, self.world, self.timeout, self.what = rank, world, timeout, what
        self._mine: list[str] = []  # keys this rank published that only the coordinator reads
        self._shared: set[str] = set()  # keys every rank may read: deleted by the last to finish
        self._finished = False
        self._saw_outcome = False

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    # -- per-rank keys (read by the coordinator) ----------------------------------------------
    def put_mine(self, name: str, value: bytes) -> None:
        """Publish a per-rank value (``name`` includes the rank) that only the coordinator reads."""
        self.ch.publish(self.key(name), value)
        self._mine.append(self.key(name))

    def report(self, ok: bool, **fields) -> None:
        """Step 1: this rank's report."""
        self.put_mine(f"rank{self.rank}", encode_report(ok, **fields))

    def gather(self) -> list[dict]:
        """Step 2, coordinator: every rank's report, in rank order; raises on the first failure.
        Publishes the metadata writers named by the reports (for :meth:`finish`)."""
        reports = gather_reports(self.ch, self.prefix, self.world, self.timeout, self.what)
        self.put_shared("writers", json.dumps(sorted({int(r.get("writer", 0)) for r in reports})).encode())
        return reports

    def gather_values(self, name: str) -> list[bytes]:
        """Coordinator: the per-rank value ``name<r>`` of every rank, in rank order (each deleted once read)."""
        deadline = time.monotonic() + self.timeout
        out = []
        for r in range(self.world):
            left = max(0.0, deadline - time.monotonic())
            out.append(self.ch.wait_get(self.key(f"{name}{r}"), left, f"{self.what}: {name} of rank {r}"))
            self.ch.delete(self.key(f"{name}{r}"))
        return out

    # -- shared keys (read by every rank) ---------------------------------------------------
    def put_shared(self, name: str, value: bytes) -> None:
        self.ch.publish(self.key(name), value)
        self._shared.add(name)

    def get_shared(self, name: str, what: str) -> bytes:
        self._shared.add(name)
        return self.ch.wait_get(self.key(name), self.timeout + grace(self.timeout), f"{self.what}: {what}")

    def outcome_ok(self, metadata: bytes | None) -> None:
        """Step 2, coordinator: the outcome (``metadata``: the merged metadata, or None when every
        rank already holds it)."""
        self.put_shared("outcome", b"O" if metadata is None else b"M" + metadata)

    def outcome_error(self, reason: str) -> None:
        self.put_shared("outcome", b"E" + reason.encode(errors="replace"))

    def outcome(self) -> bytes | None:
        """Step 2, every rank: the metadata published by the coordinator (None for ``O``); raises
        :class:`CommitError` when it failed."""
        out = self.get_shared("outcome", "commit outcome from the coordinator (rank 0: dead or hung?)")
        self._saw_outcome = True
        if out[:1] == b"E":
            raise CommitError(f"{self.what} was not committed: {out[1:].decode(errors='replace')}")
        return out[1:] if out[:1] == b"M" else None

    def written(self, writer: int, error: str | None = None) -> None:
        """Step 3, a metadata writer: its metadata is written (or why not)."""
        self.put_shared(f"written{writer}", b"OK" if error is None else b"E" + error.encode(errors="replace"))

    def wait_written(self, writer: int) -> None:
        """Step 3, the other ranks: wait for their metadata writer; raise :class:`CommitError` if it failed."""
        ack = self.get_shared(f"written{writer}", f"metadata write by rank {writer}")
        if ack != b"OK":
            raise CommitError(
                f"{self.what}: rank {writer} could not write its metadata: {ack[1:].decode(errors='replace')}"
            )

    def finish(self) -> None:
        """Step 4, every rank, once, whatever happened: delete this rank's keys the coordinator will
        not read any more; the last rank to finish deletes the shared keys. Never raises."""
        if self._finished:
            return
        self._finished = True
        try:
            # A per-rank key not read by the coordinator yet stays (it deletes what it reads);
            # once there is an outcome it will read nothing more.
            if self._mine and (self._saw_outcome or self.ch.try_get(self.key("outcome")) is not None):
                for k in self._mine:
                    self.ch.delete(k)
            if self.ch.add(self.key("fin"), 1) >= self.world:
                raw = self.ch.try_get(self.key("writers"))
                writers = json.loads(raw) if raw else []
                for name in self._shared | {"outcome", "writers"} | {f"written{r}" for r in writers}:
                    self.ch.delete(self.key(name))
                self.ch.delete(self.key("fin"))
        except Exception as e:  # noqa: BLE001 - a store gone at shutdown: keys die with it
            log.debug("%s: cleaning the commit keys failed: %s", self.what, e)


def run_commit(
    rnd: Round,
    tier,
    key: str,
    *,
    work,
    writer: int,
    merge=None,
    metadata: bytes | None = None,
    on_reported=None,
    same_ok: bool = False,
    before_put=None,
) -> bytes:
    """Run the whole protocol on this rank and return the committed metadata JSON.

    ``work()`` is this rank's part (make its file durable and checked, or copy it); it returns the
    report's fields (size, crcs, seq) or raises. ``on_reported()`` runs right after an OK report
    (from then on the coordinator may commit the checkpoint). The coordinator builds the
    metadata with ``merge(reports)``, or uses ``metadata`` (a later hop). Rank ``writer`` writes
    it at ``key`` on ``tier`` with create-if-absent, after ``before_put()`` (if given) did not
    raise (the writer's last check that nothing was deleted under it: its lease never lapsed);
    ``same_ok``: an identical object already there counts as committed (a hop retried after a crash). Blocks for up to twice the commit
    timeout; raises :class:`CommitError` (or the tier's error) when the checkpoint was not
    committed. Every key is cleaned up (:meth:`Round.finish`).
    """
    try:
        try:
            fields = work()
        except BaseException as e:
            rnd.report(False, error=f"{type(e).__name__}: {e}", writer=writer)
            if rnd.rank == 0:
                rnd.outcome_error(f"rank 0 failed: {e}")
            raise
        rnd.report(True, writer=writer, **fields)
        if on_reported is not None:
            on_reported()
        if rnd.rank == 0:
            try:
                reports = rnd.gather()
                md = merge(reports) if merge is not None else None
                rnd.outcome_ok(md)
            except BaseException as e:
                rnd.outcome_error(str(e))
                raise
        got = rnd.outcome()
        md = got if got is not None else metadata
        if md is None:
            raise CommitError(f"{rnd.what}: no metadata to commit")
        if writer == rnd.rank:
            try:
                if before_put is not None:
                    before_put()
                try:
                    tier.put(key, md, if_absent=True)
                except CommitConflict:
                    if not same_ok or tier.get(key) != md:
                        raise  # another save's commit under this id: never overwritten
            except BaseException as e:
                rnd.written(writer, f"{type(e).__name__}: {e}")
                raise
            rnd.written(writer)
        else:
            rnd.wait_written(writer)
        return md
    finally:
        rnd.finish()
