"""PyTorch Lightning's checkpoints through tierckpt (``pip install "tierckpt[lightning]"``, Lightning 2.6).

DDP and single-device runs: a ``CheckpointIO`` plugin::

    from tierckpt.integrations.lightning import TierckptCheckpointIO

    trainer = Trainer(strategy="ddp", plugins=[TierckptCheckpointIO("tiers.toml")],
                      callbacks=[ModelCheckpoint(dirpath="ckpt", every_n_train_steps=500, save_top_k=2,
                                                 monitor="step", mode="max", save_last="link")])
    trainer.fit(model, ckpt_path="last")

Sharded runs: :class:`~tierckpt.integrations.lightning_sharded.TierckptModelParallelStrategy`
(FSDP2) and :class:`~tierckpt.integrations.lightning_sharded.TierckptFSDPStrategy` (FSDP1),
re-exported here.

What changes against Lightning's ``TorchCheckpointIO`` (``docs/integrations.md`` has the recipes):

* **Saving** (``trainer.save_checkpoint``, ``ModelCheckpoint``; Lightning calls it on rank 0):
  the checkpoint dict goes through one :class:`~tierckpt.TieredWriter` as a one-process save
  (``no_dist``): every tensor an item, everything else one pickle
  (:mod:`tierckpt.integrations.statetree`). It returns once the state is *captured* (copied to
  host memory): the writes, the commit and the promotion to later tiers run in the background.
  At the path Lightning gave, a pointer file names the checkpoint
  (:mod:`tierckpt.integrations.pathmap`: ids ``<run>@<name>`` kept apart per run, when the pointer
  is written, ``ckpt_path="last"``, rewritten names). A save of the very same state as the one just
  made (``save_last=True``'s ``last.ckpt``) points at that checkpoint instead of copying it. DCP's
  plan caching is on (:func:`~tierckpt.integrations.pathmap.cached_planner`).
* **Loading** (every rank, ``trainer.fit(ckpt_path=...)``): the checkpoint the path resolves to,
  from the fastest tier holding it; a path holding an ordinary Lightning checkpoint file is read
  by Lightning's ``TorchCheckpointIO``. Tensors come back on the CPU (Lightning moves them).
  ``weights_only=False`` (or ``allow_pickle=True`` here) lets non-tensor values unpickle
  without ``weights_only``, as ``torch.load`` would.
* **Deleting** (``save_top_k``, ``remove_checkpoint``): the pointer at once, the checkpoint from
  every tier in the background, lease-guarded (:mod:`tierckpt.integrations.deletions`).
* **Teardown** (end of ``fit``/``validate``/...): waits for every save to commit on every tier
  and every deletion to run; a background failure is raised there (logged instead when the
  trainer is already handling an exception).

The plugin builds its writer on its first save or removal (a rank that only loads never does), and
pickles as its configuration (``ddp_spawn``).
"""

from __future__ import annotations

import io
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

try:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.utilities.types import _PATH
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError as e:  # pragma: no cover - depends on the environment
    from ..errors import TierckptError

    raise TierckptError(
        f'tierckpt.integrations.lightning needs Lightning ({e}); install it with: pip install "tierckpt[lightning]"'
    ) from e

from ..config import TierConfig, load_config
from ..load.deliver import unfilled
from ..load.reader import TieredReader
from ..save.writer import TieredWriter
from .pathmap import PathMap, check_run
from .pathmap import cached_planner as _cached_planner
from .statetree import join, split

__all__ = ["TierckptCheckpointIO", "TierckptModelParallelStrategy", "TierckptFSDPStrategy", "load_from_checkpoint"]  # noqa: F822 - the strategies come from __getattr__

log = logging.getLogger("tierckpt")


class TierckptCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` for DDP and single-device runs, through the tiers.

    Args:
        config: a :class:`~tierckpt.config.TierConfig`, a TOML path, or ``None`` (``$TIERCKPT_CONFIG``).
        allow_pickle: unpickle non-tensor values without ``weights_only`` on every load (only for
            checkpoints you trust); otherwise only when Lightning passes ``weights_only=False``.
        run: the run key of this run's ids (``None``: derived from each checkpoint's directory,
            :func:`tierckpt.integrations.pathmap.run_key`); set it where the directory's absolute
            path differs between the machines a run restarts on.

    Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0,
    ``load_checkpoint`` on every rank, ``teardown`` on every rank (see the module docstring).
    """

    def __init__(
        self,
        config: TierConfig | str | os.PathLike | None = None,
        *,
        allow_pickle: bool = False,
        run: str | None = None,
    ) -> None:
        self.config = os.fspath(config) if isinstance(config, os.PathLike) else config
        self.allow_pickle = allow_pickle
        self.run = check_run(run) if run is not None else None
        self._paths: PathMap | None = None

    @property
    def paths(self) -> PathMap:
        """The path map, made on first use in this process; its writer is made on the first save
        or removal (a rank that only loads, every DDP rank but 0, never makes one)."""
        if self._paths is None:
            cfg = self.config if isinstance(self.config, TierConfig) else load_config(self.config)
            self._paths = PathMap(lambda: TieredWriter(cfg, no_dist=True), self.run, cfg=cfg)
        return self._paths

    @property
    def writer(self) -> TieredWriter:
        return self.paths.writer

    def __getstate__(self) -> dict:
        return {"config": self.config, "allow_pickle": self.allow_pickle, "run": self.run, "_paths": None}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Rank 0: save ``checkpoint`` as the checkpoint of ``path``; returns once captured."""
        if storage_options is not None:
            raise TypeError(
                "`TierckptCheckpointIO.save_checkpoint(..., storage_options=...)` is not supported: "
                "the tiers are configured in tierckpt's TOML"
            )
        paths = self.paths
        flat = split(checkpoint)
        same = paths.unchanged(flat)
        if same is not None:  # save_last=True: last.ckpt right after the step's checkpoint, the very same state
            paths.alias(path, same, step=checkpoint.get("global_step"))
            log.info(
                "%s: the same state as checkpoint %s, saved just before; pointed at it, not saved again", path, same
            )
            return
        cid, replaces = paths.new_id(path)
        try:
            dcp.save(flat, checkpoint_id=cid, storage_writer=paths.writer, no_dist=True, planner=_cached_planner())
        except CheckpointException as e:
            clear = paths.conflict(e, path, cid)
            if clear is None:
                raise
            raise clear from e
        job = paths.writer.last
        paths.writer.wait_captured()
        paths.saved(path, cid, job, replaces, step=checkpoint.get("global_step"), flat=flat)
        log.info("checkpoint %s captured for %s; it commits in the background", cid, path)

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Every rank: the checkpoint ``path`` resolves to, whole (tensors on the CPU)."""
        got = self.paths.resolve(path)
        if got.foreign:
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        trusted = self.allow_pickle or weights_only is False
        reader = TieredReader(self.paths.cfg)  # the tensors and the pickled skeleton (bytes)
        reader.reset(got.id)
        flat: dict[str, Any] = {}
        _load_state_dict(flat, storage_reader=reader, planner=_SkeletonPlanner(), no_dist=True)
        return join(flat, weights_only=not trusted)

    def remove_checkpoint(self, path: _PATH) -> None:
        """Rank 0: the pointer at ``path`` now; the checkpoint from every tier in the background."""
        self.paths.remove(path)

    def teardown(self) -> None:
        """Every rank: wait for this process's saves to commit and its deletions to run."""
        if self._paths is not None:
            self._paths.close(quietly=sys.exc_info()[0] is not None or sys.is_finalizing())


class _SkeletonPlanner(_EmptyStateDictLoadPlanner):
    """DCP's ``_EmptyStateDictLoadPlanner`` (rebuild the whole state from the checkpoint's
    metadata), each tensor allocated by :func:`~tierckpt.load.deliver.unfilled` instead of
    ``torch.empty``, which under Lightning's ``deterministic=True`` first fills every byte the load
    then overwrites (every tensor is read whole and verified, or the load raises and the state is
    dropped). The base's loop, with that one change; then ``DefaultLoadPlanner.set_up_planner``."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        if state_dict or metadata is None:
            raise AssertionError("a skeleton load starts from an empty state dict and needs the metadata")
        for k, v in metadata.state_dict_metadata.items():
            if not self._should_include_key(k, metadata):
                continue
            if isinstance(v, TensorStorageMetadata):
                v = unfilled(tuple(v.size), v.properties.dtype)
            if metadata.planner_data is not None and k in metadata.planner_data:
                set_element(state_dict, metadata.planner_data[k], v)
            else:
                state_dict[k] = v
        DefaultLoadPlanner.set_up_planner(self, state_dict, metadata, is_coordinator)


def load_from_checkpoint(
    cls: Any,
    path: _PATH,
    config: TierConfig | str | os.PathLike | None = None,
    *,
    run: str | None = None,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path, **kwargs)`` for a path saved through tierckpt (a pointer):
    the checkpoint is read from the tiers (:meth:`TierckptCheckpointIO.load_checkpoint`), then
    handed to Lightning's own ``load_from_checkpoint`` (``cls``: a ``LightningModule`` or
    ``LightningDataModule`` class; ``map_location``, ``hparams_file``, ``strict`` and the model's
    arguments go in ``kwargs``). ``weights_only=False`` unpickles non-tensor values without
    ``weights_only`` (checkpoints you trust). A path holding Lightning's own checkpoint loads as
    Lightning loads it. Blocks while it reads; any process, no collective."""
    ckpt = TierckptCheckpointIO(config, run=run).load_checkpoint(path, weights_only=weights_only)
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    return cls.load_from_checkpoint(buf, weights_only=weights_only, **kwargs)


def __getattr__(name: str) -> Any:
    """The sharded strategies live in :mod:`tierckpt.integrations.lightning_sharded`."""
    if name in ("TierckptModelParallelStrategy", "TierckptFSDPStrategy"):
        from . import lightning_sharded

        return getattr(lightning_sharded, name)
    raise AttributeError(name)
