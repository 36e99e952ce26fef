"""The error hierarchy of tierckpt.

Every error raised on purpose by tierckpt derives from :class:`TierckptError`, and most
also derive from the matching builtin so that callers' existing ``except`` clauses keep
working (``CheckpointNotFound`` is a ``FileNotFoundError``, ``ConfigError`` a ``ValueError``).
Messages name the file, key, rank or checkpoint at fault.
"""

from __future__ import annotations

import collections
import threading

__all__ = [
    "TierckptError",
    "ConfigError",
    "CheckpointNotFound",
    "CorruptCheckpoint",
    "InvalidCheckpointId",
    "ChecksumMismatch",
    "CheckpointBeingDeleted",
    "CommitConflict",
    "SaveError",
    "CaptureError",
    "TornCaptureError",
    "CaptureMismatch",
    "NonFiniteError",
    "CheckpointMarkedBad",
    "CommitError",
    "CheckInError",
    "ReplicationError",
    "CopiesPending",
    "TierError",
    "TierUnavailable",
    "TierUnreachable",
    "TierAccessDenied",
    "find_error",
]


class TierckptError(Exception):
    """Root of every error tierckpt raises on purpose."""


class ConfigError(TierckptError, ValueError):
    """A tier configuration file or object is invalid; the message names file, section and key."""


class CheckpointNotFound(TierckptError, FileNotFoundError):
    """No committed checkpoint with that id (or no committed checkpoint at all for ``latest``)."""


class CorruptCheckpoint(TierckptError, ValueError):
    """A checkpoint's metadata or layout is malformed, hostile or inconsistent."""


class InvalidCheckpointId(TierckptError, ValueError):
    """A checkpoint id that cannot name a checkpoint: not 1-200 characters of letters, digits and
    ``._-=+@`` starting with a letter or digit, or the reserved ``latest`` where an id is needed.

    Raised where ids enter (writer, reader, catalog, CLI) before any tier is touched. Not a
    :class:`CorruptCheckpoint`: the caller's argument is wrong, nothing stored is, so a resume loop
    that falls back on ``CorruptCheckpoint`` does not swallow it."""


class ChecksumMismatch(CorruptCheckpoint):
    """Bytes read back do not match the CRC32C written with them."""


class CheckpointBeingDeleted(CheckpointNotFound, CorruptCheckpoint):
    """The checkpoint cannot be loaded (read, fetched) from a tier: a deletion of it (retention or
    ``gc``, in any process) left a live tombstone there, either because it runs now or because it
    crashed and its tombstone has not expired yet (``_leases/ID/tomb-*.json``,
    :mod:`tierckpt.catalog.lease`). The message names the checkpoint, the tier, who deletes it and
    when the tombstone expires. ``latest`` skips such a checkpoint.

    A :class:`CheckpointNotFound` (it is going away) and a :class:`CorruptCheckpoint`, so that a
    resume loop that falls back to the next older checkpoint on ``CorruptCheckpoint``
    (docs/operations.md, "A bad newest checkpoint") falls back from it too."""


class CommitConflict(TierckptError, FileExistsError):
    """Another writer already committed (or is committing) the same checkpoint id."""


class SaveError(TierckptError, RuntimeError):
    """A checkpoint's background save failed; the subclass names the stage."""


class CaptureError(SaveError):
    """Capturing a checkpoint into host memory, or flushing it to the first tier, failed."""


class TornCaptureError(CaptureError):
    """A tensor was modified in place while its copy to host memory was still pending."""


class CaptureMismatch(CaptureError):
    """``[job] verify_capture``: the host copy of a tensor does not match the digest taken of the
    source tensor on its device (a flip in the device-to-host copy or the host buffer, or the
    source changed while it was copied); the checkpoint is not committed."""


class NonFiniteError(CaptureError):
    """``[job] nonfinite = "refuse"``: a floating tensor held NaN or Inf; the checkpoint is not committed."""


class CheckpointMarkedBad(TierckptError):
    """A checkpoint was marked bad (``tierckpt-restore mark ID bad`` or a failed resume check)."""


class CommitError(SaveError):
    """A checkpoint could not be committed on a tier: a rank failed, died or timed out in the commit
    protocol, its data file vanished before the commit, or the metadata could not be written."""


class CheckInError(SaveError):
    """A rank of a ``dcp.save`` or ``dcp.load`` did not reach a check-in within ``[job]
    commit_timeout`` (dead, hung, or failed before it): the message names it. Logged at ERROR on
    every other rank, never raised (:mod:`tierckpt.chain.checkin`): DCP's collective that follows
    fails on a dead rank with an error naming none, and succeeds when the rank was only late."""


class ReplicationError(SaveError):
    """Copying a committed checkpoint down the chain (local to S3, ...) or committing it there failed.
    The checkpoint stays committed on the tiers it reached."""


class CopiesPending(ReplicationError):
    """Raised by ``wait()``: the checkpoints it waited for are committed on the first tier, but their
    copies to later tiers failed and are still owed (the backlog that the next copy, or the next job
    with this configuration, makes first). The message names what is committed where and what is
    pending; ``__cause__`` is the last copy error (an outage, a denial).

    Attributes:
        committed_on: the tier every pending checkpoint is committed on (the chain's first).
        pending: tier name -> the checkpoint ids it lacks, oldest first.
        causes: tier name -> the text of the last error copying to it.
    """

    def __init__(
        self,
        message: str,
        *,
        committed_on: str = "",
        pending: dict[str, list[str]] | None = None,
        causes: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.committed_on = committed_on
        self.pending = dict(pending or {})
        self.causes = dict(causes or {})


class TierError(TierckptError, OSError):
    """A storage tier operation failed (I/O error, disk full, S3 error after retries)."""


class TierUnavailable(TierError):
    """A tier cannot be reached or is not configured (e.g. an optional dependency is missing)."""


class TierUnreachable(TierUnavailable):
    """A tier cannot be reached right now (connection refused or timed out, a server error): it may
    come back by itself, unlike a tier that answers "no" (:class:`TierAccessDenied`, a missing
    bucket, a path that cannot be a directory). Raised by :meth:`Tier.probe
    <tierckpt.tiers.base.Tier.probe>`."""


class TierAccessDenied(TierError, PermissionError):
    """A storage tier refused the request for lack of permission or valid credentials.

    On S3: ``AccessDenied`` (the key may not do this, e.g. a read-only key writing), an unknown
    access key id, a secret key that does not match it, an expired session token, or no
    credentials at all. Never retried: repeating the request cannot help. The message names
    the operation and the ``s3://`` url (bucket and key) and never any part of a credential.
    Also a :class:`PermissionError`.
    """


_metadata_errors: collections.deque[tuple[str, BaseException]] = collections.deque(maxlen=4)
_metadata_errors_lock = threading.Lock()


def note_metadata_error(exc: BaseException) -> None:
    """The reader's ``read_metadata`` (any thread) records what it raised: ``dcp.load`` (torch
    2.13+) replaces that error with an ``AssertionError`` carrying only its text ("metadata is
    None; global metadata read failed: ..."), which :func:`find_error` then maps back to it. The
    last four are kept, without their tracebacks' frames being needed by anyone."""
    text = str(exc)
    if text:
        with _metadata_errors_lock:
            _metadata_errors.append((text, exc))


def _named_in(e: BaseException) -> list[BaseException]:
    """The recorded metadata errors whose text ``e``'s message quotes (see :func:`note_metadata_error`)."""
    if e.__cause__ is not None or not e.args or not isinstance(e.args[0], str):
        return []
    with _metadata_errors_lock:
        known = list(_metadata_errors)
    return [x for text, x in reversed(known) if x is not e and text in e.args[0]]


def find_error(exc: BaseException, cls: type | tuple[type, ...] = TierckptError) -> BaseException | None:
    """``exc`` itself, or the first ``cls`` inside it: DCP wraps what a storage reader or writer
    raises in its ``CheckpointException`` (``failures``: per rank), and errors chain through
    ``__cause__``/``__context__``; a metadata error that ``dcp.load`` kept only the text of is
    found by that text (:func:`note_metadata_error`). None if there is none. For callers of
    ``dcp.load``/``dcp.save`` that must tell a damaged checkpoint (:class:`CorruptCheckpoint`)
    from an outage."""
    seen: list[BaseException] = []
    todo: list = [exc]
    while todo:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, cls):
            return e
        for v in (getattr(e, "failures", None) or {}).values():
            todo.append(v[0] if isinstance(v, tuple) else v)
        todo += [e.__cause__, e.__context__, *_named_in(e)]
    return None
