"""A job for ``tests/test_crash_history.py``: saves ``step-<FIRST>`` .. ``step-<FIRST+N-1>`` (one
training step of sleep apart), then, with ``hang``, prints ``SAVED`` and trains until killed;
without, waits for its checkpoints and exits.

    python tests/history_child.py LOCAL_DIR FIRST N [hang]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierckpt import TieredWriter  # noqa: E402
from tierckpt.config import config_from_dict  # noqa: E402


def main() -> int:
    root, first, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cfg = config_from_dict(
        {"host": {"buffer_size": "4MiB", "chunk_size": "256KiB"}, "local": {"path": root, "keep": 20}}
    )
    w = TieredWriter(cfg)
    for step in range(first, first + n):
        time.sleep(0.05)  # the training between two saves
        dcp.save({"w": torch.full((1000,), float(step))}, checkpoint_id=f"step-{step}", storage_writer=w, no_dist=True)
        w.wait_captured()
    if sys.argv[4:] == ["hang"]:
        print("SAVED", flush=True)
        while True:
            time.sleep(1)
    w.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
