"""``fetch``: copy a committed checkpoint from S3 to the local tier, resumably and verified.

Contract of :func:`fetch_checkpoint`:

* The source is the last configured tier (S3), the destination the first (local); ``latest``
  is the newest checkpoint committed on the source.
* Every selected data file is downloaded with parallel ranged reads: the source tier's
  ``read_concurrency`` workers (fewer if ``workers x range`` would pass
  :data:`~tierckpt.readback.BUFFER_BUDGET`), ranges of :func:`tierckpt.readback.range_size`
  (about ``[s3] part_size``, a multiple of the checkpoint's chunk size so that every range holds
  whole CRC32C pieces). Each range is checked against its pieces *before* it is written; a bad
  range is read again (:func:`tierckpt.readback.read_checked`, :data:`~tierckpt.readback.TRIES`
  reads), then the fetch fails with ``ChecksumMismatch``.
* Resumable: each file is written through the local tier's resumable sink
  (:meth:`tierckpt.tiers.base.Tier.open_resumable`, one block per range, tagged with the save):
  a block is recorded only once written and durable. After an interruption (Ctrl-C, kill,
  crash) the next fetch re-checks the recorded ranges, keeps the good ones and downloads the
  rest. Nothing appears under a file's final name before all of it is in and durable.
* A file already present locally with the right size is checked range by range; if it is
  intact it is skipped, otherwise only its bad ranges are downloaded again.
* ``ID/metadata.json`` is written on the local tier last, byte-identical to the S3 copy (same
  ``committed`` time, so ``latest`` agrees across tiers). Until then the local copy is partial:
  never loaded, never ``latest``. With ``ranks`` only the files written by those ranks are
  fetched, and the metadata is still written: :class:`tierckpt.TieredReader` reads each data file
  from the local tier when it is there and from S3 otherwise.
* A local committed copy of the same id from a *different* save is never overwritten
  (``CommitConflict``). Two fetches never write one file at once: the second fails, saying
  another fetch is running (a resumable sink has one writer per key).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from tierckpt import lease as leases
from tierckpt.catalog import find_latest, read_checkpoint_metadata
from tierckpt.config import TierConfig
from tierckpt.errors import CheckpointNotFound, ChecksumMismatch, CommitConflict, CorruptCheckpoint, TierckptError, TierError
from tierckpt.layout import check_checkpoint_id, data_key, metadata_from_json, metadata_key
from tierckpt.readback import TRIES, range_size, read_checked, workers
from tierckpt.tiers.base import ResumableSink, Tier

from .catalog import as_config, open_tiers, rank_of_file
from .errors import UsageError
from .pieces import FileCheck, files_items
from .work import progress_bar, run_all

__all__ = ["SIDECAR_FORMAT", "FetchResult", "fetch_checkpoint"]

log = logging.getLogger("tierckpt.restore")

SIDECAR_FORMAT = "tierckpt-restore/fetch-ranges/1"  # the tag's format: a resumed file must come from the same save


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
    """One data file being fetched into ``local``: its resumable sink, the ranges still missing."""

    def __init__(self, local: Tier, cid: str, token: str, fc: FileCheck, range_size: int) -> None:
        self.local = local
        self.cid = cid
        self.fc = fc
        self.file = fc.file
        self.size = fc.size
        self.key = data_key(cid, fc.file)
        self.range_size = range_size
        self.tag = {"format": SIDECAR_FORMAT, "checkpoint_id": cid, "save_token": token, "file": fc.file}
        self.ranges = fc.ranges(range_size)
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
                log.warning("%s/%s: %d of %d ranges fail their checksums; downloading them again",
                            self.local.url, self.key, len(self.ranges) - len(good), len(self.ranges))
                adopt = True
                self.state = "repaired"
            else:
                log.warning("%s/%s has %d bytes, the manifest says %d; downloading it again",
                            self.local.url, self.key, got, self.size)
                self.local.delete(self.key)
        try:
            self.sink = self.local.open_resumable(self.key, self.size, block=self.range_size, tag=self.tag, adopt=adopt)
        except TierError as e:
            if e.errno == errno.EBUSY:
                raise TierckptError(f"another fetch of {self.cid} into {self.local.url} is running ({e}); "
                                    "wait for it, or stop it") from None
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
    tiers = open_tiers(cfg)
    if len(tiers) < 2:
        for t in tiers:
            t.close()
        raise UsageError(f"fetch copies from [s3] to [local]: the configuration{(' ' + cfg.source) if cfg.source else ''} "
                         "needs both sections")
    local, s3 = tiers[0], tiers[-1]
    plans: list[_FilePlan] = []
    held: list[leases.Lease] = []
    try:
        cid = _resolve_on_s3(s3, local, checkpoint_id)
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
        rsize = range_size(s3, man.chunk_size)
        for file in sorted(selected):
            fc = FileCheck(file, man.files[file], by_file.get(file, []), man.chunk_size)
            if fc.covered != fc.size:
                raise CorruptCheckpoint(f"{s3.url}/{mkey}: the CRC pieces of {file} cover {fc.covered} of {fc.size} bytes")
            plans.append(_FilePlan(local, cid, man.save_token, fc, rsize))
        for p in plans:
            p.prepare()
            res.bytes_reused += p.reused
            if p.state == "skipped":
                res.skipped.append(p.file)
            elif p.state == "resumed":
                res.resumed.append(p.file)
            elif p.state == "repaired":
                res.repaired.append(p.file)
        todo = [p for p in plans if p.sink is not None]
        for p in todo:
            if p.missing():
                got = s3.size(p.key)
                if got != p.size:
                    raise CorruptCheckpoint(f"{s3.url}/{p.key}: the object has {got} bytes, the manifest says {p.size}")
        _download(s3, cid, todo, res, progress)
        for p in todo:
            p.finish()
            if p.state != "skipped":
                res.downloaded.append(p.file)
        if local_raw != raw:
            # Last: the local copy becomes committed only now, with S3's bytes (same commit time).
            try:
                local.put(mkey, raw, if_absent=local_raw is None)
            except CommitConflict:
                if _local_metadata(local, cid, man.save_token) != raw:  # another fetch committed the same save: fine
                    raise
        res.committed = True
        res.seconds = time.perf_counter() - t0
        return res
    finally:
        for p in plans:
            p.close()
        for lease in held:
            lease.release()
        for t in tiers:
            t.close()


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


def _download(s3: Tier, cid: str, plans: list[_FilePlan], res: FetchResult, progress: bool) -> None:
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
        buf = np.empty(e - s, dtype=np.uint8)
        bad, reads = read_checked(s3, p.key, s, memoryview(buf), p.fc.check)
        if reads > 1:
            with lock:
                res.ranges_retried += reads - 1
        if bad:
            raise ChecksumMismatch(f"checkpoint {cid}: {s3.url}/{p.key}: {bad[0].describe()}"
                                   + (f" (and {len(bad) - 1} more pieces)" if len(bad) > 1 else "")
                                   + f"; downloaded {TRIES} times: the S3 copy is corrupt")
        assert p.sink is not None
        p.sink.write_block(i, memoryview(buf))
        return e - s

    def done(task: tuple[_FilePlan, int], n: int) -> None:
        res.bytes_downloaded += n
        bar.update(n)

    try:
        run_all(one, tasks, workers(s3, max(p.range_size for p in plans)), done, stop)
    finally:
        bar.close()
