"""Adapters that plug tierckpt into training frameworks.

* :mod:`tierckpt.integrations.torchtitan`: a torchtitan ``CheckpointManager`` whose saves and
  loads go through the tiers (``pip install "tierckpt[torchtitan]"``).

Each adapter imports its framework only when imported itself.
"""
