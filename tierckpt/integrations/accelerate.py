"""Hugging Face Accelerate's ``save_state``/``load_state`` through tierckpt: one call.

::

    from tierckpt.integrations import accelerate as tierckpt_accelerate

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...),
                              project_config=ProjectConfiguration("run", automatic_checkpoint_naming=True,
                                                                  total_limit=3))
    ckpt = tierckpt_accelerate.enable(accelerator, "tiers.toml")
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ...
    accelerator.save_state()          # one tierckpt checkpoint; returns once captured
    accelerator.load_state()          # the newest checkpoint_<n>, from the fastest tier holding it
    ...
    ckpt.close()                      # waits for the last commit (or: the atexit drain does)

**Supported versions**: Accelerate 1.15 (``pip install "tierckpt[accelerate]"``); what ``save_state``
saves is mirrored from 1.15's ``Accelerator.save_state``/``checkpointing.py``. Other versions are
refused by :func:`enable` unless ``check_version=False``.

**What enable does.** It sets ``save_state`` and ``load_state`` on *this* ``accelerator`` object
(instance attributes shadowing the class's methods; nothing in the ``accelerate`` package, no
other instance). :meth:`TierckptState.disable` (or :func:`disable`) removes them: Accelerate's own
methods are back, untouched.

**save_state** (every process, as Accelerate requires) makes *one* DCP save through one
:class:`~tierckpt.TieredWriter`, so model and optimizer are one checkpoint, committed together:

* ``model_<i>`` / ``optimizer_<i>``: ``get_model_state_dict`` / ``get_optimizer_state_dict``
  (FSDP: sharded, with the options Accelerate derives from the plugin; other models: full,
  written once by DCP's de-duplication);
* ``rank_<r>`` (each process): its RNG states (Python, NumPy, torch CPU and CUDA), the stateful
  data loaders' ``state_dict()`` (their position: ``DataLoaderConfiguration(use_stateful_dataloader=True)``)
  and samplers, ``accelerator.step``;
* ``accelerate`` (process 0): schedulers, the grad scaler, ``project_configuration.iteration``;
  ``custom`` (process 0): the objects of ``register_for_checkpointing``.

The id is ``<run>@<name>``: ``name`` the last component of ``output_dir`` (with
``automatic_checkpoint_naming``: ``checkpoint_<iteration>``), ``run`` the ``run`` argument of
:func:`enable` or else :func:`~tierckpt.integrations.pathmap.run_key` of the directory holding it
(``<project_dir>/checkpoints``), so runs with another ``project_dir`` on one configuration never
share an id. ``total_limit`` deletes the run's own oldest such checkpoints from every tier,
lease-guarded (process 0); another run's are never touched. It returns once the state is captured; the writes, the commit and
promotion run in the background. Hooks of ``register_save_state_pre_hook`` are called as
Accelerate calls them (FSDP models: no weights), with ``output_dir`` created for them; what they
write there stays on that disk.

**load_state** (every process): the checkpoint of ``input_dir`` (its id as above; an id saved
before runs were kept apart, without ``<run>@``, if that is the one committed), or with automatic
naming and no ``input_dir`` the run's highest ``checkpoint_<n>`` committed on some tier
(:class:`~tierckpt.errors.CheckpointNotFound` when there is none); one
DCP load through :class:`~tierckpt.TieredReader`, then everything above is set back (with
automatic naming, ``iteration`` continues after the loaded one: no manual override needed).
Non-tensor values are unpickled with ``weights_only=True`` (``allow_pickle=True``: without),
custom objects without, as Accelerate does. The data loaders' positions continue exactly within
the first epoch; the shuffling sampler's generator is not saved (nor by Accelerate's own save), so
later epochs' orders can differ from an uninterrupted run's.
"""

from __future__ import annotations

import io
import logging
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

try:
    import accelerate
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError as e:  # pragma: no cover - depends on the environment
    from ..errors import TierckptError

    raise TierckptError(
        f'tierckpt.integrations.accelerate needs Accelerate ({e}); install it with: pip install "tierckpt[accelerate]"'
    ) from e

from ..capture.ranksave import RankSave
from ..catalog.checkpoints import list_checkpoints
from ..catalog.health import unhealthy
from ..catalog.listing import is_committed
from ..config import TierConfig
from ..errors import CheckpointNotFound, CommitConflict, ConfigError
from ..format.layout import check_checkpoint_id
from ..load.reader import TieredReader
from ..save.writer import TieredWriter
from .deletions import Deletions
from .pathmap import RUN_SEP, check_run, run_key
from .pathmap import cached_planner as _cached_planner

__all__ = ["SUPPORTED", "TierckptState", "enable", "disable"]

log = logging.getLogger("tierckpt")

SUPPORTED = ((1, 15), (1, 16))
"""Accelerate versions supported: from 1.15 (inclusive) to 1.16 (exclusive)."""

_ID_AUTO = re.compile(r"^(?:(.+)@)?checkpoint_(\d+)$")  # <run>@checkpoint_<n>, or from before namespacing
_PLAIN = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def _pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpickle(raw: Any, what: str, weights_only: bool) -> Any:
    if not isinstance(raw, (bytes, bytearray)):
        raise ConfigError(f"{what}: not a tierckpt Accelerate checkpoint item")
    return torch.load(io.BytesIO(raw), weights_only=weights_only)


def _rng_state() -> dict[str, Any]:
    """This process's RNG states, as Accelerate saves them (NumPy's as plain values)."""
    name, key, pos, has_gauss, cached = cast(
        "tuple[str, np.ndarray, int, int, float]", np.random.get_state(legacy=True)
    )
    st: dict[str, Any] = {
        "random_state": random.getstate(),
        "numpy_random_seed": (name, key.tolist(), int(pos), int(has_gauss), float(cached)),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(st["random_state"])
    name, key, pos, has_gauss, cached = st["numpy_random_seed"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(st["torch_manual_seed"])
    if "torch_cuda_manual_seed" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["torch_cuda_manual_seed"])


@dataclass(eq=False)
class TierckptState:
    """What :func:`enable` returns: the routed ``save_state``/``load_state`` and their writer.

    Made by :func:`enable`, on every process; its methods are called where Accelerate's are.
    """

    accelerator: Accelerator
    writer: TieredWriter
    allow_pickle: bool = False
    run: str | None = None
    deletions: Deletions = field(init=False)
    _saves: dict[str, RankSave] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.deletions = Deletions(self.writer)
        if self.run is not None:
            check_run(self.run)

    # -- ids -------------------------------------------------------------------------------------
    def _auto_dir(self) -> str:
        return os.path.join(self.accelerator.project_dir or ".", "checkpoints")

    def run_of(self, directory: str | os.PathLike) -> str:
        """The run key of checkpoints saved into ``directory``: :attr:`run`, else
        :func:`~tierckpt.integrations.pathmap.run_key` of it."""
        return self.run or run_key(directory)

    def id_for(self, path: str | os.PathLike) -> str:
        """``<run>@<name>``: the id of a save to ``path`` (a ``checkpoint_<n>`` or ``output_dir``)."""
        p = os.path.expanduser(os.fspath(path)).rstrip("/")
        directory, name = os.path.split(p)
        return check_checkpoint_id(f"{self.run_of(directory)}{RUN_SEP}{name}")

    def _committed(self, cid: str) -> bool:
        chain = self.writer.engine.chain
        return any(is_committed(chain[i], cid) for i in range(len(chain)))

    def _auto_ids(self) -> list[tuple[int, str]]:
        """(n, id) of this run's committed ``checkpoint_<n>``, lowest n first."""
        prefix = self.run_of(self._auto_dir())
        out = []
        for c in list_checkpoints(self.writer.cfg):
            m = _ID_AUTO.match(c.id)
            if m and m.group(1) == prefix:
                out.append((int(m.group(2)), c.id))
        return sorted(out)

    healthy: bool = True  # load_state() skips unhealthy checkpoints (tierckpt.catalog.health)

    def _healthiest(self, ids: list[str]) -> str | None:
        """The newest of ``ids`` (oldest first) that is healthy (every one with ``healthy = False``),
        each one skipped logged with why."""
        if not self.healthy:
            return ids[-1] if ids else None
        chain = self.writer.engine.chain
        tiers = [chain[i] for i in range(len(chain))]
        for cid in reversed(ids):
            why = unhealthy(tiers, cid)
            if why is None:
                return cid
            log.warning("load_state: skipping checkpoint %s: %s", cid, why)
        return None

    def latest(self) -> str | None:
        """The id ``load_state()`` loads (automatic naming): this run's highest committed
        ``checkpoint_<n>`` that is healthy (not marked bad, no NaN/Inf recorded at capture: see
        :mod:`tierckpt.catalog.health`; with ``healthy = False``: any), else one saved before namespacing (no run key), else ``None``
        (nothing to resume: start from scratch)."""
        own = [cid for _n, cid in self._auto_ids()]
        found = self._healthiest(own)
        if found is not None:
            return found
        legacy = [
            (int(m.group(2)), c.id)
            for c in list_checkpoints(self.writer.cfg)
            if (m := _ID_AUTO.match(c.id)) and m.group(1) is None
        ]
        cid = self._healthiest([c for _n, c in sorted(legacy)])
        if cid is not None:
            log.warning(
                "no checkpoint of run %s is committed; loading %s, saved before tierckpt kept runs apart "
                "(it may be another run's: pass input_dir to choose)",
                self.run_of(self._auto_dir()),
                cid,
            )
            return cid
        return None

    # -- state dicts -----------------------------------------------------------------------------
    def _options(self) -> StateDictOptions | None:
        acc = self.accelerator
        if acc.distributed_type == DistributedType.FSDP:
            from accelerate.utils.fsdp_utils import _prepare_sd_options
            from torch.distributed.fsdp import StateDictType

            plugin = acc.state.fsdp_plugin
            if plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
                raise ConfigError(
                    f"tierckpt saves FSDP with SHARDED_STATE_DICT only (the plugin says "
                    f"{plugin.state_dict_type.name}); set fsdp_plugin.state_dict_type"
                )
            return _prepare_sd_options(plugin) if plugin.fsdp_version == 2 else StateDictOptions()
        return StateDictOptions()

    def _model_states(self, opts: StateDictOptions | None) -> dict[str, Any]:
        acc = self.accelerator
        out: dict[str, Any] = {}
        for i, model in enumerate(acc._models):
            out[f"model_{i}"] = get_model_state_dict(model, options=opts)
        for i, opt in enumerate(acc._optimizers):
            out[f"optimizer_{i}"] = get_optimizer_state_dict(acc._models[i], opt, options=opts)
        return out

    # -- save_state ------------------------------------------------------------------------------
    def save_state(
        self,
        output_dir: str | os.PathLike | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> str:
        """``Accelerator.save_state`` through the tiers (see the module docstring). Returns
        ``output_dir`` (with automatic naming, the ``checkpoint_<n>`` path Accelerate would use)."""
        acc = self.accelerator
        pc = acc.project_configuration
        if pc.automatic_checkpoint_naming:
            output_dir = os.path.join(self._auto_dir(), f"checkpoint_{acc.save_iteration}")
            if acc.is_main_process and pc.total_limit is not None:
                self._prune(pc.total_limit)
        elif output_dir is None:
            raise ConfigError("save_state needs output_dir (or ProjectConfiguration(automatic_checkpoint_naming=True))")
        output_dir = os.fspath(output_dir)
        cid = self.id_for(output_dir)
        if cid in self._saves:
            raise CommitConflict(f"checkpoint {cid} was already saved by this job; tierckpt never overwrites one")
        opts = self._options()
        state = self._model_states(opts)
        state[f"rank_{acc.process_index}"] = _pickle(self._rank_state())
        if acc.is_main_process:
            state["accelerate"] = _pickle(
                {
                    "schedulers": [s.state_dict() for s in acc._schedulers],
                    "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
                    "iteration": pc.iteration,
                    "world": acc.num_processes,
                }
            )
            state["custom"] = _pickle([obj.state_dict() for obj in acc._custom_objects])
        if acc._save_model_state_pre_hook:
            os.makedirs(output_dir, exist_ok=True)
            for hook in acc._save_model_state_pre_hook.values():
                hook(acc._models, [], output_dir)
        try:
            dcp.save(state, checkpoint_id=cid, storage_writer=self.writer, planner=_cached_planner())
        except CheckpointException as e:
            if any(isinstance(f[0] if isinstance(f, tuple) else f, CommitConflict) for f in e.failures.values()):
                raise CommitConflict(
                    f"cannot save {output_dir}: checkpoint {cid} is already committed in "
                    f"{self.writer.cfg.source or 'the configuration'}, saved by another run with the same run key "
                    f"{cid.split(RUN_SEP)[0]!r} (this run's key comes from "
                    f"{'run=' + repr(self.run) if self.run else os.path.dirname(output_dir)}); tierckpt never "
                    "overwrites it. Give each run its own project_dir or enable(..., run=...)"
                ) from e
            raise
        job = self.writer.last
        if job is not None:
            self._saves[cid] = job
        self.writer.wait_captured()
        log.info("accelerate state %s captured; it commits in the background", cid)
        pc.iteration += 1
        return output_dir

    def _rank_state(self) -> dict[str, Any]:
        acc = self.accelerator
        from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

        loaders: list[Any] = []
        samplers: list[Any] = []
        for dl in acc._dataloaders:
            loaders.append(dl.state_dict() if getattr(dl, "use_stateful_dataloader", False) else None)
            sampler = dl.get_sampler() if isinstance(dl.dataset, IterableDatasetShard) else None
            samplers.append(sampler if isinstance(sampler, SeedableRandomSampler) else None)
        return {"step": acc.step, "rng": _rng_state(), "dataloaders": loaders, "samplers": samplers}

    def _prune(self, total_limit: int) -> None:
        """Process 0, before a save with automatic naming: delete the oldest ``checkpoint_<n>``
        so that ``total_limit`` remain with the new one (as Accelerate removes folders)."""
        prefix = self.run_of(self._auto_dir())
        ids = {cid for _, cid in self._auto_ids()} | {
            i for i in self._saves if (m := _ID_AUTO.match(i)) is not None and m.group(1) == prefix
        }
        ordered = sorted(ids, key=lambda i: int(_ID_AUTO.match(i).group(2)))  # type: ignore[union-attr]
        for cid in ordered[: max(0, len(ordered) + 1 - total_limit)]:
            job = self._saves.pop(cid, None)
            self.deletions.delete(cid, job.replicated if job is not None else None)

    # -- load_state ------------------------------------------------------------------------------
    def load_state(
        self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any
    ) -> None:
        """``Accelerator.load_state`` through the tiers (see the module docstring)."""
        acc = self.accelerator
        if input_dir is not None:
            cid = self.id_for(input_dir)
            if not self._committed(cid):
                legacy = check_checkpoint_id(os.path.basename(os.path.expanduser(os.fspath(input_dir)).rstrip("/")))
                if not self._committed(legacy):
                    raise CheckpointNotFound(
                        f"{input_dir}: neither {cid} nor {legacy} is committed on any tier of {self.writer.cfg.source}"
                    )
                cid = legacy  # saved before namespacing
        elif acc.project_configuration.automatic_checkpoint_naming:
            found = self.latest()
            if found is None:
                raise CheckpointNotFound(
                    f"no checkpoint_<n> of run {self.run_of(self._auto_dir())} (project_dir "
                    f"{acc.project_dir}) is committed on any tier of {self.writer.cfg.source}"
                )
            cid = found
        else:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        log.info("loading accelerate state %s through tierckpt", cid)
        reader = TieredReader(self.writer.cfg)
        reader.reset(cid)
        saved = reader.read_metadata().state_dict_metadata  # which per-process parts exist
        opts = self._options()
        state: dict[str, Any] = self._model_states(opts)
        mine = f"rank_{acc.process_index}"
        for key in (mine, "accelerate", "custom"):
            if key in saved:
                state[key] = None
        dcp.load(state, storage_reader=reader)
        models = [] if acc.distributed_type == DistributedType.FSDP else list(acc._models)
        for hook in acc._load_model_state_pre_hook.values():
            hook(models, os.fspath(input_dir) if input_dir is not None else cid)
        for i, model in enumerate(acc._models):
            if acc.distributed_type == DistributedType.FSDP or any(m is model for m in models):
                set_model_state_dict(model, state[f"model_{i}"], options=opts)
        for i, opt in enumerate(acc._optimizers):
            set_optimizer_state_dict(acc._models[i], opt, state[f"optimizer_{i}"], options=opts)
        trusted = self.allow_pickle
        if "accelerate" in state:
            shared = _unpickle(state["accelerate"], f"{cid}: accelerate", not trusted)
            for sched, sd in zip(acc._schedulers, shared["schedulers"]):
                sched.load_state_dict(sd)
            if acc.scaler is not None and shared["scaler"] is not None:
                acc.scaler.load_state_dict(shared["scaler"])
            if acc.project_configuration.automatic_checkpoint_naming:
                acc.project_configuration.iteration = shared["iteration"] + 1
        if mine in state:
            self._load_rank_state(_unpickle(state[mine], f"{cid}: {mine}", not trusted))
        else:
            log.info(
                "checkpoint %s has no state of process %d (saved by fewer processes): RNG states, data "
                "loader positions and step not loaded",
                cid,
                acc.process_index,
            )
        if "custom" in state:
            for obj, sd in zip(acc._custom_objects, _unpickle(state["custom"], f"{cid}: custom", False)):
                obj.load_state_dict(sd)

    def _load_rank_state(self, st: dict[str, Any]) -> None:
        acc = self.accelerator
        for dl, dls, sampler in zip(acc._dataloaders, st["dataloaders"], st["samplers"]):
            if sampler is not None:
                dl.set_sampler(sampler)
            if dls is not None and getattr(dl, "use_stateful_dataloader", False):
                dl.load_state_dict(dls)
        acc.step = st["step"]
        _set_rng_state(st["rng"])

    # -- the end ---------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until every save is committed on every tier and every deletion ran; raise the
        first background failure."""
        self.writer.wait()
        self.deletions.wait()

    def close(self) -> None:
        """:meth:`wait`, once per save (later calls return at once until the next save)."""
        self.writer.close()
        self.deletions.wait()

    def disable(self) -> None:
        """Give ``save_state``/``load_state`` back to Accelerate (after :meth:`close`)."""
        self.close()
        for name in ("save_state", "load_state"):
            self.accelerator.__dict__.pop(name, None)
        self.accelerator.__dict__.pop("_tierckpt", None)


def enable(
    accelerator: Accelerator,
    config: TierConfig | str | os.PathLike | None = None,
    *,
    allow_pickle: bool = False,
    check_version: bool = True,
    run: str | None = None,
) -> TierckptState:
    """Route ``accelerator.save_state``/``load_state`` through tierckpt (every process, before
    training). ``config``: a :class:`~tierckpt.config.TierConfig`, a TOML path or ``None``
    (``$TIERCKPT_CONFIG``). Raises :class:`~tierckpt.errors.ConfigError` for an Accelerate
    version outside :data:`SUPPORTED` (unless ``check_version=False``) and for DeepSpeed,
    Megatron-LM and XLA runs (their own checkpoint engines)."""
    version = tuple(int(p) for p in re.findall(r"\d+", accelerate.__version__)[:2])
    if check_version and not (SUPPORTED[0] <= version < SUPPORTED[1]):
        raise ConfigError(
            f"tierckpt.integrations.accelerate supports Accelerate 1.15.x, found {accelerate.__version__} "
            "(enable(..., check_version=False) to try anyway)"
        )
    kind = accelerator.distributed_type
    if kind != DistributedType.FSDP and kind not in _PLAIN:
        raise ConfigError(
            f"tierckpt.integrations.accelerate does not handle {kind} runs (their engines checkpoint "
            "themselves); supported: FSDP (sharded state dicts), DDP and single-process runs"
        )
    if "_tierckpt" in accelerator.__dict__:
        accelerator.__dict__["_tierckpt"].disable()
    cfg = os.fspath(config) if isinstance(config, os.PathLike) else config
    st = TierckptState(accelerator, TieredWriter(cfg), allow_pickle=allow_pickle, run=run)
    accelerator.save_state = st.save_state  # type: ignore[method-assign]
    accelerator.load_state = st.load_state  # type: ignore[method-assign]
    accelerator._tierckpt = st  # type: ignore[attr-defined]
    return st


def disable(accelerator: Accelerator) -> None:
    """Undo :func:`enable` on ``accelerator`` (waits for its saves first); nothing if not enabled."""
    st = accelerator.__dict__.get("_tierckpt")
    if st is not None:
        st.disable()
