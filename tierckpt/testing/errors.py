"""Finding errors inside DCP's wrappers: ``CheckpointException.failures``, causes and contexts."""

from __future__ import annotations

from typing import Any

__all__ = ["errors_in", "find_error", "err_text"]


def errors_in(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes/contexts and the failures wrapped by DCP's CheckpointException, each
    once, depth first (``exc`` first)."""
    seen: list[BaseException] = []
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if e is None or not isinstance(e, BaseException) or any(e is s for s in seen):
            continue
        seen.append(e)
        for v in (getattr(e, "failures", None) or {}).values():
            todo.append(v[0] if isinstance(v, tuple) else v)
        todo += [e.__cause__, e.__context__]
    return seen


def find_error(exc: BaseException, cls: type) -> BaseException | None:
    """``exc`` itself, or the first ``cls`` in :func:`errors_in` order; None if there is none."""
    for e in errors_in(exc):
        if isinstance(e, cls):
            return e
    return None


def err_text(e: BaseException, limit: int = 2000) -> str:
    """``"TypeName: message"``, cut to ``limit`` characters (JSON-able, for results of other processes)."""
    return f"{type(e).__name__}: {e}"[:limit]
