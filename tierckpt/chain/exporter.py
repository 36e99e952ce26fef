"""``[export] every = N``: a Hugging Face folder of every Nth committed checkpoint, in the background.

The engine calls :meth:`BackgroundExporter.after_commit` on its commit thread once a checkpoint
is committed on the first tier. On rank 0 (one export per job; with ``{node}`` in ``[export] path``,
on each node's metadata writer instead: a folder per node), for
checkpoints whose commit sequence number is a multiple of ``every``, that leases the checkpoint
on the first tier (one small write, so that the next commit's retention cannot delete it before
the export reads it) and queues it; it never waits for an export and never raises, so a commit is
never failed and barely delayed. The ``tierckpt-export`` thread starts one worker *process*
(``python -m restore.exportworker``, in its own process group) and waits for it. The worker gets
the configuration on its standard input, lowers its own priority (``nice`` 19, ``SCHED_IDLE``, the
idle I/O class through ``ionice`` where it exists, one thread), and runs :func:`restore.export.export_hf`, which reads
the committed checkpoint from the fastest tier holding it (never the training ranks' memory)
under its own leases, and publishes the folder atomically.

One export runs at a time per exporting rank; when checkpoints commit faster than they export, only the
newest waiting one is kept (the others are skipped, logged, their leases released). A worker that
fails (its exit status and the last lines of its standard error) is logged at WARNING at once and
reported at the next ``wait()`` as an :class:`ExportWarning`: the checkpoint itself is committed
and unaffected. At exit the engine waits only until a queued export's worker is started
(:meth:`BackgroundExporter.close`); a running worker is not waited for: it finishes on its own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from ..catalog import lease as leases
from ..config import Config
from ..errors import TierckptError
from ..tiers.base import Tier

__all__ = ["BackgroundExporter", "ExportFailed", "ExportWarning", "config_document"]

log = logging.getLogger("tierckpt.export")

STDERR_TAIL = 2000  # characters of a failed worker's standard error kept in its warning


class ExportWarning(UserWarning):
    """A background export failed (the checkpoint it was made from is committed and fine)."""


class ExportFailed(TierckptError):
    """A background export worker exited with an error (its exit status and standard error)."""


def config_document(cfg: Config) -> dict[str, Any]:
    """``cfg`` as the mapping :func:`tierckpt.config.sections.config_from_dict` reads back
    (present sections only, registered tier sections included)."""
    doc: dict[str, Any] = {}
    for name in ("job", "host", "local", "s3", "peer", "export"):
        sec = getattr(cfg, name)
        if sec is not None:
            doc[name] = dataclasses.asdict(sec)
    for name, sec in cfg.sections.items():
        doc[name] = dataclasses.asdict(sec)
    return doc


class BackgroundExporter:
    """The per-engine exporter (see the module docstring). ``first_tier``: where checkpoints are
    committed; a checkpoint to export is leased there right after its commit, on the commit
    thread, and released once its worker exited (or a newer checkpoint replaced it in the queue);
    the worker takes its own leases when it starts reading, so retention cannot delete it in
    between. ``spawn``: how a worker is started (``subprocess.Popen``'s signature)."""

    def __init__(
        self,
        cfg: Config,
        first_tier: Callable[[], Tier] | None = None,
        spawn: Callable[..., subprocess.Popen] = subprocess.Popen,
        on_done: Callable[[str, float, float, dict | None, str | None], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self._on_done = on_done  # (checkpoint id, wall start, wall end, the worker's result, error): telemetry
        self._first_tier = first_tier
        self.every = cfg.export.every
        self.per_node = "{node}" in cfg.export.path  # a folder per node, else one export per job
        self._spawn = spawn
        self._cond = threading.Condition()
        self._waiting: tuple[str, leases.Lease | None] | None = None  # the newest waiting export, leased
        self._running: str | None = None
        self._launching = False  # a worker is being started (its input not yet written)
        self._errors: list[str] = []
        self.done: list[str] = []  # checkpoints exported by this process's workers, in order
        self.results: list[dict] = []  # their figures (restore.export.ExportResult.to_json), in order
        self.proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def wants(self, checkpoint_id: str, seq: int, rank: int, writer: int) -> bool:
        """Whether this rank exports ``checkpoint_id``: the commit sequence number ``seq`` is a
        multiple of ``every`` and this rank is the job's exporter: rank 0 (one export per job),
        or, when ``[export] path`` names ``{node}`` (a folder per node), its node's metadata
        writer. One writer per destination: exports of every node into one S3 prefix or shared
        directory would each abort and replace the others' files."""
        if self.every <= 0 or seq <= 0 or seq % self.every != 0:
            return False
        return rank == writer if self.per_node else rank == 0

    def after_commit(self, checkpoint_id: str, seq: int, rank: int, writer: int) -> None:
        """Called on the commit thread after a commit: if this rank exports the checkpoint, lease it
        on the first tier (one small write, before the next commit can let retention delete it)
        and queue it. Returns at once otherwise; never raises (an error is logged and reported)."""
        try:
            if not self.wants(checkpoint_id, seq, rank, writer):
                return
            lease = None
            if self._first_tier is not None:
                tier = self._first_tier()
                try:
                    lease = leases.acquire(tier, checkpoint_id, kind="export", purpose="background export")
                except TierckptError as e:
                    self._fail(checkpoint_id, f"cannot lease it on {tier.url}: {e}")
                    return
            with self._cond:
                if self._waiting is not None:
                    old, old_lease = self._waiting
                    log.warning(
                        "export of %s skipped: checkpoints commit faster than they export (%s is newer)",
                        old,
                        checkpoint_id,
                    )
                    if old_lease is not None:
                        old_lease.release()
                self._waiting = (checkpoint_id, lease)
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="tierckpt-export", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
        except Exception as e:  # noqa: BLE001 - the commit path must not fail for an export
            log.warning("could not queue the export of %s: %s", checkpoint_id, e)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None:
                    self._cond.wait()
                (cid, lease), self._waiting = self._waiting, None
                self._running = cid
                self._launching = True
            start, result, error = time.time(), None, None
            try:
                result = self._export(cid)
            except Exception as e:  # noqa: BLE001 - reported, never raised into training
                error = f"{type(e).__name__}: {e}"
                self._fail(cid, error)
            finally:
                if self._on_done is not None:
                    try:
                        self._on_done(cid, start, time.time(), result, error)
                    except Exception as e:  # noqa: BLE001 - telemetry never fails anything
                        log.debug("export telemetry of %s failed: %s", cid, e)
                if lease is not None:
                    lease.release()
                with self._cond:
                    self._running = None
                    self._launching = False
                    self._cond.notify_all()

    def _export(self, cid: str) -> dict:
        """Run the worker for ``cid``; its result (figures) or :class:`ExportFailed`."""
        doc = json.dumps({"config": config_document(self.cfg), "checkpoint_id": cid}).encode()
        env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["OMP_NUM_THREADS"] = "1"  # the worker yields its CPU to training (restore.exportworker)
        proc = self._spawn(
            [sys.executable, "-m", "restore.exportworker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            # its own process group: a Ctrl-C to the trainer's terminal does not reach it. Not its own
            # session: with sched_autogroup a new session is a new scheduling group, where its nice
            # would no longer rank it below training.
            process_group=0,
        )
        self.proc = proc
        assert proc.stdin is not None and proc.stderr is not None
        try:
            proc.stdin.write(doc)
        finally:
            proc.stdin.close()
            with self._cond:
                self._launching = False  # on its own from here: the trainer may exit
                self._cond.notify_all()
        proc.stdin = None  # written and closed above: communicate() only reads both pipes
        out, err = proc.communicate()
        if proc.returncode != 0:
            tail = err.decode("utf-8", "replace").strip()[-STDERR_TAIL:]
            raise ExportFailed(f"worker exited with status {proc.returncode}: {tail}")
        try:
            result = json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            result = {}
        log.info(
            "checkpoint %s exported to %s: %s shard(s), %s bytes in %.1f s",
            cid,
            result.get("out", self.cfg.export.path),
            len(result.get("shards", [])),
            result.get("bytes", "?"),
            float(result.get("seconds", 0.0)),
        )
        self.done.append(cid)
        self.results.append(result)
        return result

    def _fail(self, cid: str, why: str) -> None:
        msg = f"the background export of checkpoint {cid} ([export] path {self.cfg.export.path!r}) failed: {why}"
        log.warning("%s", msg)
        with self._cond:
            self._errors.append(msg)

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until no export runs or waits (tests and tools; training never calls it)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting is None and self._running is None, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """At exit (:meth:`Engine.close`): wait until the queued export, if any, has its worker
        started and its input written (at most ``timeout`` seconds), so that the last checkpoint's
        export is not lost with this process; the worker itself is not waited for."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._waiting is None and not self._launching, timeout):
                log.warning(
                    "the export of %s was not started before exit", self._waiting[0] if self._waiting else self._running
                )

    def warn(self) -> None:
        """Issue each export failure since the last call as an :class:`ExportWarning` (``wait()``)."""
        with self._cond:
            errors, self._errors = self._errors, []
        for msg in errors:
            warnings.warn(msg, ExportWarning, stacklevel=3)
