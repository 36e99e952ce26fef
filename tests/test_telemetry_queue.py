"""Telemetry never blocks a checkpoint (issue 32, item 7): with ``[job] telemetry = "otel"`` and the
OpenTelemetry SDK's ``SimpleSpanProcessor`` in front of an exporter that never returns (a collector
that never answers), saves still commit, ``writer.wait()`` returns, a SIGTERM drain commits what
was saved, the history is still written, and the spans that cannot be queued are dropped and
counted (bounded queue, one telemetry thread: :mod:`tierckpt.telemetry.worker`).

Before the fix the spans were exported on the commit thread (``Engine._settle``): the first save's
``writer.wait()`` never returned and the next checkpoints were never committed."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierckpt
from tierckpt import TieredWriter, telemetry
from tierckpt.config import Config, HostConfig, JobConfig, LocalConfig
from tierckpt.telemetry.history import read_history
from tierckpt.tiers import make_local

pytest.importorskip("opentelemetry.sdk")

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
WAIT = 30  # generous bound on what must finish: a hang fails the test instead of hanging it


def bounded(fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` on a daemon thread, waited for at most :data:`WAIT` seconds (a hang fails the test)."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WAIT)
    assert not t.is_alive(), f"{what} did not return within {WAIT} s"
    if err:
        raise err[0]
    return out[0] if out else None


@pytest.fixture
def stuck_exporter(monkeypatch):
    """Spans go through a ``SimpleSpanProcessor`` to an exporter that blocks until the test ends;
    a telemetry queue of 2 records; metrics to an in-memory reader. Yields (exporter, reader)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from tierckpt.telemetry import hub, otel

    try:
        from tierckpt.telemetry import worker
    except ImportError:  # the code before the fix (b0e99ab): no queue, spans exported on the commit thread
        worker = None

    class NeverAnswers(SpanExporter):
        def __init__(self) -> None:
            self.release = threading.Event()
            self.entered = threading.Event()

        def export(self, spans):  # type: ignore[no-untyped-def]
            self.entered.set()
            self.release.wait()
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            self.release.set()

    exporter = NeverAnswers()
    tp = TracerProvider(shutdown_on_exit=False)
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    otel.use_providers(tp, mp)
    if worker is not None:
        worker.use_queue(2)
    monkeypatch.setattr(hub, "CLOSE_WAIT", 0.5, raising=False)  # the close's bounded wait for the stuck exporter
    yield exporter, reader
    exporter.release.set()  # what is stuck (the telemetry thread; before the fix, the commit thread) goes on
    otel.use_providers()
    if worker is not None:
        worker.use_queue()
    mp.shutdown()


def _counter(reader, name: str) -> float | None:
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    return sum(p.value for p in m.data.data_points)
    return None


def test_a_stuck_span_exporter_blocks_no_commit(tmp_path, stuck_exporter, caplog):
    exporter, reader = stuck_exporter
    cfg = Config(
        host=HostConfig(buffer_size=8 * MiB, chunk_size=256 * 1024),
        local=LocalConfig(path=str(tmp_path / "local"), keep=10),
        job=JobConfig(telemetry="otel"),
    )
    w = TieredWriter(cfg)
    ids = [f"step-{i}" for i in range(1, 7)]
    dropped0 = getattr(telemetry, "dropped", lambda: 0)()  # (before the fix: no count, and the saves hang)

    def save_all() -> None:
        for i, cid in enumerate(ids, 1):
            dcp.save({"w": torch.full((1000,), float(i)), "step": i}, checkpoint_id=cid, storage_writer=w, no_dist=True)
            w.wait()  # committed on every tier: returns although the exporter never does

    caplog.set_level(logging.WARNING, logger="tierckpt")
    bounded(save_all, "saving and waiting for each save")
    assert exporter.entered.wait(WAIT)  # the first save's spans did reach the exporter, and it hangs there
    assert [c.id for c in tierckpt.list_checkpoints(cfg)] == ids
    # 6 saves, one record of spans each: one is stuck in the exporter, 2 wait in the queue, the
    # rest were dropped (history writes are not due within the 5 s interval after the first)
    assert telemetry.dropped() - dropped0 >= 3
    assert _counter(reader, "tierckpt.telemetry.dropped") == telemetry.dropped()
    assert any("telemetry queue full" in r.getMessage() and "dropped 1 " in r.getMessage() for r in caplog.records)
    # close waits for the telemetry thread a bounded time, then writes the history itself
    bounded(w.engine.close, "closing the engine")  # as at exit
    assert [r.checkpoint_id for r in read_history([make_local(cfg)])] == ids
    assert any("were still waiting" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(120)
def test_sigterm_commits_every_returned_save_while_the_exporter_hangs(tmp_path):
    """A real job (``tests/telemetry_child.py``) saves 3 checkpoints without waiting, its span
    exporter hangs, then it gets SIGTERM: the drain commits all 3."""
    local = tmp_path / "local"
    p = subprocess.Popen(
        [sys.executable, "-W", "ignore", str(HERE / "telemetry_child.py"), str(local)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        seen = []
        for line in p.stdout:  # the child prints SAVED once the three dcp.save calls returned
            seen.append(line)
            if line.strip() == "SAVED":
                break
        else:
            pytest.fail(f"the job ended before saving: {''.join(seen)} {p.stderr.read() if p.stderr else ''}")
        p.send_signal(signal.SIGTERM)
        _out, err = p.communicate(timeout=WAIT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGTERM, err[-3000:]
    cfg = Config(host=HostConfig(buffer_size=8 * MiB), local=LocalConfig(path=str(local)))
    assert [c.id for c in tierckpt.list_checkpoints(cfg)] == ["step-1", "step-2", "step-3"], err[-3000:]
    assert "NOT committed" not in err, err[-3000:]
