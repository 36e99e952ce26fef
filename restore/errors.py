"""The one place where known exceptions become clean one-line messages and exit codes.

Exit codes:

* ``0`` success;
* ``1`` not found (no such checkpoint, nothing committed, no matching keys) or verification
  failed (checksum mismatch, size mismatch, corrupt metadata);
* ``2`` usage, configuration or credentials (bad arguments, bad config file, missing or refused
  credentials, access denied: :class:`~tierckpt.errors.TierAccessDenied`; running again without
  a change cannot help);
* ``3`` anything else (a tier unreachable, an S3 error, a local I/O error, an internal error);
* ``130`` interrupted (Ctrl-C); a ``fetch`` can be resumed by running it again.

``TIERCKPT_DEBUG=1`` prints the traceback under the message.

Nothing printed here holds a secret: the message and the traceback go through
:func:`tierckpt.redact.redact` (URLs lose user information and query strings, secret-named
values are masked), whatever raised the exception.
"""

from __future__ import annotations

import os
import sys
import traceback

from tierckpt.config.redact import redact
from tierckpt.errors import (
    CheckpointNotFound,
    ChecksumMismatch,
    CommitConflict,
    ConfigError,
    CorruptCheckpoint,
    InvalidCheckpointId,
    TierAccessDenied,
    TierckptError,
    TierError,
    TierUnavailable,
)

__all__ = [
    "DEBUG_ENV",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_OTHER",
    "EXIT_USAGE",
    "NotFound",
    "UsageError",
    "VerificationFailed",
    "classify",
    "report",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_OTHER = 3
EXIT_INTERRUPTED = 130
DEBUG_ENV = "TIERCKPT_DEBUG"
PROG = "tierckpt-restore"


class UsageError(TierckptError, ValueError):
    """The request cannot be carried out as asked (wrong combination of options, unsupported output)."""


class NotFound(TierckptError, LookupError):
    """Something asked for (keys, ranks) does not exist in the checkpoint."""


class VerificationFailed(TierckptError):
    """A checkpoint failed verification; the details were already reported."""


MAX_MESSAGE = 2000
"""Longest error line printed (a hostile file or server cannot flood the terminal)."""


def _one_line(text: str) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3] + "..."


def _botocore_message(e: BaseException) -> tuple[str, int] | None:
    """Message and code for botocore/boto3 errors that escaped the tier's own mapping."""
    try:
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover - boto3 is a dependency
        return None
    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return f"S3 credentials: {e} (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)", EXIT_USAGE
    if isinstance(e, bx.EndpointConnectionError):
        return f"cannot reach the S3 endpoint: {e}", EXIT_OTHER
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = err.get("Code", "error")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        return f"S3 {e.operation_name} failed: {code} (HTTP {status}): {err.get('Message', '')}".rstrip(
            ": "
        ), EXIT_OTHER
    if isinstance(e, bx.BotoCoreError):
        return f"S3: {type(e).__name__}: {e}", EXIT_OTHER
    return None


def classify(e: BaseException) -> tuple[str, int]:
    """The one-line message and exit code for exception ``e`` (the message redacted)."""
    msg, code = _classify(e)
    return redact(msg), code


def _classify(e: BaseException) -> tuple[str, int]:
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", EXIT_INTERRUPTED
    if isinstance(e, (UsageError, ConfigError, InvalidCheckpointId)):
        return str(e), EXIT_USAGE
    if isinstance(e, (CheckpointNotFound, NotFound)):
        return str(e), EXIT_FAILED
    if isinstance(e, ChecksumMismatch):
        return f"verification failed: {e}", EXIT_FAILED
    if isinstance(e, VerificationFailed):
        return str(e), EXIT_FAILED
    if isinstance(e, CorruptCheckpoint):
        return f"corrupt checkpoint: {e}", EXIT_FAILED
    if isinstance(e, CommitConflict):
        return f"conflict: {e}", EXIT_OTHER
    if isinstance(e, TierAccessDenied):
        return f"storage error: {e}", EXIT_USAGE
    if isinstance(e, TierUnavailable):
        return f"tier unavailable: {e}", EXIT_OTHER
    if isinstance(e, TierError):
        return f"storage error: {e}", EXIT_OTHER
    if isinstance(e, TierckptError):
        return str(e), EXIT_OTHER
    boto = _botocore_message(e)
    if boto is not None:
        return boto
    if isinstance(e, MemoryError):
        return "out of memory", EXIT_OTHER
    if isinstance(e, OSError):
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        return f"{where}{e.strerror or e}", EXIT_OTHER
    return f"internal error: {type(e).__name__}: {e} (set {DEBUG_ENV}=1 for the traceback)", EXIT_OTHER


def report(e: BaseException, hint: str = "") -> int:
    """Print ``e`` as one line on stderr (plus the traceback with ``TIERCKPT_DEBUG=1``); return the exit code.

    Both are redacted (:func:`tierckpt.redact.redact`).
    """
    try:
        msg, code = classify(e)
    except Exception as inner:  # noqa: BLE001 - e.g. a hostile __str__: still one line and an exit code
        msg, code = f"internal error: {type(e).__name__} (and {type(inner).__name__} while describing it)", EXIT_OTHER
    if hint and code == EXIT_INTERRUPTED:
        msg = f"{msg}; {hint}"
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        sys.stderr.write(redact(text))
    print(f"{PROG}: error: {_one_line(redact(msg))}", file=sys.stderr)
    return code
