"""Example torchtitan config functions with tierckpt checkpointing (the torchtitan recipe in docs/integrations.md).

    PYTHONPATH=tools/torchtitan_example torchrun --nproc_per_node 8 -m torchtitan.train \
        --module tierckpt_llama3 --config llama3_8b_tierckpt \
        --checkpoint.tierckpt_config tools/torchtitan_example/tiers.toml

The one line that matters is ``config.checkpoint = TierckptCheckpointManager.Config(...)``: every
other field keeps torchtitan's meaning (``interval``, ``async_mode``, ``keep_latest_k``...).
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
from torchtitan.trainer import Trainer

from tierckpt.integrations.torchtitan import TierckptCheckpointManager


def with_tierckpt(config: Trainer.Config, tierckpt_config: str = "tools/torchtitan_example/tiers.toml") -> Trainer.Config:
    """``config`` with its checkpoint section handled by tierckpt (its other fields kept)."""
    fields = {f.name: getattr(config.checkpoint, f.name) for f in dataclasses.fields(config.checkpoint)
              if not f.name.startswith("_")}
    fields.update(enable=True, tierckpt_config=tierckpt_config)
    config.checkpoint = TierckptCheckpointManager.Config(**fields)
    return config


def llama3_debugmodel_tierckpt() -> Trainer.Config:
    return with_tierckpt(llama3_debugmodel())


def llama3_8b_tierckpt() -> Trainer.Config:
    config = with_tierckpt(llama3_8b())
    config.checkpoint.async_mode = "async"
    return config
