"""tierckpt's own stderr handler, for applications that configure no logging.

Python prints a library's WARNINGs through its "last resort" handler when nobody configured
logging: the bare message, with no logger name, level or rank, and nothing below WARNING (so
``[job] log_level = "INFO"`` showed nothing). :func:`install` attaches one :class:`DefaultHandler`
to the ``tierckpt`` logger when neither that logger nor the root logger has a handler; the handler
writes ``tierckpt.<module> LEVEL [rank R] message`` to stderr.

Contract: it never duplicates a line. At every record it checks the loggers the record passes
through (the record's own logger up to the root, as :meth:`logging.Logger.callHandlers` does):
when any of them holds another handler (the application called ``logging.basicConfig`` or added
its own handler, before or after tierckpt was imported), this handler stays silent and the
application's handler prints the record. ``propagate`` is never changed.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["DefaultHandler", "install", "rank_label"]

FORMAT = "%(name)s %(levelname)s %(tierckpt_rank)s%(message)s"


def rank_label() -> str:
    """``"[rank R] "`` for this process: the initialized process group's rank, else ``$RANK``; else ``""``.

    Never imports torch (``tierckpt.catalog`` and the restore CLI run without it).
    """
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return f"[rank {dist.get_rank()}] "
    except Exception:  # noqa: BLE001 - a torn-down group: fall back to the environment
        pass
    rank = os.environ.get("RANK")
    return f"[rank {rank}] " if rank else ""


class DefaultHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stderr handler that prints only while no other handler would print the same record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(FORMAT))

    def _others_handle(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False

    def emit(self, record: logging.LogRecord) -> None:
        """Write ``record`` to the current ``sys.stderr`` unless another handler on its path prints it."""
        if self._others_handle(record):
            return
        record.tierckpt_rank = rank_label()
        self.stream = sys.stderr  # follows redirections made after import (pytest's capsys, contextlib)
        super().emit(record)


def install() -> DefaultHandler | None:
    """Attach a :class:`DefaultHandler` to the ``tierckpt`` logger if neither it nor root has a handler.

    Returns the handler attached, or ``None`` when logging was already configured (then nothing is
    attached, ever: the application's configuration prints tierckpt's records). Idempotent.
    """
    pkg = logging.getLogger("tierckpt")
    if any(isinstance(h, DefaultHandler) for h in pkg.handlers):
        return None
    if pkg.handlers or logging.getLogger().handlers:
        return None
    handler = DefaultHandler()
    pkg.addHandler(handler)
    return handler
