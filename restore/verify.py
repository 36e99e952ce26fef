"""``verify``: check a committed checkpoint on every tier holding it, byte for byte.

For each tier with a committed copy: its metadata must parse (it carries its own CRC32C) and
name the same save as the other tiers; every data file must have the size the manifest says;
every CRC32C piece must match. Files are read in large sequential ranges (a multiple of the
chunk size, so that each range holds whole pieces), several ranges in parallel, never item by
item. A data file absent from one tier is not a failure when another tier holds it intact
(after ``fetch --rank`` the local tier holds a subset on purpose; the reader takes the other
files from S3); it is one when no tier holds a good copy.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierckpt.catalog import lease as leases
from tierckpt.catalog.listing import read_checkpoint_doc
from tierckpt.codec.view import decoding
from tierckpt.config import TierConfig
from tierckpt.errors import CheckpointNotFound, CorruptCheckpoint, TierckptError
from tierckpt.format.layout import check_checkpoint_id, data_key
from tierckpt.format.metadata import CheckpointManifest
from tierckpt.load.readback import range_size
from tierckpt.tiers.base import Tier

from .catalog import (
    as_config,
    checkpoint_objects,
    find_latest_here,
    is_committed_on,
    open_node_dirs,
    open_tiers,
    resolve_id,
)
from .pieces import FileCheck
from .work import progress_bar, run_all, workers_for

log = logging.getLogger("tierckpt.restore")

__all__ = ["Problem", "TierReport", "VerifyReport", "verify_checkpoint"]


@dataclass
class Problem:
    """One thing wrong with one tier's copy."""

    tier: str
    file: str
    kind: str  # "crc", "size", "missing", "metadata", "mismatch", "read"
    detail: str
    fqn: str | None = None
    offset: list[int] | None = None

    def describe(self) -> str:
        return f"{self.tier}: {self.file}: {self.detail}"

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TierReport:
    tier: str
    url: str
    files_checked: int = 0
    bytes_checked: int = 0
    absent: list[str] = field(default_factory=list)  # data files this tier does not hold
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {
            "tier": self.tier,
            "url": self.url,
            "ok": self.ok,
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
            "absent": self.absent,
            "problems": [p.to_json() for p in self.problems],
        }


@dataclass
class VerifyReport:
    checkpoint_id: str
    tiers: list[TierReport]
    problems: list[Problem]  # every problem, tier reports' and cross-tier ones
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {
            "checkpoint_id": self.checkpoint_id,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "tiers": [t.to_json() for t in self.tiers],
            "problems": [p.to_json() for p in self.problems],
        }


@dataclass
class _Task:
    tier: Tier
    label: str  # the report's name: the tier's section, or "node NAME"
    report: TierReport
    fc: FileCheck
    key: str
    start: int
    end: int


def verify_checkpoint(
    config: TierConfig | str | os.PathLike | None,
    checkpoint_id: str = "latest",
    *,
    tier: str | None = None,
    progress: bool = True,
) -> VerifyReport:
    """Verify ``checkpoint_id`` (or ``"latest"``) on every tier holding a committed copy.

    Args:
        config: a :class:`TierConfig`, a TOML path, or ``None`` for ``$TIERCKPT_CONFIG``.
        tier: ``"local"`` or ``"s3"`` to check only that tier.
        progress: show a progress bar on a terminal.

    With a node-local ``[local]`` path (``{node}``) and no ``tier``, the other nodes' directories
    readable here are checked too (reports named ``node NAME``; a data file a node does not hold
    is not a problem when another holder has it intact), and ``latest`` is what this node's load
    resolves over them (:func:`restore.catalog.find_latest_here`), as ``tierckpt-restore latest``.

    Returns a :class:`VerifyReport`; ``report.ok`` is False on any problem. Raises
    :class:`CheckpointNotFound` when no tier holds a committed copy.
    """
    import time

    t0 = time.perf_counter()
    if checkpoint_id != "latest":
        check_checkpoint_id(checkpoint_id)  # InvalidCheckpointId before any tier is contacted
    cfg = as_config(config)
    tiers = open_tiers(cfg, tier)
    held: list[leases.Lease] = []
    others: dict[str, Tier] = {}
    try:
        others = {} if tier else open_node_dirs(cfg, tiers)
        if checkpoint_id == "latest" and not tier:
            cid = find_latest_here(cfg, tiers).checkpoint_id
        else:
            cid = resolve_id(tiers, checkpoint_id)
        labels: dict[int, str] = {id(t): f"node {n}" for n, t in others.items()}
        candidates = [t for t in [*tiers, *others.values()] if is_committed_on(t, cid)]
        if not candidates:
            raise CheckpointNotFound(
                f"checkpoint {cid} is not committed on any tier: "
                + ", ".join(t.url for t in [*tiers, *others.values()])
            )
        holding = []
        for t in candidates:
            try:  # held until the end: retention and gc anywhere leave the checkpoint alone
                held.append(leases.acquire(t, cid, purpose="verify"))
            except CheckpointNotFound as e:
                log.warning("%s", e)
                continue
            except (TierckptError, OSError) as e:
                if id(t) not in labels:
                    raise
                log.debug("no lease on %s (%s): reading it without one", t.url, e)  # another node's, read-only here
            d = decoding(t, cid)  # encoded files are checked as the bytes they decode to
            labels[id(d)] = labels.get(id(t), t.name)
            holding.append(d)
        if not holding:
            raise CheckpointNotFound(f"checkpoint {cid} is no longer committed on any tier (deleted?)")
        reports: list[TierReport] = []
        problems: list[Problem] = []
        manifests: dict[str, CheckpointManifest] = {}
        tasks: list[_Task] = []
        present: dict[str, set[str]] = {}  # file -> tiers where it is present with the right size
        all_files: dict[str, int] = {}
        for t in holding:
            name = labels[id(t)]
            rep = TierReport(name, t.url)
            reports.append(rep)
            try:
                doc = read_checkpoint_doc(t, cid)
            except (CorruptCheckpoint, CheckpointNotFound) as e:
                rep.problems.append(Problem(name, "metadata.json", "metadata", str(e)))
                continue
            man = manifests[name] = doc.manifest
            all_files.update(man.files)
            sizes = {name: info.size for name, info in checkpoint_objects(t, cid).items()}
            by_file = doc.files_items()
            rsize = range_size(t, man.chunk_size)
            for file, want in sorted(man.files.items()):
                got = sizes.get(file)
                if got is None:
                    if want:
                        rep.absent.append(file)
                    else:
                        present.setdefault(file, set()).add(name)
                    continue
                if got != want:
                    rep.problems.append(Problem(name, file, "size", f"{got} bytes, the manifest says {want}"))
                    continue
                present.setdefault(file, set()).add(name)
                rep.files_checked += 1
                fc = FileCheck(file, want, by_file.get(file, []), man.chunk_size)
                if fc.covered != want:
                    rep.problems.append(
                        Problem(name, file, "size", f"the CRC pieces cover {fc.covered} of {want} bytes")
                    )
                for start, end in fc.ranges(rsize):
                    tasks.append(_Task(t, name, rep, fc, data_key(cid, file), start, end))
        tokens = {name: m.save_token for name, m in manifests.items()}
        if len(set(tokens.values())) > 1:
            problems.append(
                Problem(
                    ",".join(tokens),
                    "metadata.json",
                    "mismatch",
                    "the tiers hold different saves under this id: "
                    + ", ".join(f"{n} token {tok[:8]}" for n, tok in tokens.items()),
                )
            )
        bad_files: set[tuple[str, str]] = set()
        _run(cfg, tasks, progress, cid, bad_files)
        for rep in reports:
            for file in rep.absent:
                good = [n for n in present.get(file, set()) if (n, file) not in bad_files]
                if not good:
                    rep.problems.append(
                        Problem(rep.tier, file, "missing", "absent here, and no other tier holds a good copy")
                    )
            rep.problems.sort(key=lambda p: (p.file, p.kind, p.detail))
        problems = [p for rep in reports for p in rep.problems] + problems
        return VerifyReport(cid, reports, problems, time.perf_counter() - t0)
    finally:
        for lease in held:
            lease.release()
        for t in [*tiers, *others.values()]:
            t.close()


def _run(cfg: TierConfig, tasks: list[_Task], progress: bool, cid: str, bad_files: set[tuple[str, str]]) -> None:
    lock = threading.Lock()
    stop = threading.Event()
    bar = progress_bar(sum(t.end - t.start for t in tasks), f"verify {cid}", progress)

    def one(task: _Task) -> list[Any]:
        if stop.is_set():
            return []
        buf = np.empty(task.end - task.start, dtype=np.uint8)
        try:
            task.tier.read_into(task.key, task.start, memoryview(buf))
        except (TierckptError, OSError) as e:
            return [Problem(task.label, task.fc.file, "read", f"bytes [{task.start}, {task.end}): {e}")]
        return [
            Problem(task.label, b.file, "crc", b.describe(), b.fqn, list(b.offset) if b.offset is not None else None)
            for b in task.fc.check(task.start, buf)
        ]

    def done(task: _Task, found: list[Problem]) -> None:
        with lock:
            task.report.bytes_checked += task.end - task.start
            task.report.problems.extend(found)
            if found:
                bad_files.add((task.label, task.fc.file))
        bar.update(task.end - task.start)

    try:
        by_tier: dict[str, list[_Task]] = {}
        for t in tasks:
            by_tier.setdefault(t.label, []).append(t)
        # Tiers one after the other (each with its own parallelism); within one, files in order.
        for ts in by_tier.values():
            rsize = max(t.end - t.start for t in ts)
            run_all(one, ts, workers_for(ts[0].tier, rsize), done, stop)
    finally:
        bar.close()
