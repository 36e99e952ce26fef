"""tierckpt: lazy, tiered checkpointing for ``torch.distributed.checkpoint``.

Public surface::

    from tierckpt import TieredWriter, TieredReader, Config, load_config
    dcp.save(state_dict, checkpoint_id="step-100", storage_writer=TieredWriter(cfg))
    dcp.load(state_dict, checkpoint_id="latest", storage_reader=TieredReader(cfg))
"""

from .config import Config, HostConfig, JobConfig, LocalConfig, PeerConfig, S3Config, TierConfig, load_config, parse_size
from .errors import (
    CaptureError,
    CheckpointNotFound,
    CommitError,
    ReplicationError,
    SaveError,
    ChecksumMismatch,
    CommitConflict,
    ConfigError,
    CorruptCheckpoint,
    TierckptError,
    TierError,
    TierUnavailable,
    TornCaptureError,
)
from .save import SaveStats
from .reader import TieredReader
from .writer import TieredWriter

__version__ = "0.1.0"

__all__ = [
    "TieredWriter",
    "TieredReader",
    "Config",
    "TierConfig",
    "HostConfig",
    "LocalConfig",
    "S3Config",
    "JobConfig",
    "PeerConfig",
    "SaveStats",
    "load_config",
    "parse_size",
    "TierckptError",
    "ConfigError",
    "CheckpointNotFound",
    "CorruptCheckpoint",
    "ChecksumMismatch",
    "CommitConflict",
    "SaveError",
    "CaptureError",
    "CommitError",
    "ReplicationError",
    "TornCaptureError",
    "TierError",
    "TierUnavailable",
]
