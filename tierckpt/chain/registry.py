"""The process's engines: one :class:`~tierckpt.chain.engine.Engine` per configuration, closed at exit.

Who calls: tests and the chaos harness
(:func:`register_engine`: an ``Engine(cfg, tiers=...)`` of their own; writers and readers
find theirs with :func:`tierckpt.chain.engine.get_engine`), a preemption drain
(:func:`live_engines`, lock-free: it may run while a signal handler interrupted the main thread
holding ``_engines_lock``), ``atexit`` (:func:`close_all`: waits for the checkpoints in flight).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any, Protocol

from ..config import Config
from ..errors import TierckptError

__all__ = ["close_all", "engine_key", "live_engines", "register_engine"]


class Engine(Protocol):
    """What the registry needs of an :class:`~tierckpt.chain.engine.Engine` (which imports this
    module and defines :func:`~tierckpt.chain.engine.get_engine` on top of it)."""

    cfg: Config
    chain: Any

    @property
    def closed(self) -> bool: ...

    def pending(self) -> list[Any]: ...

    def hurry(self) -> None: ...

    def close(self) -> None: ...


log = logging.getLogger("tierckpt")

_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def engine_key(cfg: Config) -> str:
    """The registry's key for ``cfg``: equal configurations of one process share an engine."""
    return repr((cfg.host, cfg.local, cfg.s3, cfg.job, cfg.peer, cfg.export, sorted(cfg.sections.items()), os.getpid()))


def register_engine(engine: Engine) -> Engine:
    """Make ``engine`` the one :func:`get_engine` returns for its configuration (the seam through
    which tests and the chaos harness give writers and readers an ``Engine(cfg, tiers=...)``).
    A previous engine of that configuration is closed first."""
    key = engine_key(engine.cfg)
    with _engines_lock:
        old = _engines.get(key)
        _engines[key] = engine
    if old is not None and old is not engine:
        old.close()
    return engine


def live_engines() -> list[Engine]:
    """Every engine of this process not closed yet (a preemption drain walks them).

    Takes no lock (a snapshot of the registry, atomic in CPython): a signal handler may call it
    while the main thread it interrupted holds ``_engines_lock``."""
    return [e for e in list(_engines.values()) if not e.closed]


def close_all() -> None:
    """Close every engine (waits for in-flight checkpoints). Registered with ``atexit``."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for e in engines:
        try:
            left = [j.id for j in e.pending()]
            if left:  # the exit waits for them: say so (the copy to S3 of a large one takes seconds)
                where = f"copying to {', '.join(e.chain.names[1:])}" if len(e.chain) > 1 else "being saved"
                log.warning(
                    "at exit: %d checkpoint(s) still %s (%s); the process ends once they are done",
                    len(left),
                    where,
                    ", ".join(left),
                )
            e.close()
        except TierckptError as err:
            log.error("at exit: %s", err)


atexit.register(close_all)
