"""torchtitan's checkpointing through tierckpt: one line of configuration.

In a torchtitan config function (``--module``/``--config``)::

    from tierckpt.integrations.torchtitan import TierckptCheckpointManager

    config.checkpoint = TierckptCheckpointManager.Config(
        enable=True, interval=500, tierckpt_config="tiers.toml", async_mode="async")

or keep the config and pass ``--checkpoint.tierckpt_config tiers.toml`` on the command line once the
checkpoint section is a :class:`TierckptCheckpointManager.Config` (see
``tools/torchtitan_example/tierckpt_llama3.py``).

What changes against torchtitan's :class:`~torchtitan.components.checkpointer.CheckpointManager`
(everything else, the trainer included, is unchanged; the trainer calls all of this):

* **Saves** (``dcp_save``) go through one :class:`~tierckpt.TieredWriter`; torchtitan's ids
  (``<dump>/<folder>/step-N``) become tierckpt ids ``step-N``. ``async_mode = "disabled"``:
  ``dcp.save`` returns once the state is *captured* (committed in the background: torchtitan's
  "Finished saving" then means captured); ``"async"``: DCP's thread executor;
  ``"async_with_pinned_mem"``: DCP's process executor (``AsyncCheckpointerType.PROCESS``), the
  writer as its own stager (it copies the state for the checkpoint process; torchtitan's
  ``DefaultStager`` needs an accelerator for its non-blocking copies), returning the
  ``AsyncSaveResponse`` torchtitan expects; the upload future completes once the checkpoint is
  committed on every tier. HF exports (``last_save_in_hf``) are written by torchtitan as before.
* **Waiting**: the trainer's ``maybe_wait_for_staging()`` (before every optimizer step) waits
  for the capture in flight, in every mode, never for flush, commit or upload.
* **Loads**: the newest step is ``tierckpt.checkpoints.latest`` (commit order over all tiers, not
  a directory listing), so an S3-only configuration resumes too; ``load_step = N`` loads
  ``step-N``. With no tierckpt checkpoint, ``initial_load_path`` (a plain DCP checkpoint
  directory) and HF weights are read by DCP's own readers, as torchtitan does.
* **A bad newest checkpoint**: when resuming from the newest (``load_step = -1``) fails because
  that checkpoint is damaged on every tier holding it (``CorruptCheckpoint``, e.g. a checksum
  mismatch) or cannot be read in full (``CheckpointNotFound``), the manager logs it at ERROR and
  resumes from the next older committed checkpoint (``tierckpt.latest(cfg, before=ID)``), and so
  on; an outage (``TierError``) is raised as it is. Every rank sees the same failure (DCP gathers
  them) and takes the same decision. The bad checkpoint is left where it is (retention removes
  it in its turn); when training reaches its step again, that save gets the id with one more
  leading zero (``step-04`` for ``step-4``: the same step, a new id, since ids are never
  overwritten), and commit order makes it the newest.
* **Healthy resume**: ``latest`` is asked with ``healthy=True`` (the manager's ``healthy``
  attribute; set it False to resume from whatever is newest): checkpoints marked bad
  (``tierckpt-restore mark ID bad``), with NaN/Inf recorded at capture (``[job] nonfinite``) or
  with metadata corrupt on every tier are skipped. ``[job] on_resume_check`` runs on rank 0 after
  the load (:func:`tierckpt.load.resume.check_loaded`, with the manager's ``states``); raising
  marks the checkpoint bad and the resume rolls back, at most ``[job] max_rollbacks`` times.
* **Preemption**: torchtitan 0.3's ``CheckpointManager`` has no "save now on preemption" of its
  own (no signal handling; ``last_step=True`` forces only the final save), so there is none to
  expose; the manager's writer is created on the trainer's main thread and installs tierckpt's
  SIGTERM drain (``[job] on_sigterm``, :mod:`tierckpt.preempt`): a save that returned is
  committed on the first tier before the process goes.
* **Retention**: ``keep_latest_k > 0`` becomes the first tier's ``keep`` (``[local]``, or
  ``[s3]`` without a local tier); torchtitan never deletes a directory. Other tiers keep their
  configured ``keep``/``keep_every``.
* **Closing** (``close()``, also from ``__del__`` and at exit) waits for every save to commit,
  once; from a finalizer or during interpreter shutdown it never raises (it logs).
* **Metrics**: the trainer's metric loggers (TensorBoard, W&B: ``MetricsProcessor.logger``) get
  ``writer.stats.as_dict()`` of the newest save on this rank with every step they log
  (``tierckpt/...`` keys, docs/telemetry.md), through :func:`log_metrics_with`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

try:
    from torchtitan.components.checkpointer.base import MODEL
    from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
    from torchtitan.components.metrics import BaseLogger
    from torchtitan.tools.utils import GarbageCollection
except ImportError as e:  # pragma: no cover - depends on the environment
    from ..errors import TierckptError

    raise TierckptError(
        f'tierckpt.integrations.torchtitan needs torchtitan ({e}); install it with: pip install "tierckpt[torchtitan]"'
    ) from e

from ..catalog.checkpoints import checkpoint_id_of, latest
from ..config import Config, load_config
from ..errors import CheckpointMarkedBad, CheckpointNotFound, CorruptCheckpoint, find_error
from ..format.layout import is_valid_checkpoint_id, step_of
from ..load.reader import TieredReader
from ..load.resume import check_loaded
from ..loading import loading
from ..save.writer import TieredWriter

__all__ = ["TierckptCheckpointManager", "log_metrics_with", "with_retention"]

log = logging.getLogger("tierckpt")


def with_retention(cfg: Config, keep_latest_k: int) -> Config:
    """``cfg`` with torchtitan's ``keep_latest_k`` as its first tier's ``keep`` (0: unchanged)."""
    if keep_latest_k <= 0:
        return cfg
    if cfg.local is not None:
        return dataclasses.replace(cfg, local=dataclasses.replace(cfg.local, keep=keep_latest_k))
    if cfg.s3 is not None:
        return dataclasses.replace(cfg, s3=dataclasses.replace(cfg.s3, keep=keep_latest_k))
    return cfg


class _WithTierckptMetrics(BaseLogger):
    """torchtitan's metric logger with ``writer.stats.as_dict()`` added to every ``log``."""

    def __init__(self, inner: BaseLogger, writer: TieredWriter) -> None:
        self.inner = inner
        self.writer = writer

    def log(self, metrics: dict[str, Any], step: int) -> None:
        stats = self.writer.stats
        self.inner.log(metrics if stats is None else {**metrics, **stats.as_dict()}, step)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # the wrapped logger's other members (add_logger, ...)
        return getattr(self.inner, name)


def log_metrics_with(trainer: Any, writer: TieredWriter) -> bool:
    """Add ``writer.stats.as_dict()`` to what ``trainer.metrics_processor.logger`` logs (torchtitan's
    :class:`~torchtitan.components.metrics.MetricsProcessor` calls ``logger.log(metrics, step)`` every
    ``log_freq`` steps). False when ``trainer`` has no such logger (then nothing changes); calling
    it again for the same trainer changes nothing."""
    mp = getattr(trainer, "metrics_processor", None)
    inner = getattr(mp, "logger", None)
    if inner is None or not callable(getattr(inner, "log", None)):
        return False
    if not isinstance(inner, _WithTierckptMetrics):
        mp.logger = _WithTierckptMetrics(inner, writer)  # type: ignore[union-attr]
    return True


class TierckptCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with tierckpt's storage (see the module docstring).

    Built by the trainer from :class:`TierckptCheckpointManager.Config`, on every rank; every
    method is called by the trainer as for torchtitan's own manager, with the same collectives.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        tierckpt_config: str = ""
        """Path of tierckpt's TOML configuration ("" reads $TIERCKPT_CONFIG)."""

    healthy: bool = True  # resume skips unhealthy checkpoints (tierckpt.catalog.health)

    def __init__(self, config: TierckptCheckpointManager.Config, **kwargs: Any) -> None:
        self._in_del = False
        self._bad: set[str] = set()  # checkpoints skipped on resume: they failed on every tier
        keep = config.keep_latest_k
        # torchtitan's purge thread deletes step directories; tierckpt's retention replaces it.
        # keep_latest_k is a field of torchtitan's base Config, which mypy does not see (no stubs)
        super().__init__(dataclasses.replace(config, keep_latest_k=0), **kwargs)  # type: ignore[call-arg]
        if not self.enable:
            return
        self.keep_latest_k = keep
        self.tier_config: Config = with_retention(load_config(config.tierckpt_config or None), keep)
        self.writer = TieredWriter(self.tier_config)
        # torchtitan's trainer passes itself as states["train_state"]; its metrics processor exists by now.
        log_metrics_with((kwargs.get("states") or {}).get("train_state"), self.writer)
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # The writer is the stager (CheckpointManager._save would build a DefaultStager otherwise).
            self.stager = self.writer  # type: ignore[assignment]

    # -- ids ------------------------------------------------------------------------------
    def _is_ours(self, checkpoint_id: str) -> bool:
        """Whether ``checkpoint_id`` names a checkpoint of this manager (``<folder>/step-N`` or a
        bare id), not one torchtitan reads with DCP's own readers (``initial_load_path``, HF)."""
        parent = os.path.dirname(os.path.normpath(str(checkpoint_id)))
        return parent in ("", os.path.normpath(self.folder)) and is_valid_checkpoint_id(checkpoint_id_of(checkpoint_id))

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """torchtitan's ``<folder>/step-N``; for a step whose checkpoint was skipped on resume
        (bad on every tier), ``step-0N`` (one more leading zero per skipped copy): a new id for
        the same step, since a committed id is never overwritten."""
        cid = super()._create_checkpoint_id(step, folder)
        if checkpoint_id_of(cid) not in self._bad:
            return cid
        width = len(str(step)) + 1
        while f"step-{step:0{width}d}" in self._bad:
            width += 1
        new = f"step-{step:0{width}d}"
        log.warning(
            "checkpoint step-%d was skipped on resume (it failed on every tier): saving step %d as %s", step, step, new
        )
        return os.path.join(os.path.dirname(cid), new) if os.path.dirname(cid) else new

    # -- saving ---------------------------------------------------------------------------
    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future | AsyncSaveResponse | None:
        """Every rank, from the trainer's ``save``: see the module docstring for what each mode
        returns and when its future completes. HF exports go to torchtitan's own writer."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        ret: Future | AsyncSaveResponse | None = None
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(
                state_dict, checkpoint_id=checkpoint_id, storage_writer=self.writer, process_group=self.pg
            )
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            upload = dcp.async_save(
                state_dict,
                checkpoint_id=checkpoint_id,
                storage_writer=self.writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
            if isinstance(upload, AsyncSaveResponse):
                ret = upload
            else:
                ret = AsyncSaveResponse(staging_completion=self.writer.captured_future(), upload_completion=upload)
        else:
            dcp.save(state_dict, checkpoint_id=checkpoint_id, storage_writer=self.writer)
            log.info(
                "checkpoint %s captured; it commits in the background (close() waits for it)",
                checkpoint_id_of(checkpoint_id),
            )
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _maybe_wait_for_staging(self) -> None:
        """Before every optimizer step (the trainer): wait for the capture in flight (every mode)."""
        self.writer.wait_captured()
        self.staging_future = None

    def _purge_stale_checkpoints(self) -> None:
        """Nothing: tierckpt's retention (``keep_latest_k`` as the first tier's ``keep``) runs after
        each commit, in commit order, lease-guarded; no directory is deleted."""

    # -- loading --------------------------------------------------------------------------
    def _find_load_step(self, folder: str = "") -> int:
        """The step of the newest committed tierckpt checkpoint (any tier), or -1."""
        cid = latest(self.tier_config, healthy=self.healthy)
        step = step_of(cid) if cid is not None else None
        return -1 if step is None else step

    def _load(self, step: int = -1) -> bool:
        """Every rank (the trainer, before training): ``step`` (-1: the newest committed
        checkpoint over all tiers) through :class:`~tierckpt.TieredReader`; with none, torchtitan's
        own initial load (``initial_load_path``, HF weights) or a fresh start. The host pool's
        first touch waits meanwhile (:mod:`tierckpt.loading`)."""
        with loading():
            return self._load_newest(step)

    def _load_newest(self, step: int) -> bool:
        if step != -1:
            self._load_one(f"step-{step}")
            return True
        cid = latest(self.tier_config, healthy=self.healthy)
        self._note_skipped(cid)
        if cid is None:
            return super()._load(-1)  # initial_load_path / HF / fresh start, read by DCP's readers
        rejected = 0
        while True:
            try:
                self._load_one(cid)
            except BaseException as e:
                bad = find_error(e, (CorruptCheckpoint, CheckpointNotFound))
                if bad is None:
                    raise
                older = latest(self.tier_config, before=cid, healthy=self.healthy)
                log.error(
                    "RESUME: checkpoint %s cannot be loaded from any tier holding it (%s: %s); %s",
                    cid,
                    type(bad).__name__,
                    bad,
                    f"resuming from the next older committed checkpoint, {older}"
                    if older
                    else "no older committed checkpoint is left",
                )
                if older is None:
                    raise
                self._bad.add(cid)
                cid = older
                continue
            why = check_loaded(self.tier_config, self.states, cid)  # [job] on_resume_check (rank 0)
            if why is None:
                return True
            rejected += 1
            older = latest(self.tier_config, before=cid, healthy=self.healthy)
            if rejected > self.tier_config.job.max_rollbacks or older is None:
                raise CheckpointMarkedBad(
                    f"RESUME: checkpoint {cid} was rejected ({why}) and "
                    + (
                        "no older healthy checkpoint is left"
                        if older is None
                        else f"[job] max_rollbacks = {self.tier_config.job.max_rollbacks} is reached"
                    )
                )
            log.error("RESUME: checkpoint %s was rejected (%s); rolling back to %s", cid, why, older)
            self._bad.add(cid)
            cid = older

    def _note_skipped(self, cid: str | None) -> None:
        """The committed checkpoints newer than ``cid`` that the healthy resume skipped go to
        ``_bad``: training saves their steps again under new ids (ids are never overwritten)."""
        if not self.healthy:
            return
        newer = latest(self.tier_config)
        while newer is not None and newer != cid:
            self._bad.add(newer)
            newer = latest(self.tier_config, before=newer)

    def _load_one(self, cid: str) -> None:
        """Every rank: load ``cid`` (``step-N``) into the trainer's states."""
        states = self._states_to_load(step_of(cid) == 0)
        log.info("loading checkpoint %s through tierckpt", cid)
        self._load_tiered(states, cid)
        GarbageCollection.collect("GC collection for checkpoint loading.")

    def _load_tiered(self, state_dict: dict[str, Any], checkpoint_id: str) -> None:
        dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=TieredReader(self.tier_config))
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Ours through tierckpt; anything else (``initial_load_path``, HF) through torchtitan."""
        if not from_hf and self._is_ours(checkpoint_id):
            self._load_tiered(state_dict, checkpoint_id)
        else:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

    # -- lifecycle ------------------------------------------------------------------------
    def __del__(self) -> None:
        self._in_del = True
        self.close()

    def _close(self) -> None:
        """Wait for every save to commit (first call only; the writer's close is idempotent).
        From ``__del__`` or during interpreter shutdown it never raises: it logs."""
        writer = getattr(self, "writer", None)
        if writer is None:
            return
        if self._in_del or sys.is_finalizing():
            writer.close_quietly()
        else:
            writer.close()
