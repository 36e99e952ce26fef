"""A framework's checkpoint *paths* as tierckpt checkpoints: ids, pointer files, resolution, deletion.

Lightning names checkpoints by path (``<dirpath>/epoch=1-step=200.ckpt``, ``last.ckpt``) and
looks at that path afterwards: ``ModelCheckpoint`` checks it exists (version counters), links
``last.ckpt`` to it (``save_last="link"``), and ``ckpt_path="last"`` picks the newest
``last*.ckpt`` by modification time. So every save through tierckpt leaves, at that path, a
small **pointer file** (JSON, a few hundred bytes, written atomically by the saving rank when
the save returns) naming the tierckpt checkpoint; the checkpoint itself lives only in the tiers.

**Ids.** A path's id is its last component (``epoch=1-step=200.ckpt``), so an explicit path
loads from any tier even where no pointer exists (a fresh machine with only S3). Saving again
to a path whose pointer names a checkpoint (``save_last=True`` rewrites ``last.ckpt``) makes a
new id, ``<name>+<n>`` (tierckpt never overwrites a checkpoint); the pointer then names both,
and the replaced checkpoint is deleted once its replacement is committed on every tier.

**Resolution** (:meth:`PathMap.resolve`, for loads): the pointer's id if that checkpoint is
committed on some tier; else the checkpoint it replaced, if committed; else, for Lightning's
``last`` names (``last.ckpt``, ``last-v1.ckpt``, or a link to any pointer under such a name), the
newest committed checkpoint (:func:`tierckpt.checkpoints.latest`): a job killed before its last
save committed resumes from the one before. A path holding anything but a pointer is not
tierckpt's (:attr:`Resolved.foreign`): the framework's own loader reads it.

**Deletion** (:meth:`PathMap.remove`): the pointer goes at once; the checkpoint goes from every
tier in the background (:class:`~tierckpt.integrations.deletions.Deletions`), after its save
in this process (if any) is done.

Who calls what: the saving rank (rank 0) calls :meth:`new_id`, :meth:`saved` and
:meth:`remove`; any rank may call :meth:`resolve` (collective frameworks resolve on rank 0 and
broadcast). No collective here. Paths go through fsspec, as Lightning's own do.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..capture.ranksave import RankSave
from ..catalog.checkpoints import checkpoint_id_of, latest
from ..catalog.listing import is_committed
from ..errors import CheckpointNotFound, TierckptError
from ..format.layout import check_checkpoint_id
from ..save.writer import TieredWriter
from .deletions import Deletions

__all__ = ["LAST_NAME", "Pointer", "Resolved", "PathMap", "read_pointer", "write_pointer"]

log = logging.getLogger("tierckpt")

LAST_NAME = re.compile(r"^last(-v\d+)?\.ckpt$")
"""Lightning's ``save_last`` names (``ModelCheckpoint.CHECKPOINT_NAME_LAST``, version, ``.ckpt``)."""

_MAGIC = "tierckpt-pointer"
_MAX_POINTER = 64 * 1024
_VERSION_RE = re.compile(r"^(.*)\+(\d+)$")


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says: the checkpoint, the one it replaced, the configuration and step."""

    id: str
    replaces: str | None = None
    config: str = ""
    step: int | None = None

    def encode(self) -> bytes:
        return (
            json.dumps(
                {
                    "format": _MAGIC,
                    "version": 1,
                    "id": self.id,
                    "replaces": self.replaces,
                    "config": self.config,
                    "step": self.step,
                },
                indent=1,
            ).encode()
            + b"\n"
        )


@dataclass(frozen=True)
class Resolved:
    """What a load of a path reads: tierckpt checkpoint ``id``, or (``foreign``) the path itself."""

    id: str | None
    foreign: bool = False


def _fs(path: str | os.PathLike) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(os.fspath(path))


def read_pointer(path: str | os.PathLike) -> Pointer | None:
    """The pointer at ``path`` (links followed); ``None`` when nothing is there. Raises
    :class:`NotAPointer` when a file is there that is not a pointer (a framework's own checkpoint)."""
    fs, p = _fs(path)
    try:
        if not fs.isfile(p):
            if fs.exists(p):
                raise NotAPointer(f"{path} is a directory, not a tierckpt pointer")
            return None
        with fs.open(p, "rb") as f:
            raw = f.read(_MAX_POINTER + 1)
    except FileNotFoundError:
        return None
    try:
        d = json.loads(raw) if len(raw) <= _MAX_POINTER else None
    except ValueError:
        d = None
    if not isinstance(d, dict) or d.get("format") != _MAGIC:
        raise NotAPointer(f"{path} is not a tierckpt pointer")
    try:
        return Pointer(
            id=check_checkpoint_id(d["id"]),
            replaces=d.get("replaces"),
            config=str(d.get("config") or ""),
            step=d.get("step"),
        )
    except (KeyError, TierckptError) as e:
        raise TierckptError(f"{path}: a malformed tierckpt pointer ({e})") from None


def write_pointer(path: str | os.PathLike, pointer: Pointer) -> None:
    """Write ``pointer`` at ``path`` atomically (a temporary file renamed over it; parents made)."""
    fs, p = _fs(path)
    parent = p.rsplit("/", 1)[0] if "/" in p else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if fs.isdir(p):
        raise TierckptError(
            f"cannot write the tierckpt pointer {path}: a directory is there (a checkpoint "
            "saved without tierckpt?); remove it or save under another name"
        )
    tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(pointer.encode())
    fs.mv(tmp, p)


class NotAPointer(TierckptError):
    """A path holds something other than a tierckpt pointer."""


class PathMap:
    """Paths <-> tierckpt checkpoints for one framework plugin (see the module docstring).

    ``writer``: the plugin's writer (its engine's tiers are where deletions run).
    """

    def __init__(self, writer: TieredWriter) -> None:
        self.writer = writer
        self.cfg = writer.cfg
        self.deletions = Deletions(writer)
        self._saves: dict[str, RankSave] = {}  # id -> its save in this process

    # -- saving (the saving rank) --------------------------------------------------------------
    def new_id(self, path: str | os.PathLike) -> tuple[str, str | None]:
        """(the id for a save to ``path``, the id it replaces or ``None``)."""
        name = check_checkpoint_id(checkpoint_id_of(path))
        try:
            old = read_pointer(path)
        except NotAPointer:
            old = None  # a framework's own file: the pointer replaces it
        if old is None and name not in self._saves:
            return name, None
        prev = old.id if old is not None else name
        m = _VERSION_RE.match(prev)
        n = int(m.group(2)) + 1 if m and m.group(1) == name else 1
        cid = f"{name}+{n}"
        while cid in self._saves:
            n += 1
            cid = f"{name}+{n}"
        return check_checkpoint_id(cid), prev

    def saved(
        self,
        path: str | os.PathLike,
        checkpoint_id: str,
        job: RankSave | None,
        replaces: str | None,
        step: int | None = None,
    ) -> None:
        """After the save of ``checkpoint_id`` returned: write its pointer at ``path``; queue the
        deletion of the checkpoint it replaces (once this one is committed on every tier)."""
        if job is not None:
            self._saves[checkpoint_id] = job
        write_pointer(path, Pointer(checkpoint_id, replaces, self.cfg.source or "", step))
        if replaces is not None:
            self.deletions.delete(replaces, job.replicated if job is not None else None, unless_failed=True)

    def remove(self, path: str | os.PathLike) -> None:
        """The framework deletes ``path``: its pointer now, its checkpoint in the background."""
        try:
            ptr = read_pointer(path)
        except NotAPointer:
            log.warning("not deleting %s: it is not a tierckpt pointer", path)
            return
        cid = ptr.id if ptr is not None else checkpoint_id_of(path)
        fs, p = _fs(path)
        if ptr is not None:
            fs.rm(p)
        job = self._saves.pop(cid, None)
        self.deletions.delete(cid, job.replicated if job is not None else None)

    # -- loading (any rank) --------------------------------------------------------------------
    def committed(self, checkpoint_id: str) -> bool:
        """Whether some tier of the chain holds ``checkpoint_id`` committed."""
        chain = self.writer.engine.chain
        return any(is_committed(chain[i], checkpoint_id) for i in range(len(chain)))

    def resolve(self, path: str | os.PathLike) -> Resolved:
        """What a load of ``path`` reads (see the module docstring); raises
        :class:`~tierckpt.errors.CheckpointNotFound` when no tier holds it."""
        try:
            ptr = read_pointer(path)
        except NotAPointer:
            return Resolved(None, foreign=True)
        cid = ptr.id if ptr is not None else check_checkpoint_id(checkpoint_id_of(path))
        if self.committed(cid):
            return Resolved(cid)
        if ptr is not None and ptr.replaces and self.committed(ptr.replaces):
            log.warning(
                "%s: checkpoint %s was never committed (the job stopped first); loading %s, which it was to replace",
                path,
                cid,
                ptr.replaces,
            )
            return Resolved(ptr.replaces)
        if LAST_NAME.match(os.path.basename(os.fspath(path))):
            newest = latest(self.cfg)
            if newest is not None:
                log.warning(
                    "%s: checkpoint %s was never committed (the job stopped first); loading the newest "
                    "committed checkpoint, %s",
                    path,
                    cid,
                    newest,
                )
                return Resolved(newest)
        raise CheckpointNotFound(
            f"{path}: checkpoint {cid} is not committed on any tier of {self.cfg.source or 'the configuration'}"
        )

    # -- the end -------------------------------------------------------------------------------
    def close(self, quietly: bool = False) -> None:
        """Wait for every save of the writer to commit and every deletion asked for to run;
        raise the first failure (with ``quietly``: log it)."""
        try:
            self.writer.close()
            self.deletions.wait()
        except BaseException as e:
            if not quietly:
                raise
            log.error("tierckpt: %s", e)
