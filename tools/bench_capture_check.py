#!/usr/bin/env python
"""CPU cost of the capture checks' reductions (``[job] verify_capture``, ``[job] nonfinite``) per GiB,
next to CRC32C and a plain copy, on one CPU tensor:

    python tools/bench_capture_check.py [--mib 256] [--threads 1]

Each operation runs once to warm up, then 5 times, the fastest counted; CPU seconds (user+system, getrusage: every
thread, torch's intra-op threads included) per GiB and wall GB/s. The "host pass" rows run the
flush workers' own code (:meth:`CaptureCheck.seal`: CRC32C, digest and NaN/Inf scan fused, 1 MiB
blocks) over 64 MiB chunks; the "GPU path" rows are the torch ops a GPU source runs on its
device, timed here on CPU for reference (a CPU source uses numpy). The whole-save figures (off vs
``verify_capture = "all"`` + ``nonfinite = "warn"``) are in ``tools/bench.py --only cpu``; on a GPU
in ``tools/gpu_check.py``.

``--stall N``: also the stall a training step sees when it needs the state right after the save:
``dcp.save`` + ``wait_captured()`` of a ``--mib`` state (fp32 and bf16 tensors of 16 MiB), off,
``verify_capture = "sample"`` and ``"all"`` (each + ``nonfinite = "warn"``) in turn, N saves each
after a warm-up; median and min in ms.
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

from tierckpt.capture.copier import Piece, Source  # noqa: E402
from tierckpt.capture.verify import CaptureCheck, _maybe_nonfinite, _Probe, block_nonfinite, np_digest  # noqa: E402
from tierckpt.checksum import crc32c  # noqa: E402

CHUNK = 64 << 20  # the pool's default chunk
_DIGESTS: dict[tuple[int, torch.dtype], int] = {}


def word_digest_torch(flat: torch.Tensor) -> torch.Tensor:
    """The digest with torch ops (what a GPU source runs on its device), here on CPU."""
    w = flat.numel() - flat.numel() % 8
    return flat[:w].view(torch.int64).sum()


def seal(t: torch.Tensor, verify: str, nonfinite: str) -> None:
    """The flush workers' pass over a host copy of ``t`` (here ``t`` itself), chunk by chunk:
    :meth:`CaptureCheck.seal` (CRC32C, and the digest and NaN/Inf scan its modes ask for); with
    both checks off the CRC32C loop the flush worker runs instead. The source digest is taken
    once, outside the timed runs (its own row)."""
    arr = t.view(torch.uint8).reshape(-1).numpy()
    n = arr.size
    src = Source(item=0, fqn="t", pos=0, length=n, tensor=t)
    chunks = [[Piece(src, a, 0, min(CHUNK, n - a))] for a in range(0, n, CHUNK)]
    crcs = [[0] * len(chunks)]
    if verify == "off" and nonfinite == "ignore":
        for j, (p,) in enumerate(chunks):
            crcs[0][j] = crc32c(arr[p.src_off : p.src_off + p.n])
        return
    check = CaptureCheck("bench", 0, [src], chunks, 1, verify, nonfinite, 0)
    key = (t.data_ptr(), t.dtype)
    if key not in _DIGESTS:  # the source side's half, taken once (outside the timed runs)
        _DIGESTS[key] = np_digest(arr)
    check.items[0].probe = _Probe((_DIGESTS[key] if check.items[0].digest else 0, 1))
    for j, (p,) in enumerate(chunks):
        check.seal([p], [(0, j, 0, p.n)], arr[p.src_off : p.src_off + p.n], crcs)


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(f: Callable[[], object], nbytes: int, reps: int = 5) -> tuple[float, float]:
    """(CPU-s per GiB, GB/s) of ``f``: the fastest of ``reps`` runs after one warm-up (on a shared
    box other processes only ever add to a run's time: the minimum is the steadiest figure)."""
    f()
    best_c = best_t = float("inf")
    for _ in range(reps):
        c0, t0 = cpu(), time.perf_counter()
        f()
        best_c, best_t = min(best_c, cpu() - c0), min(best_t, time.perf_counter() - t0)
    return best_c / (nbytes / (1 << 30)), nbytes / best_t / 1e9


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
        ("source digest, CPU (numpy, capture thread)", lambda: np_digest(u.numpy()), u.numpy().size),
        ("GPU path's torch ops run on CPU: digest", lambda: word_digest_torch(u), u.numpy().size),
        ("GPU path's torch ops run on CPU: fp32 sum", lambda: _maybe_nonfinite(x), u.numel()),
        ("GPU path's torch ops run on CPU: bf16 aminmax", lambda: _maybe_nonfinite(b), b.numel() * 2),
        ("NaN/Inf scan fp32 (numpy, whole tensor)", lambda: block_nonfinite(u.numpy(), torch.float32), u.numel()),
        ("CRC32C alone (every save)", lambda: crc32c(u.numpy()), u.numel()),
        ("host pass: CRC32C, checks off", lambda: seal(x, "off", "ignore"), u.numel()),
        ("host pass: CRC32C + NaN/Inf fp32", lambda: seal(x, "off", "warn"), u.numel()),
        ("host pass: CRC32C + NaN/Inf bf16", lambda: seal(b, "off", "warn"), b.numel() * 2),
        ("host pass: CRC32C + digest + NaN/Inf fp32", lambda: seal(x, "all", "warn"), u.numel()),
        ("host pass: CRC32C + digest + NaN/Inf bf16", lambda: seal(b, "all", "warn"), b.numel() * 2),
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
        for name, job in (
            ("off", JobConfig()),
            ("sample+warn", JobConfig(verify_capture="sample", nonfinite="warn")),
            ("all+warn", JobConfig(verify_capture="all", nonfinite="warn")),
        )
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
            f"stall {name:11s} save+wait_captured: median {statistics.median(v) * 1e3:7.1f} ms, min {min(v) * 1e3:7.1f} ms"
        )
    close_all()


if __name__ == "__main__":
    sys.exit(main())
