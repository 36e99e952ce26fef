"""Adapters that plug tierckpt into training frameworks.

* :mod:`tierckpt.integrations.torchtitan`: a torchtitan ``CheckpointManager`` whose saves and
  loads go through the tiers (``pip install "tierckpt[torchtitan]"``).

* :mod:`tierckpt.integrations.lightning`: PyTorch Lightning's ``CheckpointIO`` (DDP, single
  device) and sharded strategies through the tiers (``pip install "tierckpt[lightning]"``).
* :mod:`tierckpt.integrations.accelerate`: ``Accelerator.save_state``/``load_state`` through the
  tiers, one ``enable()`` call (``pip install "tierckpt[accelerate]"``).

Each adapter imports its framework only when imported itself. Shared parts (no framework import):
:mod:`~tierckpt.integrations.statetree` (a checkpoint dict as DCP items),
:mod:`~tierckpt.integrations.deletions` (whole-checkpoint deletions on every tier) and
:mod:`~tierckpt.integrations.pathmap` (framework paths as checkpoints: pointer files).

Stage ``integrations`` (top): May import every stage, preferably the public API only. May be
imported by nothing in ``tierckpt`` (applications, tests and tools only).
"""
