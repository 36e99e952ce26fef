"""What ``[job] async_future`` costs: 8 ``dcp.async_save`` of 64 MiB, ``f.result()`` after each.

    python tools/async_future_cost.py MODE LOCAL_DIR     # MODE: accepted | captured | committed_local

Prints the median time ``dcp.async_save`` blocks the caller, the median time until the future is
done, and how many checkpoints ``tierckpt.list_checkpoints`` lists right after ``f.result()``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

import tierckpt
from tierckpt import TieredWriter
from tierckpt.config import config_from_dict


def main(mode: str, root: str, saves: int = 8) -> str:
    cfg = config_from_dict(
        {"host": {"buffer_size": "256MiB"}, "local": {"path": root, "keep": 3}, "job": {"async_future": mode}}
    )
    w = TieredWriter(cfg)
    sd = {f"t{i}": torch.randn(4 << 20) for i in range(4)}  # 64 MiB
    call, done, listed = [], [], 0
    for i in range(saves):
        t0 = time.perf_counter()
        f = dcp.async_save(sd, checkpoint_id=f"step-{i}", storage_writer=w)
        t1 = time.perf_counter()
        f.result()
        t2 = time.perf_counter()
        listed += f"step-{i}" in [c.id for c in tierckpt.list_checkpoints(cfg)]
        w.wait_captured()
        call.append(t1 - t0)
        done.append(t2 - t0)
        for _ in range(3):  # a little training between saves
            torch.randn(512, 512) @ torch.randn(512, 512)
    w.wait()
    return (
        f"{mode}: async_save returns median {1e3 * statistics.median(call[1:]):.1f} ms; future done after "
        f"median {1e3 * statistics.median(done[1:]):.1f} ms; listed at f.result(): {listed}/{saves}"
    )


if __name__ == "__main__":
    print(main(sys.argv[1], sys.argv[2]))
