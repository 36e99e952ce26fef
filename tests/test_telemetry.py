"""Telemetry: ``SaveStats.as_dict``, the OpenTelemetry export (spans and metrics of a save and a
load, fed to the SDK's in-memory exporter and reader), the lag tracker, ``[job]`` validation, the
persisted history, telemetry off importing nothing, and torchtitan's metric logger hook."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt import TieredReader, TieredWriter, telemetry
from tierckpt.config import Config, ConfigError, HostConfig, JobConfig, LocalConfig, config_from_dict
from tierckpt.telemetry.history import HISTORY_DIR, history_key, read_history
from tierckpt.telemetry.lag import LagTracker
from tierckpt.tiers import make_local

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"a": torch.randn(300, 257, generator=g), "b": torch.arange(1000, dtype=torch.int64), "note": {"k": 1}}


def _cfg(tmp_path: Path, **job) -> Config:
    return Config(
        host=HostConfig(buffer_size=8 * MiB, chunk_size=256 * 1024),
        local=LocalConfig(path=str(tmp_path / "local")),
        job=JobConfig(**job),
    )


def test_as_dict_is_flat_stable_and_matches_the_stats(tmp_path):
    w = TieredWriter(_cfg(tmp_path))
    dcp.save(_state(), checkpoint_id="step-7", storage_writer=w, no_dist=True)
    w.wait()
    st = w.stats
    d = st.as_dict()
    assert all(k.startswith("tierckpt/") for k in d)
    assert all(type(v) in (int, float) for v in d.values())
    assert d["tierckpt/bytes"] == st.bytes > 0 and type(d["tierckpt/bytes"]) is int
    assert d["tierckpt/step"] == 7 and d["tierckpt/failed"] == 0
    assert d["tierckpt/blocked_s"] == pytest.approx(st.save_blocked_s + st.prestep_wait_s)
    assert d["tierckpt/cpu_s"] == pytest.approx(st.cpu_s)
    for k in ("capture_s", "flush_s", "commit_s"):
        assert d[f"tierckpt/{k}"] == getattr(st, k)
    assert "tierckpt/promote_s" not in d  # no hop configured: the stage never ran
    assert set(st.as_dict(prefix="")) == {k.removeprefix("tierckpt/") for k in d}
    names = [p.name for p in st.phases.snapshot()]
    assert {"blocked_in_save", "capture", "flush", "commit"} <= set(names)
    assert json.dumps(st.to_json())  # the phases serialise with the rest


@pytest.fixture
def otel_mem():
    """The SDK's in-memory span exporter and metric reader, as the providers tierckpt exports to."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tierckpt.telemetry import otel

    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    otel.use_providers(tp, mp)
    yield spans, reader
    otel.use_providers()  # back to the global providers
    mp.shutdown()
    tp.shutdown()


def _points(reader, name: str) -> list[tuple[dict, float]]:
    out = []
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    out += [
                        (dict(p.attributes), getattr(p, "value", None) if hasattr(p, "value") else p.sum)
                        for p in m.data.data_points
                    ]
    return out


def test_otel_spans_and_metrics_of_a_save_and_a_load(tmp_path, moto_endpoint, s3cfg, otel_mem):
    spans, reader = otel_mem
    cfg = _cfg(tmp_path, telemetry="otel")
    cfg.s3 = s3cfg(moto_endpoint)
    cfg.validate()
    w = TieredWriter(cfg)
    sd = {k: v for k, v in _state().items() if isinstance(v, torch.Tensor)}  # the load reads the whole file: a fill
    dcp.save(sd, checkpoint_id="step-1", storage_writer=w, no_dist=True)
    w.wait()
    nbytes = w.stats.bytes

    assert telemetry.drain(30)  # spans are exported on the telemetry thread, after the commit
    saved = spans.get_finished_spans()
    roots = [s for s in saved if s.name == "tierckpt.save"]
    assert len(roots) == 1
    root = roots[0]
    assert root.attributes["tierckpt.checkpoint_id"] == "step-1" and root.attributes["tierckpt.step"] == 1
    assert root.attributes["tierckpt.bytes"] == nbytes
    kids = [s for s in saved if s.parent is not None and s.parent.span_id == root.context.span_id]
    by_phase = {s.attributes["tierckpt.phase"]: s for s in kids}
    assert {"blocked_in_save", "capture", "flush", "commit", "hop:s3"} <= set(by_phase)
    for phase, s in by_phase.items():
        assert s.name == "tierckpt." + phase.split(":")[0]
        assert s.attributes["tierckpt.blocked"] is (phase in ("blocked_in_save", "prestep_wait"))
        assert root.start_time <= s.start_time <= s.end_time <= root.end_time
        assert s.status.is_ok
    assert by_phase["hop:s3"].attributes["tierckpt.tier"] == "s3"
    assert by_phase["commit"].start_time >= by_phase["flush"].end_time - 1_000_000  # commit follows the flush

    got = {(a.get("tierckpt.op"), a.get("tierckpt.tier")): v for a, v in _points(reader, "tierckpt.bytes")}
    assert got[("save", None)] == nbytes and got[("replicate", "s3")] == nbytes
    cpu = {a["tierckpt.cpu"]: v for a, v in _points(reader, "tierckpt.cpu.time")}
    assert set(cpu) >= {"capture", "write"} and sum(cpu.values()) == pytest.approx(w.stats.cpu_s)
    blocked = {a["tierckpt.phase"]: v for a, v in _points(reader, "tierckpt.blocked.time")}
    assert "blocked_in_save" in blocked
    depth = {a["tierckpt.stage"]: v for a, v in _points(reader, "tierckpt.queue.depth")}
    assert depth == {"capture": 0, "flush": 0, "commit": 0, "replication": 0}  # everything waited for
    lag = {a["tierckpt.tier"]: v for a, v in _points(reader, "tierckpt.tier.lag.steps")}
    assert lag == {"local": 0, "s3": 0}
    assert {a["tierckpt.tier"]: v for a, v in _points(reader, "tierckpt.tier.lag.seconds")} == {"local": 0.0, "s3": 0.0}

    # the node is lost: the load reads S3 and fills the local tier
    shutil.rmtree(tmp_path / "local" / "step-1")
    spans.clear()
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    r = TieredReader(cfg)
    dcp.load(out, checkpoint_id="latest", storage_reader=r, no_dist=True)
    assert torch.equal(out["a"], sd["a"])
    assert r.fill is not None
    r.fill.wait()
    assert telemetry.drain(30)
    loaded = spans.get_finished_spans()
    load = [s for s in loaded if s.name == "tierckpt.load"]
    fill = [s for s in loaded if s.name == "tierckpt.fill"]
    assert len(load) == 1 and len(fill) == 1
    assert load[0].attributes["tierckpt.blocked"] is True and "s3" in load[0].attributes["tierckpt.tiers"]
    assert fill[0].parent.span_id == load[0].context.span_id and fill[0].attributes["tierckpt.blocked"] is False
    assert fill[0].attributes["tierckpt.bytes"] == nbytes
    got = {(a.get("tierckpt.op"), a.get("tierckpt.tier")): v for a, v in _points(reader, "tierckpt.bytes")}
    assert got[("load", None)] > 0 and got[("fill", "local")] == nbytes
    w.close()


def test_lag_tracker_counts_steps_and_seconds_behind():
    lag = LagTracker()
    lag.saved("step-10", 10, when=100.0)
    lag.reached("local", "step-10")
    lag.saved("step-20", 20, when=200.0)
    lag.saved("step-30", 30, when=300.0)
    lag.reached("local", "step-30")
    lag.reached("s3", None)  # the hop failed before copying anything
    assert {x.tier: (x.steps, x.seconds) for x in lag.lags(now=350.0)} == {"local": (0, 0.0), "s3": (3, 250.0)}
    lag.reached("s3", "step-10")
    assert {x.tier: (x.steps, x.seconds) for x in lag.lags(now=350.0)}["s3"] == (20, 150.0)
    lag.reached("s3", "step-20")
    lag.reached("s3", "step-10")  # late news of an older copy never moves it back
    assert {x.tier: (x.steps, x.seconds) for x in lag.lags(now=350.0)}["s3"] == (10, 50.0)


@pytest.mark.parametrize(
    "body, key",
    [
        ({"telemetry": "prometheus"}, "telemetry"),
        ({"telemetry": 1}, "telemetry"),
        ({"history": -1}, "history"),
        ({"history": 5000}, "history"),
    ],
)
def test_job_telemetry_keys_are_validated(tmp_path, body, key):
    with pytest.raises(ConfigError, match=rf"\[job\] {key}"):
        config_from_dict({"local": {"path": str(tmp_path)}, "job": body})


def test_history_is_bounded_and_a_damaged_file_is_skipped(tmp_path):
    cfg = _cfg(tmp_path, history=3)
    w = TieredWriter(cfg)
    for i in range(5):
        dcp.save(_state(), checkpoint_id=f"step-{i}", storage_writer=w, no_dist=True)
        w.wait()
    w.engine.close()  # writes what the last seconds' saves added (the file is written every few seconds at most)
    tier = make_local(cfg)
    recs = read_history([tier])
    assert [r.checkpoint_id for r in recs] == ["step-2", "step-3", "step-4"]
    assert all(r.world == 1 and r.bytes > 0 and r.stats["cpu_s"] >= 0 for r in recs)
    (tmp_path / "local" / HISTORY_DIR / "g00009.json").write_bytes(
        b'{"format": "tierckpt-history/1", "records": [{"id": 5}]}'
    )
    (tmp_path / "local" / HISTORY_DIR / "g00008.json").write_bytes(b"[" * 100000)
    assert [r.checkpoint_id for r in read_history([tier])] == ["step-2", "step-3", "step-4"]
    assert tier.exists(history_key(0))


def test_telemetry_off_imports_neither_opentelemetry_nor_matplotlib(tmp_path):
    code = f"""
import sys, torch, torch.distributed.checkpoint as dcp
sys.path.insert(0, {str(REPO)!r})
from tierckpt import TieredWriter, TieredReader
from tierckpt.config import config_from_dict
cfg = config_from_dict({{"host": {{"buffer_size": "8MiB", "chunk_size": "1MiB"}}, "local": {{"path": {str(tmp_path / "l")!r}}}}})
w = TieredWriter(cfg)
sd = {{"a": torch.ones(100, 100)}}
dcp.save(sd, checkpoint_id="step-1", storage_writer=w, no_dist=True)
w.wait()
dcp.load(sd, checkpoint_id="latest", storage_reader=TieredReader(cfg), no_dist=True)
bad = [m for m in sys.modules if m.split(".")[0] in ("opentelemetry", "matplotlib")]
assert not bad, bad
print("clean")
"""
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "clean" in res.stdout, res.stderr[-2000:]


def test_torchtitan_metric_logger_gets_the_stats(tmp_path):
    pytest.importorskip("torchtitan")
    from types import SimpleNamespace

    from torchtitan.components.metrics import BaseLogger, LoggerContainer

    from tierckpt.integrations.torchtitan import log_metrics_with

    class Recorder(BaseLogger):
        def __init__(self) -> None:
            self.logged: list[tuple[dict, int]] = []

        def log(self, metrics: dict, step: int) -> None:
            self.logged.append((dict(metrics), step))

    rec = Recorder()
    container = LoggerContainer()
    container.add_logger(rec)
    trainer = SimpleNamespace(metrics_processor=SimpleNamespace(logger=container))
    w = TieredWriter(_cfg(tmp_path))
    assert log_metrics_with(trainer, w) and log_metrics_with(trainer, w)  # the second call changes nothing
    trainer.metrics_processor.logger.log({"loss": 2.5}, 1)  # before any save: the trainer's metrics only
    dcp.save(_state(), checkpoint_id="step-3", storage_writer=w, no_dist=True)
    w.wait()
    trainer.metrics_processor.logger.log({"loss": 2.0}, 3)
    assert rec.logged[0] == ({"loss": 2.5}, 1)
    metrics, step = rec.logged[1]
    assert step == 3 and metrics["loss"] == 2.0 and metrics["tierckpt/step"] == 3
    assert metrics["tierckpt/bytes"] == w.stats.bytes
    assert trainer.metrics_processor.logger.number_of_loggers == 1  # the container's other members still work
    assert not log_metrics_with(SimpleNamespace(), w)


def test_history_writes_at_most_every_interval_and_loses_nothing(tmp_path, monkeypatch):
    from tierckpt.telemetry import history
    from tierckpt.tiers.local import LocalTier

    monkeypatch.setattr(history, "WRITE_INTERVAL", 0.3)
    tier = LocalTier(tmp_path)
    log = history.HistoryLog(tier, 3, "n0", keep=10)
    rec = {
        "id": "step-1",
        "token": "t",
        "step": 1,
        "rank": 0,
        "world": 1,
        "bytes": 1,
        "error": None,
        "stats": {},
        "phases": [{"name": "capture", "start": 1.0, "end": 2.0}],
    }
    # append keeps the record in memory and says when the file is due (the hub then has the
    # telemetry thread write it): the first record at once, later ones once the interval is over
    assert log.append(rec)
    assert read_history([tier]) == []  # append itself does no I/O
    log.write()
    assert [r.checkpoint_id for r in read_history([tier])] == ["step-1"]
    assert not log.append(dict(rec, id="step-2"))  # the next one waits for the interval
    log._last_write -= 0.3  # the interval is over (as if 0.3 s had passed)
    assert log.append(dict(rec, id="step-3"))  # ... and the next save's write writes both
    assert not log.append(dict(rec, id="step-3b"))  # a write is asked for already
    log.cancel()  # the telemetry queue was full: the write will not run, the next append asks again
    log._last_write -= 0.3
    assert log.append(dict(rec, id="step-3c"))
    log.write()
    assert [r.checkpoint_id for r in read_history([tier])] == ["step-1", "step-2", "step-3", "step-3b", "step-3c"]
    log.append(dict(rec, id="step-4"))
    log.flush()  # the engine's close writes at once
    assert [r.checkpoint_id for r in read_history([tier])][-2:] == ["step-3c", "step-4"]
    assert history.HistoryLog(tier, 3, "n0", keep=2)._read_own()[0].global_rank == 3
