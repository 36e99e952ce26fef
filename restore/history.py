"""The phase history of a job for the ``timeline`` and ``advise`` commands."""

from __future__ import annotations

from tierckpt.config import TierConfig
from tierckpt.telemetry.history import CheckpointRun, group_checkpoints, job_history

from .errors import NotFound

__all__ = ["load_runs"]


def load_runs(cfg: TierConfig, last: int | None) -> tuple[list[CheckpointRun], list[str]]:
    """The newest ``last`` saves of the history this process can read (all with None), oldest
    first, and the places read. Raises NotFound when there are none."""
    records, places = job_history(cfg)
    runs = group_checkpoints(records)
    if not runs:
        raise NotFound(
            "no checkpoint history in "
            + (", ".join(places) or "the configuration")
            + " (written by each rank after every save when the first tier is a local disk and [job] history > 0)"
        )
    return (runs[-last:] if last else runs), places
