"""tierckpt: lazy, tiered checkpointing for torch.distributed.checkpoint."""
from .config import HostConfig, JobConfig, LocalConfig, S3Config, TierConfig, load_config
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all

__version__ = "0.1.0"
__all__ = ["TierConfig", "HostConfig", "LocalConfig", "S3Config", "JobConfig", "load_config", *_errors_all]
