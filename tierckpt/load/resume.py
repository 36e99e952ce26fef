"""Resume that rolls back on its own: the newest *healthy* checkpoint, checked, or the one before.

:func:`resume` is the loop a training script (or an integration) runs before training::

    cid = tierckpt.resume(state_dict, cfg)    # loads in place; None: nothing to resume from

1. ``tierckpt.latest(cfg, healthy=True)``: the newest committed checkpoint that is not marked
   bad, has no NaN/Inf recorded at capture and whose metadata some tier can read
   (:mod:`tierckpt.catalog.health`);
2. ``dcp.load`` of it through :class:`~tierckpt.TieredReader` (every rank; each tier holding it is
   tried in turn, every byte checked against its CRC32C);
3. on rank 0, the check: ``check`` or ``[job] on_resume_check = "module:function"``, called with
   the loaded state; its verdict reaches every rank (a broadcast when a process group is up).

A load that finds the checkpoint damaged on every tier (:class:`~tierckpt.errors.CorruptCheckpoint`,
checksum mismatches included) or a check that raises marks the checkpoint bad on every tier
(rank 0, :func:`~tierckpt.catalog.health.mark_bad`, the reason recorded) and the loop goes on with
the next older healthy checkpoint, at most ``[job] max_rollbacks`` times; past that it raises
:class:`~tierckpt.errors.CheckpointMarkedBad` naming each checkpoint given up and why. Any other
failure (a tier unreachable) is raised as it is: an outage is not a reason to mark data bad.
A failed attempt may have written part of ``state_dict``; the next load overwrites every key.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

from ..catalog.checkpoints import _config, latest
from ..catalog.health import mark_bad
from ..config import Config
from ..errors import CheckpointMarkedBad, ConfigError, CorruptCheckpoint, find_error

__all__ = ["resume", "resume_check", "check_loaded"]

log = logging.getLogger("tierckpt")

Check = Callable[[Any], Any]


def resume_check(cfg: Config) -> Check | None:
    """The function ``[job] on_resume_check`` names (``"module:function"``), imported; None when unset."""
    spec = cfg.job.on_resume_check
    if not spec:
        return None
    mod, _, name = spec.partition(":")
    try:
        obj: Any = importlib.import_module(mod)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"[job] on_resume_check: cannot import {spec!r}: {e}") from e
    if not callable(obj):
        raise ConfigError(f"[job] on_resume_check: {spec!r} is not callable")
    return obj  # type: ignore[no-any-return]


def resume(
    state_dict: dict[str, Any],
    cfg: Config | str | os.PathLike | None = None,
    *,
    check: Check | None = None,
    max_rollbacks: int | None = None,
    load: Callable[[dict[str, Any], str], None] | None = None,
) -> str | None:
    """Load the newest healthy checkpoint into ``state_dict`` (in place, as ``dcp.load``), check it,
    roll back past bad ones (see the module docstring); return the id loaded, None when there is
    no healthy checkpoint to resume from. Every rank calls it (``dcp.load`` is collective).

    ``check``: called on rank 0 with the loaded ``state_dict``; raising rejects the checkpoint
    (default: ``[job] on_resume_check``). ``max_rollbacks``: default ``[job] max_rollbacks``.
    ``load(state_dict, checkpoint_id)``: how to load (default: ``dcp.load`` through a
    :class:`~tierckpt.TieredReader` of ``cfg``), for integrations that load their own way.
    """
    from ..tiers import make_tiers

    conf = _config(cfg)
    check = check if check is not None else resume_check(conf)
    limit = conf.job.max_rollbacks if max_rollbacks is None else max_rollbacks
    do_load = load if load is not None else _dcp_loader(conf)
    given_up: list[str] = []
    cid = latest(conf, healthy=True)
    while cid is not None:
        why = _attempt(state_dict, cid, do_load, check)
        if why is None:
            if given_up:
                log.warning("RESUME: resumed from %s after rolling back past %s", cid, "; ".join(given_up))
            return cid
        given_up.append(f"{cid}: {why}")
        if _rank() == 0:
            tiers = make_tiers(conf)
            try:
                mark_bad(tiers, cid, f"resume: {why}")
            finally:
                for t in tiers:
                    t.close()
        _barrier()
        if len(given_up) > limit:
            raise CheckpointMarkedBad(
                f"resume gave up after {len(given_up)} bad checkpoint(s) ([job] max_rollbacks = {limit}): "
                + "; ".join(given_up)
            )
        older = latest(conf, before=cid, healthy=True)
        log.error(
            "RESUME: checkpoint %s is bad (%s); %s",
            cid,
            why,
            f"rolling back to {older}" if older else "no older healthy checkpoint is left",
        )
        cid = older
    return None


def _attempt(
    state_dict: dict[str, Any], cid: str, load: Callable[[dict[str, Any], str], None], check: Check | None
) -> str | None:
    """Load and check ``cid``; the reason it is bad, or None. Raises what is not the data's fault."""
    try:
        load(state_dict, cid)
    except BaseException as e:
        bad = find_error(e, CorruptCheckpoint)
        if bad is None:
            raise
        return f"cannot be loaded from any tier ({type(bad).__name__}: {bad})"
    verdict: str | None = None
    if check is not None and _rank() == 0:
        try:
            check(state_dict)
        except Exception as e:  # noqa: BLE001 - the hook's verdict, whatever it raises
            verdict = f"the resume check rejected it ({type(e).__name__}: {e})"
    return _share(verdict)


def check_loaded(conf: Config, state_dict: Any, cid: str) -> str | None:
    """After an integration loaded ``cid`` into ``state_dict`` (every rank): run ``[job]
    on_resume_check`` on rank 0; when it rejects the checkpoint, mark it bad (rank 0) and return
    why on every rank (None: accepted, or no hook)."""
    check = resume_check(conf)
    if check is None:
        return None
    why = _attempt(state_dict, cid, lambda _sd, _cid: None, check)
    if why is not None and _rank() == 0:
        from ..tiers import make_tiers

        tiers = make_tiers(conf)
        try:
            mark_bad(tiers, cid, f"resume: {why}")
        finally:
            for t in tiers:
                t.close()
    _barrier()
    return why


def _dcp_loader(conf: Config) -> Callable[[dict[str, Any], str], None]:
    def load(state_dict: dict[str, Any], cid: str) -> None:
        import torch.distributed.checkpoint as dcp

        from .reader import TieredReader

        dcp.load(state_dict, checkpoint_id=cid, storage_reader=TieredReader(conf))

    return load


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def _share(verdict: str | None) -> str | None:
    """Rank 0's verdict on every rank."""
    dist = _dist()
    if dist is None:
        return verdict
    box = [verdict]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()
