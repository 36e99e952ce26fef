#!/usr/bin/env python
"""The ``checksum`` bench: CRC32C throughput and what a checksumming thread costs the training thread.

    python tools/bench_checksum.py [--mib 256] [--seconds 2] [--rounds 2] [--out bench-out/bench_checksum.json]

Every byte a checkpoint moves is checksummed on a background thread (flush, promotion, reads),
so two things matter: CPU per byte, and whether the checksum holds the GIL while the training
thread wants to run Python. For each CRC32C library installed (``crc32c``, the one tierckpt uses
through :mod:`tierckpt.checksum`; ``google-crc32c`` when present, for comparison:
``pip install google-crc32c``), measured side by side in one run:

* ``GB/s 1 thread``: one thread checksums ``--mib`` MiB in 16 MiB pieces, 3 times per round after a
  warm-up pass (wall and CPU seconds);
* ``2 threads s``: two threads each checksum the same buffer at once (with the GIL held the two
  run one after the other);
* ``python thread``: a thread running small pieces of pure Python for ``--seconds`` while another
  thread checksums 64 MiB over and over; its iterations relative to the same loop with no
  checksum running (1.0 = unaffected) and its longest gap between two iterations.

Rounds alternate the libraries (A B A B); the table gives the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

PIECE = 16 << 20


def _libraries() -> dict[str, Callable]:
    libs: dict[str, Callable] = {}
    from tierckpt.checksum import crc32c

    libs["crc32c (tierckpt)"] = crc32c
    try:
        import google_crc32c
    except ImportError:
        pass
    else:
        libs["google-crc32c"] = google_crc32c.value
    return libs


def _sweep(f: Callable, arr: np.ndarray) -> None:
    for o in range(0, len(arr), PIECE):
        f(arr[o : o + PIECE])


def _one_thread(f: Callable, arr: np.ndarray) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    _sweep(f, arr)
    return time.perf_counter() - t0, time.process_time() - c0


def _two_threads(f: Callable, arr: np.ndarray) -> float:
    ts = [threading.Thread(target=_sweep, args=(f, arr)) for _ in range(2)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def _python_loop(seconds: float) -> tuple[int, float]:
    n, worst = 0, 0.0
    last = time.perf_counter()
    end = last + seconds
    while True:
        sum(range(200))  # a few microseconds of Python
        now = time.perf_counter()
        worst = max(worst, now - last)
        last = now
        n += 1
        if now > end:
            return n, worst


def _next_to(f: Callable | None, arr: np.ndarray, seconds: float) -> tuple[int, float]:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            _sweep(f, arr)  # type: ignore[arg-type]

    t = threading.Thread(target=spin) if f is not None else None
    if t is not None:
        t.start()
    try:
        return _python_loop(seconds)
    finally:
        stop.set()
        if t is not None:
            t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench-out/bench_checksum.json")
    args = ap.parse_args()
    arr = np.frombuffer(bytearray(os.urandom(args.mib << 20)), dtype=np.uint8)
    small = arr[: 64 << 20]
    libs = _libraries()
    raw: dict[str, dict[str, list[float]]] = {
        k: {"wall": [], "cpu": [], "two": [], "iters": [], "gap": []} for k in libs
    }
    base: list[int] = []
    for _ in range(args.rounds):
        base.append(_next_to(None, small, args.seconds)[0])
        for name, f in libs.items():
            _sweep(f, arr)  # warm-up: right after the Python loop the first sweep runs several times slower here
            r = raw[name]
            for _ in range(3):
                wall, cpu = _one_thread(f, arr)
                r["wall"].append(wall)
                r["cpu"].append(cpu)
            r["two"].append(_two_threads(f, arr))
            n, gap = _next_to(f, small, args.seconds)
            r["iters"].append(n)
            r["gap"].append(gap)
    nb = statistics.median(base)
    gb = len(arr) / 1e9
    rows = []
    for name, r in raw.items():
        rows.append(
            {
                "library": name,
                "gb_per_s_1_thread": gb / statistics.median(r["wall"]),
                "cpu_s_per_gb": statistics.median(r["cpu"]) / gb,
                "two_threads_s": statistics.median(r["two"]),
                "python_thread_speed": statistics.median(r["iters"]) / nb,
                "python_thread_worst_gap_ms": 1e3 * max(r["gap"]),
            }
        )
    print(f"CRC32C, {args.mib} MiB in {PIECE >> 20} MiB pieces, {args.rounds} rounds, {os.cpu_count()} cores")
    print(
        f"{'library':20s} | {'GB/s 1 thread':>13s} | {'CPU s/GB':>8s} | {'2 threads s':>11s} | "
        f"{'python thread':>13s} | {'worst gap ms':>12s}"
    )
    for row in rows:
        print(
            f"{row['library']:20s} | {row['gb_per_s_1_thread']:13.2f} | {row['cpu_s_per_gb']:8.3f} | "
            f"{row['two_threads_s']:11.3f} | {row['python_thread_speed']:13.2f} | {row['python_thread_worst_gap_ms']:12.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "raw": raw, "baseline_iters": base}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
