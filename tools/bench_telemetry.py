#!/usr/bin/env python
"""What telemetry costs per checkpoint: process CPU seconds and wall time, side by side in one run.

    python tools/bench_telemetry.py [--mib 64] [--blocks 6] [--per-block 5] [--out bench-out/telemetry.json]

Three configurations of the same one-process job (a ``--mib`` state saved again and again into a
local tier, each save waited for; ``keep = 2``), in interleaved blocks (bare, default, otel, bare, ...):

* ``bare``: ``[job] history = 0, telemetry = "none"``: no history file, no export (the phase log in
  ``SaveStats`` still runs: a few ``time.time()`` calls per checkpoint);
* ``default``: ``history = 64, telemetry = "none"`` (what a job gets without asking): one history
  file rewritten per checkpoint;
* ``otel``: ``history = 64, telemetry = "otel"`` with the OpenTelemetry SDK as an application would
  set it up: a ``BatchSpanProcessor`` (its own thread) into an in-memory exporter, a meter
  provider whose reader collects after every block.

CPU: ``time.process_time`` of the whole process (every thread: DCP's planning on this thread,
tierckpt's capture, flush and commit threads, the SDK's export thread) per checkpoint. Reported:
median and mean per checkpoint over the blocks, and the difference to ``bare``. That difference
is within the noise of a shared machine, so the telemetry's own work is also timed directly: the
CPU seconds (``time.thread_time``) spent inside ``EngineTelemetry.settled`` (the history write, the
spans and the metrics of each checkpoint), per checkpoint and as a share of the checkpoint's CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from tierckpt import TieredWriter  # noqa: E402
from tierckpt.config import Config, HostConfig, JobConfig, LocalConfig  # noqa: E402

MiB = 1 << 20
MODES = {"bare": {"history": 0, "telemetry": "none"}, "default": {}, "otel": {"telemetry": "otel"}}


def _state(mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    sizes = [mib * MiB // 4 // 8] * 6 + [mib * MiB // 4 // 4]  # ~mib MiB of fp32 in 7 tensors
    return {f"w{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)} | {"step": 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--per-block", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench-out" / "telemetry.json"))
    ap.add_argument("--dir", default=str(ROOT / "bench-out"))
    a = ap.parse_args(argv)

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tierckpt.telemetry import hub, otel

    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(spans))
    reader = InMemoryMetricReader()
    otel.use_providers(tp, MeterProvider(metric_readers=[reader]))

    Path(a.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierckpt-bench-telemetry-", dir=a.dir))
    sd = _state(a.mib)
    nbytes = sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))
    own: dict[str, float] = {m: 0.0 for m in MODES}
    writers = {
        m: TieredWriter(
            Config(
                host=HostConfig(buffer_size=256 * MiB, chunk_size=16 * MiB),
                local=LocalConfig(path=str(work / m), keep=2),
                job=JobConfig(**kw),
            )
        )
        for m, kw in MODES.items()
    }
    mode_of = {id(w.engine.telemetry): m for m, w in writers.items()}
    settled = hub.EngineTelemetry.settled

    def timed(self: hub.EngineTelemetry, job: object) -> None:  # the telemetry's own CPU, measured in place
        c0 = time.thread_time()
        settled(self, job)
        own[mode_of.get(id(self), "bare")] += time.thread_time() - c0

    hub.EngineTelemetry.settled = timed  # type: ignore[method-assign]
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    n = 0
    try:
        for m, w in writers.items():  # warm-up: pools, threads, DCP paths
            dcp.save(sd, checkpoint_id=f"warm-{m}", storage_writer=w, no_dist=True)
            w.wait()
        own.update({m: 0.0 for m in MODES})
        for b in range(a.blocks):
            for m, w in writers.items():
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(a.per_block):
                    n += 1
                    sd["step"] = n
                    dcp.save(sd, checkpoint_id=f"step-{n}", storage_writer=w, no_dist=True)
                    w.wait()
                if m == "otel":
                    tp.force_flush()  # the span export of this block counts here
                    reader.get_metrics_data()
                cpu[m].append((time.process_time() - c0) / a.per_block)
                wall[m].append((time.perf_counter() - t0) / a.per_block)
            print(
                f"block {b + 1}/{a.blocks}: " + ", ".join(f"{m} {cpu[m][-1] * 1e3:.1f} ms CPU" for m in MODES),
                file=sys.stderr,
            )
    finally:
        for w in writers.values():
            w.close()
        shutil.rmtree(work, ignore_errors=True)
    base_med, base_mean = statistics.median(cpu["bare"]), statistics.mean(cpu["bare"])
    rows = []
    saves = a.blocks * a.per_block
    for m in MODES:
        med, mean = statistics.median(cpu[m]), statistics.mean(cpu[m])
        rows.append(
            {
                "mode": m,
                "saves": saves,
                "cpu_ms_median": med * 1e3,
                "cpu_ms_mean": mean * 1e3,
                "telemetry_cpu_ms_per_ckpt": own[m] / saves * 1e3,
                "telemetry_cpu_pct": 100 * own[m] / saves / mean,
                "cpu_ms_blocks": [x * 1e3 for x in cpu[m]],
                "wall_ms_median": statistics.median(wall[m]) * 1e3,
                "cpu_vs_bare_median_pct": 100 * (med / base_med - 1),
                "cpu_vs_bare_mean_pct": 100 * (mean / base_mean - 1),
            }
        )
    print(
        f"\n{a.mib} MiB state ({nbytes / MiB:.0f} MiB of tensors), {a.blocks} interleaved blocks x {a.per_block} saves "
        "per mode, each save waited for; process CPU (all threads) per checkpoint"
    )
    print(
        f"{'mode':8} {'CPU ms med':>10} {'CPU ms mean':>11} {'wall ms med':>11} {'vs bare med':>11} {'vs bare mean':>12} "
        f"{'telemetry CPU ms':>16} {'share':>7}"
    )
    for r in rows:
        print(
            f"{r['mode']:8} {r['cpu_ms_median']:10.2f} {r['cpu_ms_mean']:11.2f} {r['wall_ms_median']:11.1f} "
            f"{r['cpu_vs_bare_median_pct']:+10.2f}% {r['cpu_vs_bare_mean_pct']:+11.2f}% "
            f"{r['telemetry_cpu_ms_per_ckpt']:16.3f} {r['telemetry_cpu_pct']:6.2f}%"
        )
    print(f"spans exported: {len(spans.get_finished_spans())}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(["python"] + sys.argv), "mib": a.mib, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
