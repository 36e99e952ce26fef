"""The persisted phase history: what each rank's checkpoints cost, kept next to them.

**Where.** Each process keeps one file per global rank, ``_history/g<global rank>.json``, on the
first tier when listing it is cheap (a local disk; with a node-local ``[local] path`` each node
holds its own ranks' files). ``_`` + a name that is no shard: never listed as a checkpoint, never
touched by retention or gc. A job whose first tier is an object store keeps no history. The
commit protocol is unchanged: the record is kept when a checkpoint settles (committed on every
tier, or failed), in memory, on the engine thread that settled it; the file is written by the
telemetry thread (:mod:`tierckpt.telemetry.worker`), never on a checkpoint's path.

**What.** The newest ``[job] history`` records (default 64, so the file stays under ~100 KB),
one per checkpoint, oldest first::

    {"format": "tierckpt-history/1", "global_rank": 0, "node": "n0",
     "records": [{"id": "step-20", "token": "3f2a…", "step": 20, "rank": 0, "world": 2,
                  "bytes": 123, "error": null, "stats": {SaveStats.as_dict() without prefix},
                  "phases": [{"name": "capture", "start": 1718000000.12, "end": …, "blocked": true?}, …]}]}

Times are wall-clock seconds (``time.time``) of the writing process. A record is kept twice:
when the checkpoint is committed on the first tier (``"settled": false``, the phases so far) and
when it settles (the same token: it replaces the first). Each time the telemetry thread replaces
the file atomically (a temp file renamed, no fsync) as soon as it gets to it, so a SIGKILL loses
at most the records of checkpoints not committed yet (and of one a telemetry thread stuck in an
OpenTelemetry exporter holds back; those are written at ``close``). ``"process"`` (pid and start
time, :data:`PROCESS`) tells a restarted job's records from its predecessor's
(:meth:`CheckpointRun.restarted_after`).
A process appends to the records found in the file when it first writes (a restarted job
continues its history). Writing never fails a checkpoint: an error is logged once per process.

**Reading** (:func:`read_history`): every ``_history/g*.json`` of the given tiers, decoded with
:func:`tierckpt.safejson.loads` and checked field by field (a damaged file is skipped with a
warning naming it); :func:`group_checkpoints` joins the ranks' records of one save.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointNotFound, TierckptError
from ..format.safejson import JSONRejected, loads
from ..tiers.base import Tier
from .phases import BLOCKED, Phase

__all__ = [
    "FORMAT",
    "HISTORY_DIR",
    "MAX_FILE_BYTES",
    "WRITE_INTERVAL",
    "CheckpointRun",
    "HistoryLog",
    "RankRecord",
    "group_checkpoints",
    "history_key",
    "job_history",
    "read_history",
]

log = logging.getLogger("tierckpt")

HISTORY_DIR = "_history"
FORMAT = "tierckpt-history/1"
MAX_FILE_BYTES = 16 << 20
"""A history file larger than this is not read (1024 records of a few KB each fit)."""
WRITE_INTERVAL = 0.0
"""Seconds between two writes of one history file at least (see :class:`HistoryLog`): 0, every
record is written as soon as the telemetry thread gets to it (records appended while a write is
asked for and not run yet go with that write)."""
PROCESS = f"{os.getpid()}@{time.time():.3f}"
"""This process's identity in its records (pid and the time tierckpt was imported): a record with
another one was written by another process, so a change between two checkpoints is a restart."""


def history_key(global_rank: int) -> str:
    return f"{HISTORY_DIR}/g{global_rank:05d}.json"


@dataclass
class RankRecord:
    """One rank's part of one checkpoint, as the history keeps it."""

    checkpoint_id: str
    token: str
    step: int | None
    rank: int
    world: int
    global_rank: int
    node: str
    bytes: int
    error: str | None
    stats: dict[str, float]
    phases: list[Phase]
    process: str | None = None  # who wrote it (:data:`PROCESS`); None in files written before it was kept
    settled: bool = True  # False: recorded at its first-tier commit, before its copies to later tiers ended

    @property
    def start(self) -> float:
        return min((p.start for p in self.phases), default=0.0)

    @property
    def end(self) -> float:
        return max((p.end for p in self.phases), default=0.0)

    def seconds(self, name: str) -> float:
        return sum(p.seconds for p in self.phases if p.name == name)

    def to_json(self) -> dict:
        return {
            "id": self.checkpoint_id,
            "token": self.token,
            "step": self.step,
            "rank": self.rank,
            "world": self.world,
            "bytes": self.bytes,
            "error": self.error,
            "stats": self.stats,
            "phases": [p.to_json() for p in self.phases],
            "process": self.process,
            "settled": self.settled,
        }


@dataclass
class CheckpointRun:
    """Every rank's record of one save (one id and save token), ordered by rank."""

    checkpoint_id: str
    token: str
    step: int | None
    ranks: list[RankRecord] = field(default_factory=list)

    @property
    def start(self) -> float:
        return min(r.start for r in self.ranks)

    @property
    def end(self) -> float:
        return max(r.end for r in self.ranks)

    @property
    def failed(self) -> bool:
        """Not committed: a rank's record holds an error that no failed copy to a later tier
        explains (a checkpoint committed on its first tier whose copy to S3 failed is not failed:
        it is pending there, see :attr:`copies_failed`)."""
        return any(r.error and not any(p.tier and p.error for p in r.phases) for r in self.ranks)

    @property
    def copies_failed(self) -> list[str]:
        """The later tiers whose copy of this checkpoint failed on some rank (committed on the first
        tier, pending on those: pushed by the next job or ``tierckpt-restore push``)."""
        return sorted({p.tier for r in self.ranks for p in r.phases if p.tier and p.error})

    @property
    def processes(self) -> frozenset[str]:
        """The processes that wrote its records (empty for records without one)."""
        return frozenset(r.process for r in self.ranks if r.process)

    def restarted_after(self, before: CheckpointRun) -> bool:
        """Whether the job was restarted between ``before`` and this save: no process wrote both."""
        a, b = before.processes, self.processes
        return bool(a and b and not (a & b))


class HistoryLog:
    """One process's history file on one tier (see the module docstring). Thread-safe.

    :meth:`append` (the engine thread settling a save) only encodes the record and keeps it in
    memory: no I/O, no lock held across I/O, so a slow disk never holds up a commit. It says when
    the file is due to be written (not written for :data:`WRITE_INTERVAL` seconds, and no write
    asked for yet); the caller then asks the telemetry thread for :meth:`write`
    (:mod:`tierckpt.telemetry.worker`), or calls :meth:`cancel` when it could not. The first write
    reads the records already in the file (a restarted job continues its history). Records
    appended sooner after a write are written with the next write, or by :meth:`flush` (the
    engine's ``close``, at exit), so a job saving every few hundred milliseconds does not pay a
    file write per save."""

    def __init__(self, tier: Tier, global_rank: int, node: str, keep: int) -> None:
        self.tier = tier
        self.global_rank = global_rank
        self.node = node
        self.keep = keep
        self._records: list[tuple[str, bytes]] | None = None  # (token, encoded); read from the file on the first write
        self._new: list[tuple[str, bytes]] = []  # appended since the last write
        self._lock = threading.Lock()  # _new, _asked, _last_write: held for list operations only
        self._io = threading.Lock()  # _records and the file: held by the one writing it
        self._warned = False
        self._asked = False  # a write was asked for and has not run yet
        self._last_write = -WRITE_INTERVAL

    def append(self, record: dict) -> bool:
        """Keep one checkpoint's record (in memory); a record with the id and token of one kept before
        replaces it (the settled record replaces the one kept at the first-tier commit). Returns
        True when the caller should have :meth:`write` run (off its thread), or call :meth:`cancel`."""
        enc = _encode(record)
        with self._lock:
            self._new.append((f"{record.get('id')}/{record.get('token')}", enc))
            del self._new[: -self.keep]
            if self._asked or time.monotonic() - self._last_write < WRITE_INTERVAL:
                return False
            self._asked = True
            return True

    def cancel(self) -> None:
        """The write :meth:`append` asked for will not run (the telemetry queue was full): the
        next append asks again."""
        with self._lock:
            self._asked = False

    def write(self) -> None:
        """Write the file with every record kept (the telemetry thread; at close, :meth:`flush`)."""
        with self._io:
            with self._lock:
                self._asked = False
                self._last_write = time.monotonic()
                new, self._new = self._new, []
            if self._records is None:
                self._records = [(f"{r.checkpoint_id}/{r.token}", _encode(r.to_json())) for r in self._read_own()]
            if not new:
                return
            self._records = _merge(self._records + new)
            del self._records[: -self.keep]
            head = _encode({"format": FORMAT, "global_rank": self.global_rank, "node": self.node})
            body = head[:-1] + b',"records":[' + b",".join(enc for _, enc in self._records) + b"]}"
            try:
                self.tier.put_volatile(history_key(self.global_rank), body)
            except (TierckptError, OSError) as e:
                self._failed(e)

    def flush(self) -> None:
        """Write the records not written yet (if any)."""
        with self._lock:
            pending = bool(self._new)
        if pending:
            self.write()

    def _failed(self, e: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "cannot write the checkpoint history %s/%s (the timeline and advise will miss "
                "checkpoints; saves are not affected): %s",
                self.tier.url,
                history_key(self.global_rank),
                e,
            )

    def _read_own(self) -> list[RankRecord]:
        try:
            return _read_file(self.tier, history_key(self.global_rank))
        except CheckpointNotFound:
            return []
        except (TierckptError, OSError, ValueError) as e:
            log.warning(
                "%s/%s is unreadable; starting a new history: %s", self.tier.url, history_key(self.global_rank), e
            )
            return []


def _merge(records: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """One record per save (id and token), at its first place, with its last content."""
    last = dict(records)
    out: list[tuple[str, bytes]] = []
    for token, _ in records:
        if token in last:
            out.append((token, last.pop(token)))
    return out


def _encode(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def read_history(tiers: Iterable[Tier]) -> list[RankRecord]:
    """Every record of every ``_history/g*.json`` on ``tiers`` (damaged files skipped with a warning),
    without duplicates (a file seen through two tiers counts once)."""
    out: dict[tuple, RankRecord] = {}
    for tier in tiers:
        try:
            keys = sorted(o.key for o in tier.list(f"{HISTORY_DIR}/") if o.key.endswith(".json"))
        except (TierckptError, OSError) as e:
            log.warning("cannot list %s/%s: %s", tier.url, HISTORY_DIR, e)
            continue
        for key in keys:
            try:
                recs = _read_file(tier, key)
            except (TierckptError, OSError, ValueError) as e:
                log.warning("skipping %s/%s: %s", tier.url, key, e)
                continue
            for r in recs:
                out.setdefault((r.checkpoint_id, r.token, r.global_rank, r.rank), r)
    return list(out.values())


def group_checkpoints(records: Iterable[RankRecord]) -> list[CheckpointRun]:
    """The records joined per save (id and token), oldest first."""
    runs: dict[tuple[str, str], CheckpointRun] = {}
    for r in records:
        run = runs.setdefault((r.checkpoint_id, r.token), CheckpointRun(r.checkpoint_id, r.token, r.step))
        run.ranks.append(r)
    for run in runs.values():
        run.ranks.sort(key=lambda r: (r.rank, r.global_rank))
    return sorted((r for r in runs.values() if any(x.phases for x in r.ranks)), key=lambda r: r.start)


# -- decoding (untrusted bytes) ----------------------------------------------------------------


def _read_file(tier: Tier, key: str) -> list[RankRecord]:
    where = f"{tier.url}/{key}"
    if tier.size(key) > MAX_FILE_BYTES:
        raise ValueError(f"{where}: larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = loads(tier.get(key), max_depth=8)
    except JSONRejected as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("records"), list):
        raise ValueError(f"{where}: not a {FORMAT} file")
    g = _num(doc.get("global_rank"), int, f"{where}: global_rank")
    raw_node = doc.get("node")
    node = raw_node if isinstance(raw_node, str) else ""
    return [_record(r, g, node[:200], f"{where}: record {i}") for i, r in enumerate(doc["records"])]


def _num(x: Any, kind: type, what: str, none: bool = False) -> Any:
    if x is None and none:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or (kind is int and not isinstance(x, int)):
        raise ValueError(f"{what}: expected a number")
    return kind(x)


def _str(x: Any, what: str, none: bool = False) -> Any:
    if x is None and none:
        return None
    if not isinstance(x, str) or len(x) > 4096:
        raise ValueError(f"{what}: expected a string")
    return x


def _record(r: Any, global_rank: int, node: str, what: str) -> RankRecord:
    if not isinstance(r, dict):
        raise ValueError(f"{what}: expected an object")
    phases = []
    for j, p in enumerate(r.get("phases") or []):
        if not isinstance(p, dict):
            raise ValueError(f"{what}: phase {j}: expected an object")
        name = _str(p.get("name"), f"{what}: phase {j} name")
        phases.append(
            Phase(
                name,
                _num(p.get("start"), float, f"{what}: phase {j} start"),
                _num(p.get("end"), float, f"{what}: phase {j} end"),
                name in BLOCKED,
                _str(p.get("error"), f"{what}: phase {j} error", none=True),
            )
        )
    stats = r.get("stats") or {}
    if not isinstance(stats, dict):
        raise ValueError(f"{what}: stats: expected an object")
    return RankRecord(
        checkpoint_id=_str(r.get("id"), f"{what}: id"),
        token=_str(r.get("token"), f"{what}: token"),
        step=_num(r.get("step"), int, f"{what}: step", none=True),
        rank=_num(r.get("rank"), int, f"{what}: rank"),
        world=_num(r.get("world"), int, f"{what}: world"),
        global_rank=global_rank,
        node=node,
        bytes=_num(r.get("bytes"), int, f"{what}: bytes"),
        error=_str(r.get("error"), f"{what}: error", none=True),
        stats={k: _num(v, float, f"{what}: stats {k[:40]}") for k, v in stats.items()},
        phases=phases,
        process=_str(r.get("process"), f"{what}: process", none=True),
        settled=r.get("settled") is not False,
    )


def job_history(cfg: Any) -> tuple[list[RankRecord], list[str]]:
    """Every record this process can read for the job configured by ``cfg``: its first tier's
    history and, with a node-local first tier, that of every other node directory readable here
    (unreadable ones are skipped). Returns the records and the URLs of the tiers read."""
    from ..tiers import Chain, make_node_tiers

    tiers: list[Tier] = []
    try:
        tiers.append(Chain(cfg).first)
        tiers += list(make_node_tiers(cfg).values())
        return read_history(tiers), [t.url for t in tiers]
    finally:
        for t in tiers:
            t.close()
