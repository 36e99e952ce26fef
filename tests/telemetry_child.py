"""A job for ``tests/test_telemetry_queue.py``: OpenTelemetry on, its spans going through the SDK's
``SimpleSpanProcessor`` to an exporter that never returns (a collector that never answers). Saves
three checkpoints without waiting for them, prints ``SAVED``, then trains until the test's SIGTERM.

    python tests/telemetry_child.py LOCAL_DIR

Logs go to stderr. The drain (``[job] on_sigterm = "drain"``) must commit all three: no span
export may stand between a ``dcp.save`` that returned and its commit.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierckpt import TieredWriter  # noqa: E402
from tierckpt.config import config_from_dict  # noqa: E402
from tierckpt.telemetry import otel  # noqa: E402


class NeverAnswers(SpanExporter):
    """An exporter whose collector never answers: ``export`` blocks for good."""

    def export(self, spans):  # type: ignore[no-untyped-def]
        print("EXPORT BLOCKED", flush=True)
        threading.Event().wait()

    def shutdown(self) -> None:
        pass


def main() -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    tp = TracerProvider(shutdown_on_exit=False)
    tp.add_span_processor(SimpleSpanProcessor(NeverAnswers()))
    otel.use_providers(tp)
    cfg = config_from_dict(
        {
            "host": {"buffer_size": "8MiB", "chunk_size": "256KiB"},
            "local": {"path": sys.argv[1], "keep": 10},
            "job": {"telemetry": "otel", "drain_timeout": 10},
        }
    )
    w = TieredWriter(cfg)
    for i in (1, 2, 3):
        dcp.save(
            {"w": torch.full((1000,), float(i)), "step": i}, checkpoint_id=f"step-{i}", storage_writer=w, no_dist=True
        )
    print("SAVED", flush=True)
    x = torch.randn(64, 64)
    while True:  # training, until the signal
        x = torch.tanh(x @ x.T / 64)
        time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main())
