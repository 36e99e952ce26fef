#!/usr/bin/env python
"""CPU cost of the capture checks' reductions (``[job] verify_capture``, ``[job] nonfinite``) per GiB,
next to CRC32C and a plain copy, on one CPU tensor:

    python tools/bench_capture_check.py [--mib 256] [--threads 1]

Each operation runs once to warm up, then 3 times; CPU seconds (user+system, getrusage: every
thread, torch's intra-op threads included) per GiB and wall GB/s. The whole-save figures (off vs
``verify_capture = "all"`` + ``nonfinite = "warn"``) are in ``tools/bench.py --only cpu``; on a GPU
in ``tools/gpu_check.py``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierckpt.capture.verify import _maybe_nonfinite, word_digest  # noqa: E402
from tierckpt.checksum import crc32c  # noqa: E402


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(f: Callable[[], object], nbytes: int) -> tuple[float, float]:
    f()
    c0, t0 = cpu(), time.perf_counter()
    for _ in range(3):
        f()
    c, t = (cpu() - c0) / 3, (time.perf_counter() - t0) / 3
    return c / (nbytes / (1 << 30)), nbytes / t / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.mib << 18)  # fp32
    b = x.to(torch.bfloat16)
    u = x.view(torch.uint8)
    y = torch.empty_like(u)
    ops: list[tuple[str, Callable[[], object], int]] = [
        ("source/host digest (word_digest)", lambda: word_digest(u), u.numel()),
        ("non-finite pre-scan fp32 (sum)", lambda: _maybe_nonfinite(x), u.numel()),
        ("non-finite pre-scan bf16 (aminmax)", lambda: _maybe_nonfinite(b), b.numel() * 2),
        ("bf16 sum accumulated in fp32 (not used)", lambda: b.sum(dtype=torch.float32), b.numel() * 2),
        ("CRC32C (every save)", lambda: crc32c(u.numpy()), u.numel()),
        ("copy (torch copy_)", lambda: y.copy_(u), u.numel()),
    ]
    print(f"{args.mib} MiB, torch {torch.__version__}, {args.threads} intra-op thread(s)")
    for name, f, n in ops:
        c, g = measure(f, n)
        print(f"{name:42s} {c:6.3f} CPU-s/GiB  {g:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
