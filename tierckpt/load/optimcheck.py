"""A load that leaves the optimizer's state out: found from the plan, told once (the coordinator).

``dcp.load`` with a fresh optimizer's ``state_dict()`` requests its ``param_groups`` but no
``state`` entries (the fresh optimizer has none), so DCP loads no moment and raises nothing;
training then resumes with a fresh optimizer. ``TieredReader.prepare_local_plan`` calls
:func:`warn_missing_optimizer_state` on the coordinator with the plan DCP built.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan

__all__ = ["missing_optimizer_state", "warn_missing_optimizer_state"]

log = logging.getLogger("tierckpt")

_OPTIM_PART = re.compile(r"(?:^|\.)(param_groups|state)\.")


def missing_optimizer_state(saved: Iterable[str], requested: Iterable[str]) -> dict[str, int]:
    """Optimizer state a load leaves out: ``{prefix: n}`` for each optimizer state dict (keys
    ``<prefix>param_groups.*`` and ``<prefix>state.*`` in the checkpoint, ``saved``) whose
    ``param_groups`` the load requests but none of whose ``state`` entries (``n`` of them saved).

    That is what a fresh optimizer's ``state_dict()`` passed to ``dcp.load`` does: its ``state``
    is empty, so DCP loads no moment and raises nothing."""

    def parts(keys: Iterable[str]) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for k in keys:
            m = _OPTIM_PART.search(k)
            if m is not None:
                part = (k[: m.start(1)], m.group(1))
                out[part] = out.get(part, 0) + 1
        return out

    have, want = parts(saved), parts(requested)
    return {
        prefix: n
        for (prefix, kind), n in have.items()
        if kind == "state" and (prefix, "param_groups") in want and (prefix, "state") not in want
    }


def warn_missing_optimizer_state(checkpoint_id: str | None, metadata: Metadata, plan: LoadPlan) -> None:
    """One WARNING per optimizer state dict of ``checkpoint_id`` that ``plan`` loads without its state."""
    left = missing_optimizer_state(metadata.state_dict_metadata, (i.dest_index.fqn for i in plan.items))
    for prefix, n in left.items():
        log.warning(
            "checkpoint %s holds %d optimizer state entries under '%sstate' (Adam's moments, step counts, ...) "
            "but the state dict passed to dcp.load has none there (a fresh optimizer's state_dict()), so "
            "they are NOT loaded and training resumes with a fresh optimizer. Build the state dict with "
            "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer) and apply it with "
            "set_state_dict after dcp.load (README, 'Use')",
            checkpoint_id,
            n,
            prefix,
        )
