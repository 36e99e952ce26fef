"""Kill points and injected faults inside the tiers, for ``tools/chaos.py`` (testing only).

A :class:`TierProxy` wraps a real tier of the engine's chain (the local or the S3 tier) and routes every
write-side operation through a *controller*'s ``around(tier, op, key, fn)``, which runs ``fn``
(the real operation) and may kill the process or raise before, during or after it. Reads,
listings and attributes (``root``, ``url``, ``name``...) go straight to the real tier.

Operations (``tier.op``)::

    local.open      open_sink (the capture of a checkpoint starts)
    local.write     DataSink.write_at of one chunk (flush)
    local.close     DataSink.close (fsync + rename of the data file)
    local.commit    put of ``ID/metadata.json`` (the commit)
    local.put       any other put
    local.delete    delete of one key (retention deletes metadata.json first)
    local.delete_prefix   delete_prefix (retention, one call per key prefix of a checkpoint)
    s3.upload       copy_from (replication of a rank's data file to S3)
    s3.commit       put of ``ID/metadata.json`` on S3
    s3.delete / s3.delete_prefix / s3.open / s3.write / s3.close / s3.put   as above
    save.return     ``dcp.save`` returned (the capture is still pending)

The trainer installs it with ``--chaos SPEC`` (``tools/train_gpt.py``), SPEC being comma-separated:

    kill=OP:K:WHEN    os._exit(137) at the K-th call of OP (1-based); WHEN is ``before`` (the call
                      never starts), ``after`` (it completed) or ``mid`` (the real call runs on a
                      thread and the process dies ``delay`` seconds into it)
    delay=SECONDS     for ``mid`` (default 0.02)
    count=PATH        write the number of calls per OP to PATH (JSON) after every call (a census)

``os._exit`` skips ``atexit``, ``finally`` blocks and buffered writes: to the library it is the
same as SIGKILL.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["TierProxy", "SinkProxy", "KillController", "FaultController", "install", "parse_spec", "METADATA_SUFFIX"]

METADATA_SUFFIX = "/metadata.json"
EXIT_CODE = 137


class Controller:
    """Counts calls per ``tier.op``; subclasses decide what happens around them."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _bump(self, name: str) -> int:
        with self._lock:
            self.counts[name] += 1
            return self.counts[name]

    def around(self, tier: str, op: str, key: str, fn: Callable[[], Any]) -> Any:
        self._bump(f"{tier}.{op}")
        return fn()


class KillController(Controller):
    """Kills the process (``os._exit(137)``) at the K-th call of one operation."""

    def __init__(
        self, point: str = "", k: int = 0, when: str = "before", delay: float = 0.02, count_path: str = ""
    ) -> None:
        super().__init__()
        if when not in ("before", "after", "mid"):
            raise ValueError(f"chaos: WHEN must be before, after or mid, got {when!r}")
        self.point, self.k, self.when, self.delay = point, k, when, delay
        self.count_path = count_path

    def _census(self) -> None:
        if not self.count_path:
            return
        with self._lock:
            data = json.dumps(dict(self.counts))
        tmp = f"{self.count_path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            f.write(data)
        os.replace(tmp, self.count_path)

    @staticmethod
    def die() -> None:
        os._exit(EXIT_CODE)

    def around(self, tier: str, op: str, key: str, fn: Callable[[], Any]) -> Any:
        name = f"{tier}.{op}"
        n = self._bump(name)
        self._census()
        if name != self.point or n != self.k:
            return fn()
        if self.when == "before":
            self.die()
        if self.when == "after":
            fn()
            self.die()
        # mid: the real call runs on its own thread; the process dies part of the way into it
        threading.Thread(target=_swallow(fn), name="chaos-mid", daemon=True).start()
        time.sleep(self.delay)
        self.die()
        return None  # pragma: no cover


def _swallow(fn: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except BaseException:  # noqa: BLE001 - the process is about to die anyway
            pass

    return run


class FaultController(Controller):
    """Raises ``OSError(errno)`` instead of running the K-th call of ``point`` (while armed).

    ``errno.ENOSPC`` is what a full disk gives ``pwrite``/``write``/``fallocate``; ``errno.EROFS``
    what a file system remounted read-only gives ``open``/``link``/``rename``. The error carries
    the key as its file name, like the real one would carry the path.
    """

    def __init__(self, point: str = "", k: int = 1, err: int = errno.ENOSPC) -> None:
        super().__init__()
        self.point, self.k, self.err = point, k, err
        self.armed = False
        self.fired: list[str] = []
        self._seen = 0

    def arm(self, point: str, k: int, err: int) -> None:
        with self._lock:
            self.point, self.k, self.err, self._seen, self.armed = point, k, err, 0, True
            self.fired = []

    def disarm(self) -> None:
        with self._lock:
            self.armed = False

    def around(self, tier: str, op: str, key: str, fn: Callable[[], Any]) -> Any:
        name = f"{tier}.{op}"
        self._bump(name)
        fire = False
        with self._lock:
            if self.armed and name == self.point:
                self._seen += 1
                fire = self._seen == self.k
        if fire:
            self.fired.append(key)
            raise OSError(self.err, os.strerror(self.err), key)
        return fn()


class SinkProxy:
    """A :class:`~tierckpt.tiers.base.DataSink` whose writes and close go through the controller."""

    def __init__(self, real: Any, tier: str, key: str, ctl: Controller) -> None:
        self._real, self._tier, self._key, self._ctl = real, tier, key, ctl

    def write_at(self, offset: int, data: memoryview) -> None:
        return self._ctl.around(self._tier, "write", self._key, lambda: self._real.write_at(offset, data))

    def close(self) -> None:
        return self._ctl.around(self._tier, "close", self._key, self._real.close)

    def abort(self) -> None:
        self._real.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class TierProxy:
    """Wraps a tier: write-side operations go through ``ctl.around``; everything else is the real tier's."""

    def __init__(self, real: Any, tier: str, ctl: Controller) -> None:
        self._real, self._tier, self._ctl = real, tier, ctl

    @property
    def real(self) -> Any:
        return self._real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __repr__(self) -> str:
        return f"TierProxy({self._real!r})"

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        op = "commit" if key.endswith(METADATA_SUFFIX) else "put"
        return self._ctl.around(self._tier, op, key, lambda: self._real.put(key, data, if_absent=if_absent))

    def open_sink(self, key: str, size: int) -> Any:
        sink = self._ctl.around(self._tier, "open", key, lambda: self._real.open_sink(key, size))
        return SinkProxy(sink, self._tier, key, self._ctl)

    def copy_from(self, src: Any, key: str) -> int:
        return self._ctl.around(self._tier, "upload", key, lambda: self._real.copy_from(src, key))

    def delete(self, key: str) -> None:
        return self._ctl.around(self._tier, "delete", key, lambda: self._real.delete(key))

    def delete_prefix(self, prefix: str) -> int:
        return self._ctl.around(self._tier, "delete_prefix", prefix, lambda: self._real.delete_prefix(prefix))


def parse_spec(spec: str) -> KillController:
    """``kill=OP:K:WHEN,delay=S,count=PATH`` -> a :class:`KillController`."""
    point, k, when, delay, count = "", 0, "before", 0.02, ""
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if name == "kill":
            bits = value.split(":")
            if len(bits) not in (2, 3):
                raise ValueError(f"chaos: kill=OP:K[:WHEN], got {value!r}")
            point, k = bits[0], int(bits[1])
            when = bits[2] if len(bits) == 3 else "before"
        elif name == "delay":
            delay = float(value)
        elif name == "count":
            count = value
        else:
            raise ValueError(f"chaos: unknown spec item {part!r}")
    return KillController(point, k, when, delay, count)


def wrap_engine(engine: Any, ctl: Controller) -> None:
    """Route every tier of ``engine``'s chain through ``ctl`` (the engine's seam: its chain)."""
    for i, name in enumerate(engine.chain.names):
        tier = engine.chain[i]
        if not isinstance(tier, TierProxy):
            engine.chain[i] = TierProxy(tier, name, ctl)


def install(writer: Any, spec: str) -> KillController:
    """Install the kill points of ``spec`` on ``writer``'s engine and around ``dcp.save``."""
    import torch.distributed.checkpoint as dcp

    ctl = parse_spec(spec)
    wrap_engine(writer.engine, ctl)
    real_save = dcp.save

    def save(*args: Any, **kwargs: Any) -> Any:
        out = real_save(*args, **kwargs)
        ctl.around("save", "return", str(kwargs.get("checkpoint_id", "")), lambda: None)
        return out

    dcp.save = save  # the trainer calls dcp.save through the module attribute
    return ctl
