"""A framework's checkpoint *paths* as tierckpt checkpoints: ids, pointer files, resolution, deletion.

Lightning names checkpoints by path (``<dirpath>/epoch=1-step=200.ckpt``, ``last.ckpt``) and
looks at that path afterwards: ``ModelCheckpoint`` checks it exists (version counters), links
``last.ckpt`` to it (``save_last="link"``), and ``ckpt_path="last"`` picks the newest
``last*.ckpt`` that exists, by modification time. So a save through tierckpt leaves, at that
path, a small **pointer file** (a few hundred bytes, written atomically by the saving rank)
naming the tierckpt checkpoint; the checkpoint itself lives only in the tiers. The file opens
with a two-line pickle that makes ``torch.load`` (``LightningModule.load_from_checkpoint``) fail
with a message saying what the file is, followed by JSON (:class:`Pointer`).

**Runs.** Several runs share one configuration (the same tiers), so ids are namespaced per run:
a path's id is ``<run>@<name>``: ``name`` its last component (``epoch=1-step=200.ckpt``), ``run``
the plugin's ``run`` argument or else :func:`run_key` of the path's directory (its last two
components and a hash of its absolute path: ``ckpt-1f0e2d3c``). Two runs with another
``dirpath`` (or the next ``lightning_logs/version_N``) never share an id; what one deletes,
resolves as "newest" or prunes is its own. Ids saved before namespacing (no ``@``) still load:
pointers name them, and a path with no pointer tries ``<run>@<name>``, then ``<name>``.

**When the pointer is written.** A save's pointer is written when the save returns if this
process knows a committed checkpoint to fall back to (one it saved or loaded, recorded in the
pointer as ``fallback``); a save of a process with none is pointed to once it is committed on
the first tier, or as soon as an earlier save of the process commits (which is then its
fallback). So a job killed between a save and its commit leaves either no pointer (nothing of
the process committed: Lightning starts from scratch, as it does without a checkpoint) or a
pointer whose fallback is committed: there is no crash loop on restart, and a link such as
``last.ckpt`` to the newest save names a pointer as soon as any save of the process committed.

Saving again to a path whose pointer names a checkpoint (``save_last=True`` rewrites
``last.ckpt``) makes a new id, ``<id>+<n>`` (tierckpt never overwrites a checkpoint); the
pointer then names both, and the replaced checkpoint is deleted once its replacement is
committed on every tier. A save whose checkpoint dict is the very same as the last one saved to
that path in this process (same values, tensors not modified since) is not made again.

**Resolution** (:meth:`PathMap.resolve`, for loads): the pointer's id if that checkpoint is
committed on some tier (and healthy, :attr:`PathMap.healthy`: not marked bad, no NaN/Inf recorded;
an unhealthy one counts as not committed, and when only unhealthy ones are found
:class:`~tierckpt.errors.CheckpointMarkedBad` is raised); else the one it replaced, else its fallback, if committed; else, for
Lightning's ``last`` names (``last.ckpt``, ``last-v1.ckpt``, or a link to any pointer under such
a name), the run's newest committed checkpoint (ids of the run, and ids named by pointers in the
same directory), logging which. A ``last`` pointer with nothing committed to fall back to (left
by an older tierckpt) is removed and :class:`~tierckpt.errors.CheckpointNotFound` raised: the
next start begins from scratch. A path holding anything but a pointer is not tierckpt's
(:attr:`Resolved.foreign`): the framework's own loader reads it.

**Orphans.** A pointer whose checkpoint never committed (its job died first) is removed by the
next process that saves into that directory (in the background, after its first save), unless
a ``last`` link points at it.

**Deletion** (:meth:`PathMap.remove`): the pointer goes at once; the checkpoint goes from every
tier in the background (:class:`~tierckpt.integrations.deletions.Deletions`), after its save
in this process (if any) is done.

Who calls what: the saving rank (rank 0) calls :meth:`new_id`, :meth:`saved` and
:meth:`remove`; any rank may call :meth:`resolve` (collective frameworks resolve on rank 0 and
broadcast). Deferred pointer writes and the orphan sweep run on background threads (the
writer's, one sweep thread); their failures are raised by :meth:`close`. No collective here.
Paths go through fsspec, as Lightning's own do.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import replace
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner

from ..capture.ranksave import RankSave
from ..config import TierConfig
from ..errors import CommitConflict, TierckptError
from ..format.layout import check_checkpoint_id
from ..save.writer import TieredWriter
from ..tiers import Tier, make_tiers
from .deletions import Deletions
from .pathresolve import RUN_SEP, PathResolution, Resolved
from .pointers import (  # noqa: F401 - the pointer file, served from here as before
    LAST_NAME,
    NotAPointer,
    Pointer,
    _fingerprint,
    _fs,
    _not_a_checkpoint_message,
    _split_path,
    check_run,
    read_pointer,
    run_key,
    sweep_orphans,
    tierckpt_pointer_is_not_a_checkpoint,
    write_pointer,
)

__all__ = [
    "LAST_NAME",
    "RUN_SEP",
    "Pointer",
    "Resolved",
    "PathMap",
    "NotAPointer",
    "cached_planner",
    "check_run",
    "run_key",
    "read_pointer",
    "write_pointer",
]

log = logging.getLogger("tierckpt")


_VERSION_RE = re.compile(r"^(.*)\+(\d+)$")


def cached_planner() -> DefaultSavePlanner:
    """The save planner of the integrations' saves: DCP's with plan caching, so a save whose
    state has the same keys and shapes as the previous one skips DCP's planning (and its
    collectives: an empty plan per rank); tierckpt reuses its layout for that plan and persists
    the plans across restarts (:mod:`tierckpt.save.plancache`). A changed state is re-planned."""
    return DefaultSavePlanner(enable_plan_caching=True)


class PathMap(PathResolution):
    """Paths <-> tierckpt checkpoints for one framework plugin (see the module docstring).

    ``writer``: the plugin's writer (its engine's tiers are where deletions run), or a callable
    making it with ``cfg``, the configuration, given: then the writer is made on the first save,
    removal or deletion, and a process that only loads (Lightning's DDP ranks but rank 0) never
    makes one (a writer starts the engine's threads and installs the SIGTERM handler; resolving
    needs only the tiers). ``run``: the run key of every id (``None``: :func:`run_key` of each
    path's directory).
    """

    def __init__(
        self,
        writer: TieredWriter | Callable[[], TieredWriter],
        run: str | None = None,
        *,
        cfg: TierConfig | None = None,
    ) -> None:
        if isinstance(writer, TieredWriter):
            self._writer: TieredWriter | None = writer
            self._make_writer: Callable[[], TieredWriter] | None = None
            self.cfg = writer.cfg
        else:
            if cfg is None:
                raise TypeError("PathMap(make_writer, ...) needs cfg=, the writer's configuration")
            self._writer, self._make_writer, self.cfg = None, writer, cfg
        self._tiers: list[Tier] | None = None  # the tiers resolve() reads, while there is no writer
        self._deletions: Deletions | None = None
        self.run = check_run(run) if run is not None else None
        self._saves: dict[str, RankSave] = {}  # id -> its save in this process
        self._lock = threading.Lock()
        self._unwritten: dict[str, str] = {}  # path -> the id whose pointer waits for its commit
        self._deferred: dict[str, tuple[Pointer, int]] = {}  # path -> (that pointer, its save's order)
        self._last_saved: dict[str, str] = {}  # path -> the id saved (or aliased) there by this process
        self._newest: tuple[str, tuple] | None = None  # (id, fingerprint) of this process's last save
        self._known: tuple[int, str] | None = None  # (save order, id) of the newest committed one known here
        self._seq = 0
        self._background: list[Future] = []  # deferred pointer writes and orphan sweeps
        self._swept: set[str] = set()

    @property
    def writer(self) -> TieredWriter:
        """The writer of this process's saves (made on first use when a factory was given)."""
        with self._lock:
            if self._writer is None:
                assert self._make_writer is not None
                self._writer = self._make_writer()
            return self._writer

    @property
    def deletions(self) -> Deletions:
        """The background deletions, over the writer's tiers (made on first use)."""
        writer = self.writer
        with self._lock:
            if self._deletions is None:
                self._deletions = Deletions(writer)
            return self._deletions

    def tiers(self) -> list[Tier]:
        """The tier chain, fastest first: the writer's engine's once there is a writer, else the
        configured tiers opened for reading."""
        with self._lock:
            writer = self._writer
            if writer is None:
                if self._tiers is None:
                    self._tiers = make_tiers(self.cfg)
                return self._tiers
        chain = writer.engine.chain
        return [chain[i] for i in range(len(chain))]

    # -- ids -----------------------------------------------------------------------------------
    def run_of(self, path: str | os.PathLike) -> str:
        """The run key of ids saved to ``path``."""
        return self.run or run_key(_split_path(path)[0])

    def id_for(self, path: str | os.PathLike) -> str:
        """``<run>@<name>``: the id a save to ``path`` gets when no pointer is there."""
        return check_checkpoint_id(f"{self.run_of(path)}{RUN_SEP}{_split_path(path)[1]}")

    # -- saving (the saving rank) --------------------------------------------------------------
    def new_id(self, path: str | os.PathLike) -> tuple[str, str | None]:
        """(the id for a save to ``path``, the id it replaces or ``None``)."""
        name = self.id_for(path)
        try:
            old = read_pointer(path)
        except NotAPointer:
            old = None  # a framework's own file: the pointer replaces it
        with self._lock:
            pending = self._unwritten.get(os.fspath(path))
        prev = pending or (old.id if old is not None else None)
        if name not in self._saves and (prev is None or (prev != name and not prev.startswith(name + "+"))):
            return name, prev  # the pointer there, if any, names an id of another form (saved before namespacing)
        prev = prev or name
        m = _VERSION_RE.match(prev)
        n = int(m.group(2)) + 1 if m and m.group(1) == name else 1
        cid = f"{name}+{n}"
        while cid in self._saves:
            n += 1
            cid = f"{name}+{n}"
        return check_checkpoint_id(cid), prev

    def unchanged(self, flat: dict[str, Any]) -> str | None:
        """The id of this process's last save if ``flat`` is the very same content (Lightning's
        ``save_last=True`` saves ``last.ckpt`` right after the step's own checkpoint, and again at
        the end of a run): then a new save would be a full copy of it, and :meth:`alias` points
        the path at it instead. ``None`` otherwise, or if that save failed."""
        last = self._newest
        if last is None or last[1] != _fingerprint(flat):
            return None
        job = self._saves.get(last[0])
        if job is not None and job.committed.done() and job.committed.exception() is not None:
            return None  # that save failed: save again
        return last[0]

    def alias(self, path: str | os.PathLike, checkpoint_id: str, step: int | None = None) -> None:
        """Point ``path`` at ``checkpoint_id``, saved already in this process (see
        :meth:`unchanged`): no new checkpoint. The one ``path`` named before is deleted unless
        another pointer still names it."""
        try:
            old = read_pointer(path)
        except NotAPointer:
            old = None
        with self._lock:
            pending = self._unwritten.get(os.fspath(path))
        prev = pending or (old.id if old is not None else None)
        if prev == checkpoint_id:
            return
        self.saved(path, checkpoint_id, self._saves.get(checkpoint_id), prev, step)

    def saved(
        self,
        path: str | os.PathLike,
        checkpoint_id: str,
        job: RankSave | None,
        replaces: str | None,
        step: int | None = None,
        flat: dict[str, Any] | None = None,
    ) -> None:
        """After the save of ``checkpoint_id`` returned: write its pointer at ``path`` now or
        once it is committed (see the module docstring); queue the deletion of the checkpoint it
        replaces (once this one is committed on every tier). ``flat``: what was saved (for
        :meth:`unchanged`)."""
        key = os.fspath(path)
        with self._lock:
            self._seq += 1
            seq = self._seq
            fallback = self._known[1] if self._known is not None else None
        if job is not None:
            self._saves[checkpoint_id] = job
            job.committed.add_done_callback(lambda f: self._on_commit(f, seq, checkpoint_id))
        self._last_saved[key] = checkpoint_id
        if flat is not None:
            self._newest = (checkpoint_id, _fingerprint(flat))
        ptr = Pointer(checkpoint_id, replaces, self.cfg.source or "", step, fallback)
        if job is None or fallback is not None or (job.committed.done() and job.committed.exception() is None):
            with self._lock:
                self._unwritten.pop(key, None)
                self._deferred.pop(key, None)
            write_pointer(path, ptr)
        else:
            fs, d = _fs(_split_path(path)[0])
            fs.makedirs(d, exist_ok=True)  # as a written pointer would: Lightning links last.ckpt into it at once
            done: Future = Future()
            with self._lock:
                self._unwritten[key] = checkpoint_id
                self._deferred[key] = (ptr, seq)
                self._background.append(done)
            job.committed.add_done_callback(lambda f: self._write_when_committed(f, key, ptr, done))
            log.info(
                "the pointer %s to %s is written once it is committed (nothing older to fall back to)",
                key,
                checkpoint_id,
            )
        if replaces is not None and replaces != checkpoint_id and not self._named(replaces, key):
            self.deletions.delete(replaces, job.replicated if job is not None else None, unless_failed=True)
        self._sweep_once(_split_path(path)[0])

    def _on_commit(self, f: Future, seq: int, cid: str) -> None:
        """The writer's thread, once save number ``seq`` (``cid``) committed on the first tier or
        failed. Committed: it is the newest one known here if no later save committed; and the
        pointers still waiting for the commit of a later save (deferred: nothing to fall back to
        when it returned) are written now, with ``cid`` as their fallback. Otherwise a job killed
        before those later commits would leave ``last.ckpt`` linked to a pointer never written,
        and the restart would start from scratch although ``cid`` is committed."""
        if f.exception() is not None:
            return
        with self._lock:
            if self._known is None or self._known[0] < seq:
                self._known = (seq, cid)
            ready = [(k, p) for k, (p, s) in self._deferred.items() if s > seq and self._unwritten.get(k) == p.id]
            for k, _ in ready:
                del self._deferred[k]
                del self._unwritten[k]
        for k, p in ready:
            done: Future = Future()
            try:
                write_pointer(k, replace(p, fallback=cid))
                log.info("the pointer %s to %s is written: checkpoint %s committed, its fallback", k, p.id, cid)
                done.set_result(None)
            except BaseException as e:  # noqa: BLE001 - close() raises it
                log.error("writing the tierckpt pointer %s failed: %s", k, e)
                done.set_exception(e)
            with self._lock:
                self._background.append(done)

    def _write_when_committed(self, f: Future, key: str, ptr: Pointer, done: Future) -> None:
        """The writer's thread, once ``ptr.id`` committed on the first tier (or failed)."""
        try:
            with self._lock:
                current = self._unwritten.get(key) == ptr.id
                if current:
                    del self._unwritten[key]
                    self._deferred.pop(key, None)
            if f.exception() is not None:
                log.warning(
                    "checkpoint %s was not committed (%s)%s",
                    ptr.id,
                    f.exception(),
                    f": no pointer written at {key}" if current else "",
                )
            elif current:  # not removed, nor saved again, since
                write_pointer(key, ptr)
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - close() raises it
            log.error("writing the tierckpt pointer %s failed: %s", key, e)
            done.set_exception(e)

    def remove(self, path: str | os.PathLike) -> None:
        """The framework deletes ``path``: its pointer now (or the one still to be written), its
        checkpoint in the background."""
        key = os.fspath(path)
        try:
            ptr = read_pointer(path)
        except NotAPointer:
            log.warning("not deleting %s: it is not a tierckpt pointer", path)
            return
        with self._lock:
            pending = self._unwritten.pop(key, None)
            self._deferred.pop(key, None)
        self._last_saved.pop(key, None)
        cid = pending or (ptr.id if ptr is not None else self.id_for(path))
        fs, p = _fs(path)
        if ptr is not None:
            fs.rm(p)
        if self._named(cid, key):
            log.info("%s removed; its checkpoint %s stays: another pointer names it", path, cid)
            return
        job = self._saves.pop(cid, None)
        self.deletions.delete(cid, job.replicated if job is not None else None)

    def _named(self, checkpoint_id: str, path: str) -> bool:
        """Whether a pointer other than ``path`` names ``checkpoint_id``: one of this process
        still to be written, or a file in ``path``'s directory (links aside: they are not
        pointers of their own)."""
        with self._lock:
            if any(cid == checkpoint_id and k != path for k, cid in self._unwritten.items()):
                return True
        directory = _split_path(path)[0]
        fs, d = _fs(directory)
        here = os.path.abspath(path)
        for e in fs.ls(d, detail=False) if fs.isdir(d) else []:
            if ".tmp-" in e.rsplit("/", 1)[-1] or os.path.abspath(e) == here or os.path.islink(e):
                continue
            try:
                ptr = read_pointer(e)
            except TierckptError:
                continue
            if ptr is not None and ptr.id == checkpoint_id:
                return True
        return False

    def conflict(self, error: BaseException, path: str | os.PathLike, checkpoint_id: str) -> CommitConflict | None:
        """A clear :class:`~tierckpt.errors.CommitConflict` for a save of ``checkpoint_id`` to
        ``path`` that failed with ``error`` (DCP's ``CheckpointException`` wraps it per rank)
        because the id is committed already, else ``None``."""
        found = [error] + [f[0] if isinstance(f, tuple) else f for f in getattr(error, "failures", {}).values()]
        if not any(isinstance(f, CommitConflict) for f in found):
            return None
        run = self.run_of(path)
        how = f"run={run!r}" if self.run else f"the directory {_split_path(path)[0]}"
        return CommitConflict(
            f"cannot save {path}: checkpoint {checkpoint_id} is already committed in "
            f"{self.cfg.source or 'the configuration'}, saved by another run with the same run key {run!r} "
            f"(this run's key comes from {how}); tierckpt never overwrites it. Give each run its own "
            "checkpoint directory or run key (run=...)"
        )

    # -- orphans -------------------------------------------------------------------------------
    def _sweep_once(self, directory: str) -> None:
        """After this process's first save into ``directory``: remove, in the background, the
        pointers there whose checkpoint is committed nowhere (their job died before the commit)."""
        if directory in self._swept:
            return
        self._swept.add(directory)
        done: Future = Future()
        with self._lock:
            self._background.append(done)

        def run() -> None:
            try:
                done.set_result(self._sweep(directory))
            except BaseException as e:  # noqa: BLE001 - close() raises it
                log.error("sweeping orphan tierckpt pointers in %s failed: %s", directory, e)
                done.set_exception(e)

        threading.Thread(target=run, name="tierckpt-pointer-sweep", daemon=True).start()

    def _sweep(self, directory: str) -> list[str]:
        def ours() -> set[str]:
            with self._lock:
                return {os.path.abspath(k) for k in list(self._unwritten) + list(self._last_saved)}

        return sweep_orphans(directory, ours, lambda cid: cid in self._saves or self.committed(cid))

    # -- the end -------------------------------------------------------------------------------
    def close(self, quietly: bool = False) -> None:
        """Wait for every save of the writer to commit, every pointer and deletion asked for to
        be written or run, and the orphan sweeps; raise the first failure (with ``quietly``: log it)."""
        try:
            with self._lock:
                writer, deletions = self._writer, self._deletions
            if writer is not None:
                writer.close()
            with self._lock:
                pending, self._background = self._background, []
            futures_wait(pending)
            if deletions is not None:
                deletions.wait()
            for f in pending:
                if f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
        except BaseException as e:
            if not quietly:
                raise
            log.error("tierckpt: %s", e)
