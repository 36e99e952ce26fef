"""Lightning's sharded strategies with their checkpoints in the tiers (Lightning 2.6).

::

    from tierckpt.integrations.lightning import TierckptModelParallelStrategy

    trainer = Trainer(strategy=TierckptModelParallelStrategy("tiers.toml", data_parallel_size=8,
                                                             tensor_parallel_size=1), ...)

:class:`TierckptModelParallelStrategy` (FSDP2 / DTensor, Lightning's ``ModelParallelStrategy``)
and :class:`TierckptFSDPStrategy` (FSDP1, ``FSDPStrategy(state_dict_type="sharded")``) take the
tierckpt configuration first and Lightning's arguments after it. Lightning calls their methods
on every rank, as for its own strategies (``remove_checkpoint``: global rank 0):

* **save_checkpoint**: the sharded model and optimizer states *and* Lightning's metadata (the
  rest of the checkpoint dict, which Lightning writes as ``meta.pt`` beside the shards) are one
  DCP save through one :class:`~tierckpt.TieredWriter`: the checkpoint is whole on a tier or not
  committed there. The path becomes a pointer file and an id as for the DDP plugin
  (:mod:`tierckpt.integrations.pathmap`; rank 0 decides, every rank saves under that id). It
  returns once every rank's state is captured. Full (not sharded) checkpoints are Lightning's.
* **load_checkpoint**: the checkpoint the path resolves to (rank 0 resolves, then broadcasts), in
  one DCP load through :class:`~tierckpt.TieredReader`: model, optimizers and metadata; DCP
  re-shards, so a job of another size loads it. A path holding Lightning's own checkpoint (a
  shard directory or a file) is loaded by Lightning's code.
* **remove_checkpoint**, **teardown**: as :class:`~tierckpt.integrations.lightning.TierckptCheckpointIO`.

Both strategies build their writer on first use.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from abc import ABC, abstractmethod
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.api import CheckpointException

from ..config import TierConfig
from ..errors import TierckptError
from ..load.reader import TieredReader
from ..save.writer import TieredWriter
from .pathmap import PathMap, Resolved, check_run
from .pathmap import cached_planner as _cached_planner

__all__ = ["TierckptModelParallelStrategy", "TierckptFSDPStrategy", "META_KEY"]

log = logging.getLogger("tierckpt")

META_KEY = "meta.pt"
"""The item holding Lightning's metadata (what it writes as ``meta.pt``), pickled, from rank 0."""


def _pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class _Tiered(ABC):
    """What both strategies share; mixed in before the Lightning strategy class."""

    global_rank: int
    is_global_zero: bool
    broadcast: Any

    def _tier_init(self, config: TierConfig | str | os.PathLike | None, allow_pickle: bool, run: str | None) -> None:
        self.tier_config = os.fspath(config) if isinstance(config, os.PathLike) else config
        self.allow_pickle = allow_pickle
        self.tier_run = check_run(run) if run is not None else None
        self._tier_paths: PathMap | None = None

    @property
    def paths(self) -> PathMap:
        """The path map and its (collective) writer, made on first use in this process."""
        if self._tier_paths is None:
            self._tier_paths = PathMap(TieredWriter(self.tier_config), self.tier_run)
        return self._tier_paths

    @abstractmethod
    def _sharded(self) -> bool:
        """Whether checkpoints are sharded (those go through the tiers)."""

    @abstractmethod
    def _shards(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Pop the model and optimizer states out of Lightning's checkpoint dict, as Lightning
        lays them out for DCP; what remains is the metadata."""

    @abstractmethod
    def _load_tiered(self, checkpoint_id: str, weights_only: bool | None) -> dict[str, Any]:
        """Every rank: load ``checkpoint_id`` into the model and optimizers; return the metadata."""

    def _on_rank0(self, fn: Any) -> Any:
        """``fn()`` on rank 0, its result (or error) on every rank."""
        got: Any = None
        if self.is_global_zero:
            try:
                got = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                got = ("err", e)
        got = self.broadcast(got)
        if got[0] == "err":
            raise got[1]
        return got[1]

    def _tiered_save(self, checkpoint: dict[str, Any], filepath: _PATH) -> None:
        paths = self.paths
        path = self.broadcast(os.fspath(filepath))
        step = checkpoint.get("global_step")
        state = self._shards(checkpoint)
        if self.is_global_zero:
            state[META_KEY] = _pickle(checkpoint)
        # The very same state as the save just made (save_last=True's last.ckpt): rank 0 decides on
        # its shards and the metadata (every rank's shards are stepped together), and points at it.
        same = self._on_rank0(lambda: paths.unchanged(state))
        if same is not None:
            if self.is_global_zero:
                paths.alias(path, same, step=step)
            log.info(
                "%s: the same state as checkpoint %s, saved just before; pointed at it, not saved again", path, same
            )
            return
        cid, replaces = self._on_rank0(lambda: paths.new_id(path))
        try:
            dcp.save(state, checkpoint_id=cid, storage_writer=paths.writer, planner=_cached_planner())
        except CheckpointException as e:
            clear = paths.conflict(e, path, cid)
            if clear is None:
                raise
            raise clear from e
        job = paths.writer.last
        paths.writer.wait_captured()
        if self.is_global_zero:
            paths.saved(path, cid, job, replaces, step=step, flat=state)
        log.info("checkpoint %s captured for %s; it commits in the background", cid, path)

    def _resolve(self, checkpoint_path: _PATH) -> tuple[str, Resolved]:
        path = self.broadcast(os.fspath(checkpoint_path))
        return path, self._on_rank0(lambda: self.paths.resolve(path))

    def _meta(self, raw: Any, checkpoint_id: str, weights_only: bool | None) -> dict[str, Any]:
        if not isinstance(raw, (bytes, bytearray)):
            raise TierckptError(f"checkpoint {checkpoint_id}: no Lightning metadata ({META_KEY!r}) in it")
        trusted = self.allow_pickle or weights_only is False
        return torch.load(io.BytesIO(raw), weights_only=not trusted)

    def _tiered_remove(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            self.paths.remove(filepath)

    def _tiered_teardown(self) -> None:
        if self._tier_paths is not None:
            self._tier_paths.close(quietly=sys.exc_info()[0] is not None or sys.is_finalizing())


class TierckptModelParallelStrategy(_Tiered, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel) with sharded checkpoints in
    the tiers. ``config``: tierckpt's configuration (TOML path, :class:`~tierckpt.config.TierConfig`
    or ``None`` for ``$TIERCKPT_CONFIG``); ``allow_pickle``: unpickle the metadata without
    ``weights_only``; ``run``: the run key of the ids (see
    :class:`~tierckpt.integrations.lightning.TierckptCheckpointIO`); the rest is
    ``ModelParallelStrategy``'s."""

    def __init__(
        self,
        config: TierConfig | str | os.PathLike | None = None,
        *,
        allow_pickle: bool = False,
        run: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._tier_init(config, allow_pickle, run)

    def _sharded(self) -> bool:
        return self._save_distributed_checkpoint

    def _shards(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not self._sharded():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        self._tiered_save(checkpoint, filepath)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path, got = self._resolve(checkpoint_path)
        if got.foreign:
            return super().load_checkpoint(path, weights_only)
        return self._load_tiered(got.id, weights_only)  # type: ignore[arg-type]

    def _load_tiered(self, checkpoint_id: str, weights_only: bool | None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        module = self.model
        state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
        for i, optim in enumerate(self.optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(module, optim)
        state[META_KEY] = None
        dcp.load(state, checkpoint_id=checkpoint_id, storage_reader=TieredReader(self.paths.cfg))
        module.load_state_dict(state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optim in enumerate(self.optimizers):
            set_optimizer_state_dict(
                module, optim, optim_state_dict=state[f"optimizer_{i}"], options=StateDictOptions(cpu_offload=True)
            )
        return self._meta(state[META_KEY], checkpoint_id, weights_only)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        if not self._sharded():
            return super().remove_checkpoint(filepath)
        self._tiered_remove(filepath)

    def teardown(self) -> None:
        super().teardown()
        self._tiered_teardown()


class TierckptFSDPStrategy(_Tiered, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) with ``state_dict_type="sharded"`` checkpoints in the
    tiers (the default here). ``config``/``allow_pickle``/``run`` as for :class:`TierckptModelParallelStrategy`;
    the rest is ``FSDPStrategy``'s."""

    def __init__(
        self,
        config: TierConfig | str | os.PathLike | None = None,
        *,
        allow_pickle: bool = False,
        run: str | None = None,
        state_dict_type: Literal["full", "sharded"] = "sharded",
        **kwargs: Any,
    ) -> None:
        super().__init__(state_dict_type=state_dict_type, **kwargs)
        self._tier_init(config, allow_pickle, run)

    def _sharded(self) -> bool:
        return self._state_dict_type == "sharded"

    def _shards(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        state = {"model": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not self._sharded():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        self._tiered_save(checkpoint, filepath)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path, got = self._resolve(checkpoint_path)
        if got.foreign:
            return super().load_checkpoint(path, weights_only)
        return self._load_tiered(got.id, weights_only)  # type: ignore[arg-type]

    def _load_tiered(self, checkpoint_id: str, weights_only: bool | None) -> dict[str, Any]:
        """As Lightning's FSDPStrategy loads a shard directory (model in its sharded state-dict
        context, then each optimizer with ``load_sharded_optimizer_state_dict``), from the tiers."""
        from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        assert self.model is not None and self.lightning_module is not None
        cfg = self.paths.cfg
        with _get_sharded_state_dict_context(self.model):  # type: ignore[attr-defined]  # a contextmanager Lightning annotates as a Generator
            state: dict[str, Any] = {"model": self.model.state_dict(), META_KEY: None}
            dcp.load(state, checkpoint_id=checkpoint_id, storage_reader=TieredReader(cfg))
            self.model.load_state_dict(state["model"], strict=self.lightning_module.strict_loading)
            if self.lightning_module.trainer.state.fn == TrainerFn.FITTING and self.optimizers:
                for i, optim in enumerate(self.optimizers):
                    reader = TieredReader(cfg)
                    reader.reset(checkpoint_id)
                    osd = load_sharded_optimizer_state_dict(
                        model_state_dict=state["model"], optimizer_key=f"optimizer_{i}", storage_reader=reader
                    )
                    optim.load_state_dict(
                        FSDP.optim_state_dict_to_load(
                            optim_state_dict=osd[f"optimizer_{i}"], model=self.model, optim=optim
                        )
                    )
        return self._meta(state[META_KEY], checkpoint_id, weights_only)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        if not self._sharded():
            return super().remove_checkpoint(filepath)
        self._tiered_remove(filepath)

    def teardown(self) -> None:
        super().teardown()
        self._tiered_teardown()
