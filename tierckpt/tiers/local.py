"""The local tier: a directory, usually on node-local NVMe, sometimes on a shared file system.

Large objects are written with ``os.pwrite`` at planned offsets by several threads into a
``.partial`` file, fsynced, then renamed into place; small objects go through a temp file,
fsync and rename (``if_absent``: ``os.link``, which fails if the target exists). The directory
is fsynced after each rename so that the rename itself is durable.

Direct I/O (``[local] direct_io``, default ``"auto"``): a sink of a file of at least
:data:`~.localfs.DIRECT_WRITE_MIN` bytes (any size with ``direct_io = true``; smaller files are
written buffered and stay in the page cache for a quick resume) opens the file twice, once with
``O_DIRECT``. Of each ``write_at`` the part that is aligned to :data:`DIO_ALIGN` in file offset,
length and memory address (all of a pool slot but the file's last partial block) goes through
the direct descriptor: no page-cache copy, almost no CPU. Whatever is not aligned (the file's
tail, writes from unaligned buffers such as restore's fetch) goes through the buffered one;
the two never touch the same page. Large reads of ranges that are not in the page cache
(probed with ``mincore``) use ``O_DIRECT`` into a reused aligned bounce buffer and one copy
to the destination. A file system that refuses ``O_DIRECT`` (``EINVAL`` at open or at the
first transfer) is used buffered from then on, logged once per process; with
``direct_io = true`` the refusal is an error instead. fsync, rename and commit are the same
in both modes.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..errors import CheckpointNotFound, CommitConflict, TierError
from .base import DataSink, ObjectInfo, ResumableSink, Spare, Tier, check_key, spared_ids
from .localfs import (
    _O_DIRECT,
    _REFUSED,
    DIO_ALIGN,
    PARTIAL,
    TMP,
    TRASH,
    _janitor,
    _log_fallback,
    _tier_error,
    _unlink_quietly,
    drain_deletions,
    fsync_dir,
    open_new,
)
from .localreads import LocalReads
from .localsinks import _FileSink, _ResumableFile

__all__ = ["LocalTier", "fsync_dir", "drain_deletions", "open_new", "DIO_ALIGN"]

log = logging.getLogger("tierckpt")

STALE_FLOOR_S = 600.0
"""A leftover of an interrupted write goes only once untouched for this long, whatever the
configured ``[job] commit_timeout``: a slow live writer's file is never taken for one."""


class LocalTier(LocalReads, Tier):
    """A tier rooted at a directory. ``fsync=False`` skips fsyncs (tests, tmpfs).

    ``direct_io``: ``"auto"`` (use ``O_DIRECT`` where the file system accepts it), ``True``
    (require it) or ``False`` (buffered only); see the module docstring.
    """

    name = "local"
    cheap_listing = True

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        fsync: bool = True,
        node_local: bool = False,
        direct_io: bool | str = "auto",
        keep: int = 0,
        read_concurrency: int = 4,
    ) -> None:
        if direct_io not in (True, False, "auto"):
            raise ValueError(f"direct_io must be 'auto', True or False, got {direct_io!r}")
        self.root = Path(root)
        self.url = str(self.root)
        self.fsync = fsync
        self.node_local = node_local
        self.keep = keep
        self.read_concurrency = read_concurrency
        self.direct_io = direct_io
        # None: not tried yet; True: accepted; False: refused here (buffered from now on)
        self._direct_ok: bool | None = None if (direct_io and _O_DIRECT) else False
        if direct_io is True and not _O_DIRECT:
            raise TierError(errno.ENOTSUP, f"{self.root}: [local] direct_io = true, but this platform has no O_DIRECT")
        self._lock = threading.Lock()

    def _open_direct(self, path: Path, flags: int) -> int:
        """An ``O_DIRECT`` descriptor of ``path``, or -1 when direct I/O is off or refused here."""
        if self._direct_ok is False:
            return -1
        try:
            fd = os.open(path, flags | _O_DIRECT)
        except OSError as e:
            if e.errno not in _REFUSED:
                raise
            self._direct_refused(path, e)
            return -1
        if self._direct_ok is None:
            self._direct_ok = True
        return fd

    def _direct_refused(self, path: Path, e: OSError) -> None:
        """The file system under ``path`` refused ``O_DIRECT``: buffered from now on (``auto``) or
        a :class:`TierError` naming the file (``direct_io = true``)."""
        if self.direct_io is True:
            raise TierError(
                e.errno or errno.EINVAL,
                f"{path}: [local] direct_io = true, but the file system refuses O_DIRECT: {e.strerror or e}",
            )
        self._direct_ok = False
        _log_fallback(path, e)

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        final = self._path(key)
        tmp = final.with_name(f"{TMP}{uuid.uuid4().hex}-{final.name}")
        try:
            with open(open_new(tmp), "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            if if_absent:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    raise CommitConflict(f"{final} already exists: another writer committed it") from None
                finally:
                    os.unlink(tmp)
            else:
                os.replace(tmp, final)
            if self.fsync:
                fsync_dir(final.parent)
        except OSError as e:
            _unlink_quietly(tmp)
            if isinstance(e, CommitConflict):
                raise
            raise _tier_error(e, f"cannot write {final}") from e

    def put_volatile(self, key: str, data: bytes) -> None:
        """Atomic replace without fsync (leases: they only matter while their holder lives)."""
        final = self._path(key)
        tmp = final.with_name(f"{TMP}{uuid.uuid4().hex}-{final.name}")
        try:
            with open(open_new(tmp), "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except OSError as e:
            _unlink_quietly(tmp)
            raise _tier_error(e, f"cannot write {final}") from e

    def probe(self) -> None:
        """See :meth:`Tier.probe`: create the root directory if needed, then create, write and
        remove one small file in it (named like a small put's temporary file, so listings skip it
        and :meth:`abort_stale` removes one left by a crash). Fails for root too where the path
        cannot be a directory (a component is a file) or the file system is read-only."""
        tmp = self.root / f"{TMP}probe-{uuid.uuid4().hex}"
        try:
            fd = open_new(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                os.write(fd, b"tierckpt probe\n")
            finally:
                os.close(fd)
            os.unlink(tmp)
        except OSError as e:
            _unlink_quietly(tmp)
            what = f"[{self.name}] path {self.root}: cannot store checkpoints there"
            if isinstance(e, (FileExistsError, NotADirectoryError)):
                what += " (it, or a directory above it, is a file)"
            raise _tier_error(e, what) from None

    def root_id(self) -> str:
        return str(self.root.resolve())

    def free_bytes(self) -> int | None:
        import shutil

        p = self.root
        while not p.exists() and p != p.parent:
            p = p.parent
        try:
            return shutil.disk_usage(p).free
        except OSError:
            return None

    def open_sink(self, key: str, size: int, *, exclusive: bool = False) -> DataSink:
        """See :meth:`Tier.open_sink`. ``exclusive``: fail with ``EEXIST`` (a :class:`TierError`)
        if the ``.partial`` exists, i.e. another writer is at it (a fill during a load), instead
        of starting it over (a save resumed under its own id)."""
        return _FileSink(self, key, size, exclusive)

    def upload_file(self, key: str, path: str, *, progress=None) -> None:
        """Copy a local file into this tier (``.partial``, fsync, rename)."""
        import shutil

        final = self._path(key)
        if Path(path).resolve() == final.resolve():
            return
        tmp = final.with_name(final.name + PARTIAL)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, tmp)
            if self.fsync:
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if self.fsync:
                fsync_dir(final.parent)
        except OSError as e:
            _unlink_quietly(tmp)
            raise _tier_error(e, f"cannot copy {path} to {final}") from e
        if progress is not None:
            progress(os.path.getsize(final))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFound(f"{self._path(key)}: no such file") from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if not self.root.is_dir():
            return
        base = self.root
        start = base
        if "/" in prefix:
            start = base.joinpath(*prefix.rsplit("/", 1)[0].split("/"))
            if not start.is_dir():
                return
        for dirpath, dirs, files in os.walk(start, onerror=self._walk_error):
            # ext4's lost+found (root's, mode 0700) when the tier is a mount point: never ours
            dirs[:] = [d for d in dirs if not d.startswith(TRASH) and not (d == "lost+found" and dirpath == str(base))]
            for fn in files:
                if fn.startswith(TMP):
                    continue  # a small put in progress (or killed): never an object
                # ``.partial`` files (a large object being written, or left by a crash) are listed
                # under their own name so that cleanup can see half-written checkpoints.
                full = Path(dirpath) / fn
                key = full.relative_to(base).as_posix()
                if key.startswith(prefix):
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue
                    yield ObjectInfo(key, st.st_size, st.st_mtime)

    @staticmethod
    def _walk_error(e: OSError) -> None:
        """A directory :meth:`list` cannot read: a :class:`TierError` naming it (no permission,
        an I/O error), never a silently shorter listing; one removed meanwhile (a deletion) is
        skipped."""
        if isinstance(e, (FileNotFoundError, NotADirectoryError)):
            return
        hint = " (not readable by this process)" if e.errno in (errno.EACCES, errno.EPERM) else ""
        raise TierError(e.errno or 0, f"cannot list {e.filename}: {e.strerror or e}{hint}")

    def list_dirs(self) -> builtins.list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(TRASH))

    def delete(self, key: str) -> None:
        """Unlink one file, then remove the directories it leaves empty."""
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as e:
            raise _tier_error(e, f"cannot delete {path}") from e
        self._prune(path.parent)

    def _prune(self, d: Path) -> None:
        """Remove ``d`` and its parents up to the root while they are empty. A writer that
        creates a file in one meanwhile retries its mkdir (see :func:`open_new`)."""
        while d != self.root and d.is_relative_to(self.root):
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent

    def delete_many(self, keys: builtins.list[str]) -> int:
        """Move exactly these files into a ``.trash-*`` directory at the root (one rename each,
        cheap and atomic), remove directories left empty, and let the background janitor unlink
        the bytes (slow for large files) at background priority."""
        trash: Path | None = None
        parents: set[Path] = set()
        n = 0
        for key in keys:
            p = self._path(key)
            if trash is None:
                trash = self.root / f"{TRASH}{uuid.uuid4().hex[:8]}"
                try:
                    trash.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise _tier_error(e, f"cannot delete {p}") from e
            try:
                os.rename(p, trash / f"{n:06d}-{p.name}")
            except FileNotFoundError:
                continue
            except OSError as e:
                raise _tier_error(e, f"cannot delete {p}") from e
            n += 1
            parents.add(p.parent)
        for d in sorted(parents, key=lambda d: -len(d.parts)):
            self._prune(d)  # only when empty: a save that started since keeps its directory
        if trash is not None:
            _janitor.remove(trash)
            for old in self.root.glob(f"{TRASH}*"):
                if old != trash:
                    _janitor.remove(old)
        return n

    def delete_prefix(self, prefix: str) -> int:
        """Delete a whole checkpoint directory (leftover ``.partial``/temp files included).

        The directory is renamed away (``.trash-*``, invisible to listings) at once and removed
        by a background thread: unlinking gigabytes takes seconds on some file systems, and the
        commit path should not wait for it. Leftover trash from an earlier process is removed too.
        """
        if not prefix.endswith("/"):
            raise ValueError(f"delete_prefix needs a prefix ending with '/', got {prefix!r}")
        d = self._path(prefix.rstrip("/"))
        if not d.is_dir():
            return 0
        n = sum(len(files) for _p, _d, files in os.walk(d))
        trash = d.with_name(f"{TRASH}{d.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(d, trash)
        except OSError as e:
            raise _tier_error(e, f"cannot delete {d}") from e
        _janitor.remove(trash)
        for old in d.parent.glob(f"{TRASH}*"):
            if old != trash:
                _janitor.remove(old)
        return n

    # -- resumable writes, background deletions -------------------------------------------
    def open_resumable(
        self, key: str, size: int, *, block: int, tag: dict | None = None, adopt: bool = False
    ) -> ResumableSink:
        """See :meth:`Tier.open_resumable`. ``<file>.partial`` holds the bytes, the sidecar
        ``<file>.ranges.partial`` (JSON: ``tag`` + size, block as ``range_size``, recorded blocks as
        ``done``) the record, an ``flock`` on ``.tmp-<file>.lock`` keeps other processes out."""
        if block <= 0:
            raise ValueError(f"block must be positive, got {block}")
        return _ResumableFile(self, key, size, block, dict(tag or {}), adopt)

    def abort_stale(self, older_than_s: float, spare: Spare = ()) -> int:
        """Remove what writers that died left behind and nobody touched for ``older_than_s``
        seconds (at least :data:`STALE_FLOOR_S`): ``.partial`` files (a flush or a peer copy whose process was killed mid-file; a
        live writer keeps its file's mtime fresh, and its commit round gives up sooner) and
        ``.tmp-`` files of small puts. A fetch's resumable file (it has a ``.ranges.partial`` record)
        and its lock stay for the fetch that resumes it, and so does everything under a checkpoint
        id in ``spare`` (leased). Returns how many files went."""
        import time

        if not self.root.is_dir():
            return 0
        cutoff = time.time() - max(older_than_s, STALE_FLOOR_S)
        spare = set(spared_ids(spare))  # read first: a save's new files are younger than the cutoff
        n = 0
        for dirpath, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if not d.startswith(TRASH) and d not in spare]  # ID/ and _XX/ID/
            names = set(files)
            for fn in files:
                stale = (
                    fn.endswith(PARTIAL)
                    and not fn.endswith(".ranges" + PARTIAL)
                    and fn[: -len(PARTIAL)] + ".ranges" + PARTIAL not in names
                )
                stale = stale or (fn.startswith(TMP) and not fn.endswith(".lock"))
                path = Path(dirpath) / fn
                try:
                    if stale and path.stat().st_mtime < cutoff:
                        path.unlink()
                        n += 1
                        log.info(
                            "removed %s, left by an interrupted write (untouched for over %.0f s)", path, older_than_s
                        )
                except FileNotFoundError:
                    continue
                except OSError as e:
                    log.warning("cannot remove the stale %s: %s", path, e)
        return n

    def wait_deletions(self, timeout_s: float = 600.0) -> None:
        """Block until the background janitor removed what deletions renamed away."""
        drain_deletions(timeout_s)
