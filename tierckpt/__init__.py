"""tierckpt: lazy, tiered checkpointing for ``torch.distributed.checkpoint``.

Public surface::

    from tierckpt import TieredWriter, TieredReader, Config, load_config
    dcp.save(state_dict, checkpoint_id="step-100", storage_writer=TieredWriter(cfg))
    dcp.load(state_dict, checkpoint_id="latest", storage_reader=TieredReader(cfg))
    tierckpt.latest(cfg), tierckpt.list_checkpoints(cfg)   # what the tiers hold, as the CLI says

The public names are imported on first use (PEP 562 module ``__getattr__``), so that importing a
submodule (``tierckpt.catalog``, ``tierckpt.layout``: what the restore CLI's ``latest`` needs)
does not import torch. ``from tierckpt import TieredWriter`` works as before; adding a public
name is one line in :data:`_LAZY` (``__all__`` is its keys).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import logsetup, moved
from .lazyexports import lazy_exports

logsetup.install()  # WARNINGs (and [job] log_level) print with name, level and rank when the app configures no logging
moved.install()  # the old flat module paths (tierckpt.writer, ...) keep importing, with a warning

if TYPE_CHECKING:
    from .capture.ranksave import SaveStats
    from .catalog.checkpoints import Checkpoint, checkpoint_id_of, latest, list_checkpoints, mark_bad
    from .config import (
        Config,
        HostConfig,
        JobConfig,
        LocalConfig,
        PeerConfig,
        S3Config,
        TierConfig,
        load_config,
        parse_size,
    )
    from .errors import (
        CaptureError,
        CaptureMismatch,
        CheckpointBeingDeleted,
        CheckpointMarkedBad,
        CheckpointNotFound,
        ChecksumMismatch,
        CommitConflict,
        CommitError,
        ConfigError,
        CopiesPending,
        CorruptCheckpoint,
        InvalidCheckpointId,
        NonFiniteError,
        ReplicationError,
        SaveError,
        TierckptError,
        TierError,
        TierUnavailable,
        TornCaptureError,
    )
    from .load.reader import TieredReader
    from .load.resume import resume
    from .save.preempt import DrainReport, drain
    from .save.writer import TieredWriter

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    # public name -> the module (relative to this package) that defines it
    "TieredWriter": ".save.writer",
    "TieredReader": ".load.reader",
    "SaveStats": ".capture.ranksave",
    "Config": ".config",
    "TierConfig": ".config",
    "HostConfig": ".config",
    "LocalConfig": ".config",
    "S3Config": ".config",
    "JobConfig": ".config",
    "PeerConfig": ".config",
    "load_config": ".config",
    "parse_size": ".config",
    "TierckptError": ".errors",
    "ConfigError": ".errors",
    "CheckpointNotFound": ".errors",
    "CheckpointBeingDeleted": ".errors",
    "CorruptCheckpoint": ".errors",
    "InvalidCheckpointId": ".errors",
    "ChecksumMismatch": ".errors",
    "CommitConflict": ".errors",
    "SaveError": ".errors",
    "CaptureError": ".errors",
    "CommitError": ".errors",
    "ReplicationError": ".errors",
    "CopiesPending": ".errors",
    "TornCaptureError": ".errors",
    "CaptureMismatch": ".errors",
    "NonFiniteError": ".errors",
    "CheckpointMarkedBad": ".errors",
    "TierError": ".errors",
    "TierUnavailable": ".errors",
    "latest": ".catalog.checkpoints",
    "list_checkpoints": ".catalog.checkpoints",
    "Checkpoint": ".catalog.checkpoints",
    "checkpoint_id_of": ".catalog.checkpoints",
    "mark_bad": ".catalog.checkpoints",
    "resume": ".load.resume",
    "drain": ".save.preempt",
    "DrainReport": ".save.preempt",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
