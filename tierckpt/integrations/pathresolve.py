"""Resolution of a framework's checkpoint path to the tierckpt checkpoint a load reads (the
"Resolution" paragraph of :mod:`tierckpt.integrations.pathmap`): the loading half of
:class:`~tierckpt.integrations.pathmap.PathMap`, a base class of it. Any rank may call
:meth:`PathResolution.resolve`; it reads pointer files and the tiers' listings, never a
collective.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..catalog.checkpoints import list_checkpoints
from ..catalog.health import unhealthy
from ..catalog.listing import is_committed
from ..config import TierConfig
from ..errors import CheckpointMarkedBad, CheckpointNotFound, TierckptError
from ..tiers import Tier
from .pointers import LAST_NAME, NotAPointer, _fs, _split_path, read_pointer

__all__ = ["RUN_SEP", "PathResolution", "Resolved"]

log = logging.getLogger("tierckpt")

RUN_SEP = "@"
"""Between a run's key and a checkpoint's name in an id (``ckpt-1f0e2d3c@epoch=1-step=200.ckpt``)."""


@dataclass(frozen=True)
class Resolved:
    """What a load of a path reads: tierckpt checkpoint ``id``, or (``foreign``) the path itself."""

    id: str | None
    foreign: bool = False


class PathResolution:
    """What a load of a path reads. The subclass (:class:`~tierckpt.integrations.pathmap.PathMap`)
    provides the configuration, the tiers, the run's ids and the lock guarding ``_known``."""

    cfg: TierConfig
    _lock: threading.Lock
    _known: tuple[int, str] | None  # (save order, id) of the newest committed one known here

    tiers: Callable[[], list[Tier]]  # the tier chain, fastest first
    run_of: Callable[[str | os.PathLike], str]  # the run key of ids saved to a path
    id_for: Callable[[str | os.PathLike], str]  # the id a save to a path gets without a pointer

    # -- loading (any rank) --------------------------------------------------------------------
    healthy: bool = True  # resolve() skips unhealthy checkpoints (tierckpt.catalog.health)

    def unhealthy(self, checkpoint_id: str) -> str | None:
        """Why ``checkpoint_id`` is unfit to resume from (None: fit, or ``healthy`` is False)."""
        if not self.healthy:
            return None
        return unhealthy(self.tiers(), checkpoint_id)

    def committed(self, checkpoint_id: str) -> bool:
        """Whether some tier of the chain holds ``checkpoint_id`` committed."""
        return any(is_committed(t, checkpoint_id) for t in self.tiers())

    def newest_of_run(self, path: str | os.PathLike) -> str | None:
        """The newest committed checkpoint of the run saving to ``path``: ids with its run key,
        and ids named by the pointers in the same directory (saved before namespacing)."""
        directory = _split_path(path)[0]
        prefix = self.run_of(path) + RUN_SEP
        named: set[str] = set()
        fs, d = _fs(directory)
        for e in fs.ls(d, detail=False) if fs.isdir(d) else []:
            try:
                ptr = read_pointer(e)
            except TierckptError:
                continue
            if ptr is not None:
                named.add(ptr.id)
        for c in reversed(list_checkpoints(self.cfg)):
            if (c.id.startswith(prefix) or c.id in named) and self.unhealthy(c.id) is None:
                return c.id
        return None

    def resolve(self, path: str | os.PathLike) -> Resolved:
        """What a load of ``path`` reads (see the module docstring); raises
        :class:`~tierckpt.errors.CheckpointNotFound` when no tier holds it."""
        try:
            ptr = read_pointer(path)
        except NotAPointer:
            return Resolved(None, foreign=True)
        name = _split_path(path)[1]
        if ptr is not None:
            wanted = ptr.id
            candidates = [ptr.id, ptr.replaces, ptr.fallback]
        else:
            wanted = self.id_for(path)
            candidates = [wanted, name]  # then an id saved before namespacing
        skipped: list[str] = []
        for cid in dict.fromkeys(c for c in candidates if c):
            if self.committed(cid):
                why = self.unhealthy(cid)
                if why is not None:
                    log.warning("%s: skipping checkpoint %s: %s", path, cid, why)
                    skipped.append(f"{cid}: {why}")
                    continue
                if ptr is not None and cid != wanted:
                    log.warning(
                        "%s: checkpoint %s %s; loading %s instead",
                        path,
                        wanted,
                        "is unhealthy" if skipped else "was never committed (the job stopped first)",
                        cid,
                    )
                self._note_loaded(cid)
                return Resolved(cid)
        last = LAST_NAME.match(name) is not None
        if last:
            newest = self.newest_of_run(path)
            if newest is not None:
                log.warning(
                    "%s: checkpoint %s %s; loading the run's newest %s checkpoint, %s",
                    path,
                    wanted,
                    "is unhealthy" if skipped else "was never committed (the job stopped first)",
                    "healthy" if skipped else "committed",
                    newest,
                )
                self._note_loaded(newest)
                return Resolved(newest)
        where = self.cfg.source or "the configuration"
        if skipped:
            raise CheckpointMarkedBad(
                f"{path}: no healthy checkpoint to load ({'; '.join(skipped)}); mark it good with "
                "tierckpt-restore mark ID good, or set healthy = False to load it anyway"
            )
        if last and ptr is not None:
            fs, p = _fs(path)
            try:
                fs.rm(p)
            except FileNotFoundError:
                pass
            raise CheckpointNotFound(
                f"{path}: checkpoint {wanted} is not committed on any tier of {where}, and no other checkpoint "
                "of this run is: the pointer was removed, so the next start begins from scratch "
                "(ckpt_path='last' finds nothing)"
            )
        raise CheckpointNotFound(f"{path}: checkpoint {wanted} is not committed on any tier of {where}")

    def _note_loaded(self, cid: str) -> None:
        with self._lock:
            if self._known is None:
                self._known = (0, cid)
