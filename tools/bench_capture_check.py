#!/usr/bin/env python
"""CPU cost of the capture checks' reductions (``[job] verify_capture``, ``[job] nonfinite``) per GiB,
next to CRC32C and a plain copy, on one CPU tensor:

    python tools/bench_capture_check.py [--mib 256] [--threads 1]

Each operation runs once to warm up, then 3 times; CPU seconds (user+system, getrusage: every
thread, torch's intra-op threads included) per GiB and wall GB/s. The whole-save figures (off vs
``verify_capture = "all"`` + ``nonfinite = "warn"``) are in ``tools/bench.py --only cpu``; on a GPU
in ``tools/gpu_check.py``.

``--stall N``: also the stall a training step sees when it needs the state right after the save:
``dcp.save`` + ``wait_captured()`` of a ``--mib`` state (fp32 and bf16 tensors of 16 MiB), off and
``verify_capture = "all"`` + ``nonfinite = "warn"`` alternating, N saves each after a warm-up;
median and min in ms.
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
    ap.add_argument("--stall", type=int, default=0, help="also measure the stall, this many saves per mode")
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
    if args.stall:
        stall(args.mib, args.stall)
    return 0


def stall(mib: int, n: int) -> None:
    import statistics
    import tempfile

    import torch.distributed.checkpoint as dcp

    from tierckpt import HostConfig, JobConfig, LocalConfig, TierConfig, TieredWriter
    from tierckpt.chain.engine import close_all

    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(4 << 20, generator=g) for i in range(mib // 32)}
    sd |= {f"h{i}": torch.randn(8 << 20, generator=g).to(torch.bfloat16) for i in range(mib // 32)}
    root = Path(tempfile.mkdtemp(prefix="tierckpt-stall-"))
    writers = {
        name: TieredWriter(
            TierConfig(
                host=HostConfig(buffer_size=2 * mib << 20, chunk_size=16 << 20),
                local=LocalConfig(path=str(root / name), keep=1, fsync=False),
                job=job,
            )
        )
        for name, job in (("off", JobConfig()), ("all+warn", JobConfig(verify_capture="all", nonfinite="warn")))
    }
    times: dict[str, list[float]] = {k: [] for k in writers}
    for i in range(n + 1):
        for name, w in writers.items():
            t0 = time.perf_counter()
            dcp.save(sd, checkpoint_id=f"s-{i}", storage_writer=w, no_dist=True)
            w.wait_captured()
            if i:
                times[name].append(time.perf_counter() - t0)
            w.wait()
    for name, v in times.items():
        print(
            f"stall {name:9s} save+wait_captured: median {statistics.median(v) * 1e3:7.1f} ms, min {min(v) * 1e3:7.1f} ms"
        )
    close_all()


if __name__ == "__main__":
    sys.exit(main())
