"""``fetch``: copy a committed checkpoint from S3 to the local tier, resumably and verified.

Contract of :func:`fetch_checkpoint`:

* The source is the S3 tier; ``latest`` is the newest checkpoint committed there.
* Every selected data file is downloaded with parallel ranged GETs: ``[s3] concurrency`` workers
  (fewer if ``workers x range`` would pass :data:`~restore.work.BUFFER_BUDGET`), ranges of about
  ``[s3] part_size`` rounded to a multiple of the checkpoint's chunk size so that every range
  holds whole CRC32C pieces. Each range is checked against its pieces *before* it is written;
  a bad range is downloaded again (3 tries), then the fetch fails with ``ChecksumMismatch``.
* Resumable: a file is written as ``<file>.partial`` next to its final name, with a sidecar
  ``<file>.ranges.partial`` (JSON: save token, size, range size, indices of the ranges that are
  written, verified and, with ``[local] fsync``, durable). Both names end in ``.partial``, so the
  local tier never lists them. After an interruption (Ctrl-C, kill, crash) the next fetch
  re-checks the recorded ranges on disk, keeps the good ones and downloads the rest. A finished
  file is fsynced and renamed to its final name; the sidecar is removed.
* A file already present locally with the right size is checked range by range; if it is
  intact it is skipped, otherwise only its bad ranges are downloaded again.
* ``ID/metadata.json`` is written on the local tier last, byte-identical to the S3 copy (same
  ``committed`` time, so ``latest`` agrees across tiers). Until then the local copy is partial:
  never loaded, never ``latest``. With ``ranks`` only the files written by those ranks are
  fetched, and the metadata is still written: :class:`tierckpt.TieredReader` reads each data file
  from the local tier when it is there and from S3 otherwise.
* A local committed copy of the same id from a *different* save is never overwritten
  (``CommitConflict``). Two fetches of one checkpoint into one local tier exclude each other
  (``flock`` on ``ID/.tmp-fetch.lock``, a name the tier never lists).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierckpt import lease as leases
from tierckpt.catalog import find_latest, read_checkpoint_metadata
from tierckpt.config import TierConfig
from tierckpt.errors import CheckpointNotFound, ChecksumMismatch, CommitConflict, CorruptCheckpoint, TierckptError
from tierckpt.layout import check_checkpoint_id, data_key, metadata_from_json, metadata_key
from tierckpt.tiers import make_local, make_s3
from tierckpt.tiers.base import Tier
from tierckpt.tiers.local import fsync_dir

from .catalog import as_config, key_path, rank_of_file
from .errors import UsageError
from .pieces import FileCheck, aligned_range_size, files_items
from .work import progress_bar, run_all, workers_for

__all__ = ["PARTIAL", "SIDECAR", "FetchResult", "fetch_checkpoint"]

log = logging.getLogger("tierckpt.restore")

PARTIAL = ".partial"  # the local tier's name for an object being written
SIDECAR = ".ranges.partial"
TMP = ".tmp-"  # the local tier never lists names starting with this
SIDECAR_FORMAT = "tierckpt-restore/fetch-ranges/1"
TRIES = 3


@dataclass
class FetchResult:
    """What :func:`fetch_checkpoint` did."""

    checkpoint_id: str
    local_url: str
    source_url: str
    ranks: list[int] | None
    files: list[str]  # the data files selected
    downloaded: list[str] = field(default_factory=list)  # files (partly) downloaded now
    skipped: list[str] = field(default_factory=list)  # files already complete and intact locally
    resumed: list[str] = field(default_factory=list)  # files whose earlier partial download was kept
    repaired: list[str] = field(default_factory=list)  # files present locally whose bad ranges were replaced
    bytes_downloaded: int = 0
    bytes_reused: int = 0  # verified bytes kept from local files and partial downloads
    ranges_retried: int = 0
    committed: bool = False  # the local metadata.json is in place
    seconds: float = 0.0

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["seconds"] = round(self.seconds, 3)
        return d


class _FilePlan:
    """One data file being fetched: its ``.partial``, its sidecar, the ranges still missing."""

    def __init__(self, root: Path, cid: str, token: str, fc: FileCheck, range_size: int, fsync: bool) -> None:
        self.cid = cid
        self.token = token
        self.fc = fc
        self.file = fc.file
        self.size = fc.size
        self.range_size = range_size
        self.fsync = fsync
        self.final = key_path(root, data_key(cid, fc.file))
        self.partial = self.final.with_name(fc.file + PARTIAL)
        self.sidecar = self.final.with_name(fc.file + SIDECAR)
        self.ranges = fc.ranges(range_size)
        self.done: set[int] = set()
        self.fd: int | None = None
        self.lock = threading.Lock()
        self.state = "fresh"  # "skipped", "resumed", "repaired", "fresh"
        self.reused = 0

    # -- preparation (main thread) ------------------------------------------------------
    def prepare(self) -> None:
        """Decide what is still missing, checking whatever is already on disk."""
        self.final.parent.mkdir(parents=True, exist_ok=True)
        if self.size == 0:
            if not self.final.exists():
                self._write_empty()
            self.state = "skipped"
            return
        if self.final.is_file():
            if self.final.stat().st_size == self.size:
                good = self._check_on_disk(self.final, range(len(self.ranges)))
                if len(good) == len(self.ranges):
                    self.state = "skipped"
                    self.done = good
                    self.reused = self.size
                    return
                log.warning("%s: %d of %d ranges fail their checksums; downloading them again",
                            self.final, len(self.ranges) - len(good), len(self.ranges))
                os.replace(self.final, self.partial)
                self.done = good
                self.state = "repaired"
            else:
                log.warning("%s has %d bytes, the manifest says %d; downloading it again",
                            self.final, self.final.stat().st_size, self.size)
                self.final.unlink()
        elif self.partial.is_file() and self.partial.stat().st_size == self.size:
            recorded = self._read_sidecar()
            if recorded:
                self.done = self._check_on_disk(self.partial, sorted(recorded))
                if self.done:
                    self.state = "resumed"
        self.reused = sum(self.ranges[i][1] - self.ranges[i][0] for i in self.done)
        if not self.done:
            self._remove_partial()
        self.fd = os.open(self.partial, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(self.fd, self.size)
        self._save_sidecar()

    def _write_empty(self) -> None:
        with open(self.partial, "wb") as f:
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(self.partial, self.final)

    def _read_sidecar(self) -> set[int]:
        try:
            doc = json.loads(self.sidecar.read_bytes())
            if (doc.get("format") != SIDECAR_FORMAT or doc.get("checkpoint_id") != self.cid
                    or doc.get("save_token") != self.token or doc.get("file") != self.file
                    or doc.get("size") != self.size or doc.get("range_size") != self.range_size):
                return set()
            return {int(i) for i in doc.get("done", []) if 0 <= int(i) < len(self.ranges)}
        except (OSError, ValueError, TypeError, AttributeError):
            return set()

    def _save_sidecar(self) -> None:
        doc = {"format": SIDECAR_FORMAT, "checkpoint_id": self.cid, "save_token": self.token, "file": self.file,
               "size": self.size, "range_size": self.range_size, "done": sorted(self.done)}
        tmp = self.sidecar.with_name(f"{TMP}{uuid.uuid4().hex}-{self.sidecar.name}")  # never listed by the tier
        with open(tmp, "w") as f:
            json.dump(doc, f)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self.sidecar)

    def _check_on_disk(self, path: Path, indices: Iterable[int]) -> set[int]:
        good: set[int] = set()
        fd = os.open(path, os.O_RDONLY)
        try:
            for i in indices:
                s, e = self.ranges[i]
                buf = np.empty(e - s, dtype=np.uint8)
                if os.preadv(fd, [memoryview(buf)], s) == e - s and not self.fc.check(s, buf):
                    good.add(i)
        finally:
            os.close(fd)
        return good

    def _remove_partial(self) -> None:
        for p in (self.partial, self.sidecar):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    # -- downloading (worker threads) ---------------------------------------------------
    def missing(self) -> list[int]:
        return [i for i in range(len(self.ranges)) if i not in self.done]

    def write_range(self, i: int, buf: np.ndarray) -> None:
        """Write verified range ``i``, make it durable, record it in the sidecar."""
        assert self.fd is not None
        s, _e = self.ranges[i]
        mv = memoryview(buf)
        off = s
        while len(mv):
            n = os.pwrite(self.fd, mv, off)
            mv = mv[n:]
            off += n
        if self.fsync:
            os.fdatasync(self.fd)
        with self.lock:
            self.done.add(i)
            self._save_sidecar()

    # -- the end ------------------------------------------------------------------------
    def finish(self) -> None:
        """All ranges are in: make the file durable and give it its final name."""
        if self.fd is None:
            return
        if self.fsync:
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self.partial, self.final)
        try:
            self.sidecar.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Interrupted: keep ``.partial`` and sidecar for the next run."""
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def fetch_checkpoint(config: TierConfig | str | os.PathLike | None, checkpoint_id: str = "latest",
                     ranks: Iterable[int] | None = None, progress: bool = True) -> FetchResult:
    """Copy committed checkpoint ``checkpoint_id`` (or ``"latest"`` on S3) from S3 to the local tier.

    Args:
        config: a :class:`TierConfig`, a TOML path, or ``None`` for ``$TIERCKPT_CONFIG``; it needs
            both ``[local]`` and ``[s3]``.
        ranks: fetch only the data files written by these ranks (None: all files).
        progress: show a progress bar on a terminal.

    Returns a :class:`FetchResult`. Raises :class:`CheckpointNotFound` if S3 holds no committed
    copy, :class:`ChecksumMismatch` if S3's bytes fail their CRC32C three times,
    :class:`CommitConflict` if the local tier holds a different save under the same id. An
    interrupted fetch (any exception, ``KeyboardInterrupt`` included) is resumed by calling it again.
    See the module docstring for the whole contract.
    """
    t0 = time.perf_counter()
    if ranks is not None:
        ranks = list(ranks)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
        if bad:  # checked before any tier is contacted
            raise UsageError(f"--rank {bad[0]!r}: ranks are integers from 0")
    cfg = as_config(config)
    if cfg.local is None or cfg.s3 is None:
        raise UsageError(f"fetch copies from [s3] to [local]: the configuration{(' ' + cfg.source) if cfg.source else ''} "
                         "needs both sections")
    local = make_local(cfg)
    s3 = make_s3(cfg)
    assert local is not None and s3 is not None
    plans: list[_FilePlan] = []
    lock_fd: int | None = None
    held: list[leases.Lease] = []
    try:
        cid = _resolve_on_s3(s3, local, checkpoint_id)
        lock_fd = _lock(cfg.local.resolved_path(), cid)
        # Leases: gc or retention anywhere leaves the S3 copy and the local files alone meanwhile.
        held.append(leases.acquire(s3, cid, purpose="fetch"))
        held.append(leases.acquire(local, cid, kind="fetch", purpose="fetch into this tier", require_committed=False))
        mkey = metadata_key(cid)
        md, man = read_checkpoint_metadata(s3, cid)  # size-checked before it is read, then validated
        raw = s3.get(mkey)
        local_raw = _local_metadata(local, cid, man.save_token)
        selected = _select(man.files, man.world_size, ranks)
        rank_list = None if ranks is None else sorted(set(ranks))
        res = FetchResult(cid, f"{local.url}/{cid}", f"{s3.url}/{cid}", rank_list, sorted(selected))
        by_file = files_items(md)
        rsize = aligned_range_size(man.chunk_size, cfg.s3.part_size)
        root = cfg.local.resolved_path()
        for file in sorted(selected):
            fc = FileCheck(file, man.files[file], by_file.get(file, []), man.chunk_size)
            if fc.covered != fc.size:
                raise CorruptCheckpoint(f"{s3.url}/{mkey}: the CRC pieces of {file} cover {fc.covered} of {fc.size} bytes")
            plans.append(_FilePlan(root, cid, man.save_token, fc, rsize, cfg.local.fsync))
        for p in plans:
            p.prepare()
            res.bytes_reused += p.reused
            if p.state == "skipped":
                res.skipped.append(p.file)
            elif p.state == "resumed":
                res.resumed.append(p.file)
            elif p.state == "repaired":
                res.repaired.append(p.file)
        todo = [p for p in plans if p.state != "skipped"]
        for p in todo:
            got = s3.size(data_key(cid, p.file))
            if got != p.size:
                raise CorruptCheckpoint(f"{s3.url}/{data_key(cid, p.file)}: the object has {got} bytes, the manifest says {p.size}")
        _download(cfg, s3, cid, todo, res, progress)
        for p in todo:
            p.finish()
            res.downloaded.append(p.file)
        if cfg.local.fsync:
            for d in sorted({p.final.parent for p in todo}):
                fsync_dir(d)
        if local_raw != raw:
            # Last: the local copy becomes committed only now, with S3's bytes (same commit time).
            local.put(mkey, raw, if_absent=local_raw is None)
        res.committed = True
        res.seconds = time.perf_counter() - t0
        return res
    finally:
        for p in plans:
            p.close()
        for lease in held:
            lease.release()
        if lock_fd is not None:
            os.close(lock_fd)  # releases the lock
        local.close()
        s3.close()


def _lock(root: Path, cid: str) -> int:
    """Hold an exclusive lock on ``ID/.tmp-fetch.lock`` (a name the tier never lists) so that two
    fetches of one checkpoint into one local tier never write the same ``.partial`` files."""
    import fcntl

    path = key_path(root, metadata_key(cid)).with_name(f"{TMP}fetch.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TierckptError(f"another fetch of {cid} into {root} is running; wait for it, or stop it") from None
    return fd


def _resolve_on_s3(s3: Tier, local: Tier, checkpoint_id: str) -> str:
    if checkpoint_id == "latest":
        return find_latest([s3]).checkpoint_id
    cid = check_checkpoint_id(checkpoint_id)
    if not s3.exists(metadata_key(cid)):
        here = " (the local tier holds a committed copy already)" if local.exists(metadata_key(cid)) else ""
        raise CheckpointNotFound(f"checkpoint {cid} is not committed on {s3.url}{here}")
    return cid


def _local_metadata(local: Tier, cid: str, token: str) -> bytes | None:
    """The local metadata.json bytes if the local tier holds a committed copy of the same save."""
    mkey = metadata_key(cid)
    try:
        raw = local.get(mkey)
    except CheckpointNotFound:
        return None
    try:
        _md, man = metadata_from_json(raw, f"{local.url}/{mkey}")
    except CorruptCheckpoint as e:
        log.warning("%s; replacing it with the S3 copy", e)
        return b""
    if man.save_token != token:
        raise CommitConflict(f"{local.url}/{cid} holds a different save of checkpoint {cid} "
                             f"(token {man.save_token[:8]}, S3 has {token[:8]}); it is never overwritten")
    return raw


def _select(files: dict[str, int], world: int, ranks: Iterable[int] | None) -> dict[str, int]:
    if ranks is None:
        return dict(files)
    want = set(ranks)
    bad = sorted(r for r in want if r < 0 or r >= world)
    if bad:
        raise UsageError(f"--rank {bad[0]}: the checkpoint was saved by {world} rank(s) (0-{world - 1})")
    return {f: s for f, s in files.items() if rank_of_file(f) in want}


def _download(cfg: TierConfig, s3: Tier, cid: str, plans: list[_FilePlan], res: FetchResult, progress: bool) -> None:
    tasks = [(p, i) for p in plans for i in p.missing()]
    if not tasks:
        return
    lock = threading.Lock()
    stop = threading.Event()
    total = sum(p.ranges[i][1] - p.ranges[i][0] for p, i in tasks)
    bar = progress_bar(total, f"fetch {cid}", progress)

    def one(task: tuple[_FilePlan, int]) -> int:
        p, i = task
        if stop.is_set():
            return 0
        s, e = p.ranges[i]
        key = data_key(cid, p.file)
        buf = np.empty(e - s, dtype=np.uint8)
        for attempt in range(1, TRIES + 1):
            s3.read_into(key, s, memoryview(buf))
            bad = p.fc.check(s, buf)
            if not bad:
                break
            if attempt == TRIES:
                raise ChecksumMismatch(f"checkpoint {cid}: {s3.url}/{key}: {bad[0].describe()}"
                                       + (f" (and {len(bad) - 1} more pieces)" if len(bad) > 1 else "")
                                       + f"; downloaded {TRIES} times: the S3 copy is corrupt")
            log.warning("%s/%s: %s; downloading the range again", s3.url, key, bad[0].describe())
            with lock:
                res.ranges_retried += 1
        p.write_range(i, buf)
        return e - s

    def done(task: tuple[_FilePlan, int], n: int) -> None:
        res.bytes_downloaded += n
        bar.update(n)

    try:
        run_all(one, tasks, workers_for(cfg, s3, max(p.range_size for p in plans)), done, stop)
    finally:
        bar.close()


