"""Hugging Face export (``restore/export.py``, ``tierckpt-restore export --format hf``).

Real parts: a small Llama-style ``transformers`` model built from a ``LlamaConfig`` (hidden 64,
2 layers, no download), trained 3 steps, its state saved with ``dcp.save`` through
``TieredWriter`` (one process, ``no_dist=True``) on a local tier; exported; loaded back with
``AutoModelForCausalLM.from_pretrained``; compared file by file with ``model.save_pretrained`` of
the same model. The exporter is SIGKILL-ed at random points in real subprocesses.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

transformers = pytest.importorskip("transformers")  # the hf extra; imported once for the module
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tierckpt import TieredWriter, load_config  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARD = "120KB"  # the tiny model (~0.4 MB) in several shards


def _model() -> torch.nn.Module:
    cfg = _tiny_config()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """The trained model, its reference ``save_pretrained`` folder, and a tier config holding
    checkpoint ``step-3`` (model + optimizer + a non-tensor item)."""
    tmp = tmp_path_factory.mktemp("hf")
    model = _model()
    ref = tmp / "ref"
    model.save_pretrained(ref, max_shard_size=SHARD)
    cfg = tmp / "tiers.toml"
    cfg.write_text(
        f'[host]\nbuffer_size = "8MiB"\nchunk_size = "1MiB"\n[local]\npath = "{tmp / "local"}"\nfsync = false\n'
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sd = {"model": model.state_dict(), "optim": {"momentum": torch.ones(3)}, "step": 3}
    w = TieredWriter(load_config(cfg))
    dcp.save(sd, checkpoint_id="step-3", storage_writer=w, no_dist=True)
    w.wait()
    del opt
    return {
        "tmp": tmp,
        "cfg": cfg,
        "ref": ref,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def _export(saved: dict, out: Path, **kw):
    from restore.export import export_hf

    kw.setdefault("keys", ["model."])
    kw.setdefault("strip_prefix", "model.")
    kw.setdefault("max_shard_size", SHARD)
    kw.setdefault("files", [saved["ref"] / "config.json", saved["ref"] / "generation_config.json"])
    return export_hf(saved["cfg"], "step-3", out=out, progress=False, **kw)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_same_files_as_save_pretrained_and_loads_bit_exact(saved, tmp_path):
    out = tmp_path / "{checkpoint_id}-hf"
    res = _export(saved, out)
    folder = tmp_path / "step-3-hf"
    assert res.out == str(folder) and res.checkpoint_id == "step-3"
    ref = saved["ref"]
    shards = sorted(p.name for p in ref.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(res.shards) == shards
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in ref.iterdir())
    # every shard: the same tensors in the same order, the same bytes (header included)
    for name in shards:
        assert (folder / name).read_bytes() == (ref / name).read_bytes(), name
    # the index: the same weight map and total size; total_parameters counts the exported elements
    mine, theirs = (json.loads((d / "model.safetensors.index.json").read_text()) for d in (folder, ref))
    assert mine == theirs
    assert (folder / "config.json").read_bytes() == (ref / "config.json").read_bytes()
    assert res.skipped == [] and res.tensors == len(saved["state"])
    # from_pretrained loads it; every parameter equals the trained one bit for bit
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    got = loaded.state_dict()
    assert set(got) == set(saved["state"])
    for k, v in saved["state"].items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    # nothing left behind next to it
    assert [p.name for p in tmp_path.iterdir()] == ["step-3-hf"]


def test_single_shard_dtype_cast_and_refuses_to_overwrite(saved, tmp_path):
    from restore.export import ExportExists

    out = tmp_path / "bf16"
    res = _export(saved, out, dtype="bfloat16", max_shard_size="50GB")
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "model.safetensors.index.json" not in names
    assert "config.json" in names and res.shards == ["model.safetensors"]
    t = _tensors(out)
    for k, v in saved["state"].items():
        assert t[k].dtype == torch.bfloat16 and torch.equal(t[k], v.to(torch.bfloat16)), k
    with pytest.raises(ExportExists, match="not empty"):
        _export(saved, out)
    res = _export(saved, out, overwrite=True)  # replaced by a sharded float32 export
    assert len(res.shards) > 1 and not (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"]


def split_qkv(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A test adapter: renames ``layers.`` to ``blocks.`` and splits every q_proj weight in two
    halves (shape work only, as a fused-QKV split does)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        k = k.replace("layers.", "blocks.")
        if k.endswith("q_proj.weight"):
            a, b = v.chunk(2, dim=0)
            out[k + ".a"], out[k + ".b"] = a, b
        else:
            out[k] = v
    return out


def test_adapter_by_dotted_path(saved, tmp_path):
    res = _export(saved, tmp_path / "ad", adapter="test_hf_export:split_qkv", max_shard_size="50GB", files=[])
    t = _tensors(tmp_path / "ad")
    state = saved["state"]
    assert res.tensors == len(state) + 2
    q = "model.layers.1.self_attn.q_proj.weight"
    qa, qb = (t["model.blocks.1.self_attn.q_proj.weight." + s] for s in "ab")
    assert torch.equal(torch.cat([qa, qb]), state[q])
    assert torch.equal(t["model.blocks.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"])


def test_bad_requests_fail_cleanly(saved, tmp_path):
    from restore.errors import NotFound, UsageError

    with pytest.raises(NotFound, match="no tensor key matches"):
        _export(saved, tmp_path / "a", keys=["nosuch."])
    with pytest.raises(UsageError, match="cannot be loaded"):
        _export(saved, tmp_path / "b", adapter="no_such_module.fn")
    with pytest.raises(UsageError, match="dtype"):
        _export(saved, tmp_path / "c", dtype="int3")
    with pytest.raises(UsageError, match="would replace the export's own files"):
        _export(saved, tmp_path / "e", files=[saved["ref"]])  # the reference folder's shards and index
    with pytest.raises(UsageError, match="must depend on names, shapes and dtypes only"):
        # differs on real tensors: found by the writer thread, raised to the caller, nothing left
        _export(saved, tmp_path / "f", adapter=lambda sd: {k + ("" if v.is_meta else ".x"): v for k, v in sd.items()})
    with pytest.raises(UsageError, match="both become"):
        _export(saved, tmp_path / "d", adapter=lambda sd: {"x": next(iter(sd.values()))})
    assert list(tmp_path.iterdir()) == []


def _cli_cmd(saved: dict, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "restore",
        "--config",
        str(saved["cfg"]),
        "-q",
        "export",
        "latest",
        "--format",
        "hf",
        "--out",
        str(out),
        "--keys",
        "model.",
        "--strip-prefix",
        "model.",
        "--max-shard-size",
        SHARD,
        "--files",
        str(saved["ref"] / "config.json"),
        *extra,
    ]


def _env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("TIERCKPT_CONFIG", None)
    return e


def test_cli_export_json(saved, tmp_path):
    p = subprocess.run(_cli_cmd(saved, tmp_path / "cli", "--json"), env=_env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["checkpoint_id"] == "step-3" and d["format"] == "hf" and d["skipped"] == []
    for name in d["shards"]:
        assert (tmp_path / "cli" / name).read_bytes() == (saved["ref"] / name).read_bytes()
    p = subprocess.run(_cli_cmd(saved, tmp_path / "cli"), env=_env(), capture_output=True, text=True)
    assert p.returncode == 2 and "--force" in p.stderr and "Traceback" not in p.stderr


def test_sigkill_never_leaves_a_loadable_partial_folder(saved, tmp_path):
    """SIGKILL the exporter at random moments (start-up, reading, shards, index, rename): the
    output directory is either absent or a complete export; the next run completes."""
    rng = random.Random(34)
    ref = saved["ref"]
    out = tmp_path / "k"
    killed_mid = 0
    for trial in range(2):
        proc = subprocess.Popen(_cli_cmd(saved, out, "--force"), env=_env(), stdout=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 4.0) if trial else 0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():
            # only ever a finished folder under the final name: every file complete
            for name in (p.name for p in ref.glob("*.safetensors")):
                assert (out / name).read_bytes() == (ref / name).read_bytes(), (trial, name)
            assert (out / "model.safetensors.index.json").is_file()
        else:
            killed_mid += 1
        p = subprocess.run(_cli_cmd(saved, out, "--force", "--json"), env=_env(), capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        for name in json.loads(p.stdout)["shards"]:
            assert (out / name).read_bytes() == (ref / name).read_bytes(), (trial, name)
        # the killed run's hidden partial folder is gone
        assert sorted(x.name for x in tmp_path.iterdir()) == ["k"], trial
        shutil_rm(out)
    assert killed_mid >= 1


def shutil_rm(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


# -- [export] every = N: the background worker -------------------------------------------------


def _bg_config(saved: dict, tmp: Path, adapter: str = "", every: int = 2, keep: int = 0) -> Path:
    ref = saved["ref"]
    cfg = tmp / "bg.toml"
    cfg.write_text(
        f'[host]\nbuffer_size = "8MiB"\nchunk_size = "1MiB"\n[local]\npath = "{tmp / "local"}"\nfsync = false\n'
        f"keep = {keep}\n"
        f'[export]\nevery = {every}\npath = "{tmp / "exports" / "{checkpoint_id}"}"\nkeys = ["model."]\n'
        f'strip_prefix = "model."\nmax_shard_size = "{SHARD}"\n'
        f'files = ["{ref / "config.json"}", "{ref / "generation_config.json"}"]\n'
        + (f'adapter = "{adapter}"\n' if adapter else "")
    )
    return cfg


def test_background_export_every_second_commit(saved, tmp_path):
    """Three commits, ``every = 2``: the worker process exports the second (commit seq 2) only,
    after its commit; the saves never wait for it; the folder equals save_pretrained's."""
    from tierckpt.chain.engine import get_engine

    cfg = load_config(_bg_config(saved, tmp_path))
    state = {"model": saved["state"], "step": 0}
    for step in (1, 2, 3):
        state["step"] = step
        w = TieredWriter(cfg)
        dcp.save(state, checkpoint_id=f"step-{step}", storage_writer=w, no_dist=True)
        w.wait()
    exporter = get_engine(cfg).exporter
    assert exporter is not None and exporter.idle(timeout=240)
    assert exporter.done == ["step-2"]
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["step-2"]
    folder, ref = tmp_path / "exports" / "step-2", saved["ref"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in ref.iterdir())
    for p in ref.iterdir():
        assert (folder / p.name).read_bytes() == p.read_bytes(), p.name
    w = TieredWriter(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w.wait()
    assert not [c for c in caught if "export" in str(c.message)]


def test_background_export_failure_is_a_warning_at_the_next_wait(saved, tmp_path):
    from tierckpt.catalog.listing import list_checkpoints
    from tierckpt.chain.engine import get_engine
    from tierckpt.chain.exporter import ExportWarning
    from tierckpt.tiers.local import LocalTier

    cfg = load_config(_bg_config(saved, tmp_path, adapter="no_such_module_here.to_hf"))
    state = {"model": saved["state"], "step": 0}
    for step in (1, 2):
        w = TieredWriter(cfg)
        dcp.save(state, checkpoint_id=f"step-{step}", storage_writer=w, no_dist=True)
        w.wait()  # the export of step-2 starts after this commit
    assert get_engine(cfg).exporter.idle(timeout=240)
    w = TieredWriter(cfg)
    with pytest.warns(ExportWarning, match=r"step-2.*no_such_module_here"):
        w.wait()
    # the checkpoint is committed and fine; no folder, no partial folder left
    assert [c.checkpoint_id for c in list_checkpoints(LocalTier(tmp_path / "local"))] == ["step-1", "step-2"]
    assert not (tmp_path / "exports").exists() or list((tmp_path / "exports").iterdir()) == []


def test_retention_waits_for_the_background_export(saved, tmp_path):
    """``keep = 1``, ``every = 1``: step-2's commit would delete step-1 while its worker is still
    starting; the lease taken right after step-1's commit holds retention off, and both exports
    complete. Once they are done, the next commit's retention removes the old checkpoints."""
    from tierckpt.catalog.listing import list_checkpoints
    from tierckpt.chain.engine import get_engine
    from tierckpt.tiers.local import LocalTier

    cfg = load_config(_bg_config(saved, tmp_path, every=1, keep=1))
    state = {"model": saved["state"], "step": 0}
    for step in (1, 2):
        w = TieredWriter(cfg)
        dcp.save(state, checkpoint_id=f"step-{step}", storage_writer=w, no_dist=True)
        w.wait()
    exporter = get_engine(cfg).exporter
    assert exporter is not None and exporter.idle(timeout=240)
    assert exporter.done == ["step-1", "step-2"]
    for cid in ("step-1", "step-2"):
        folder = tmp_path / "exports" / cid
        for p in saved["ref"].iterdir():
            assert (folder / p.name).read_bytes() == p.read_bytes(), (cid, p.name)
    w = TieredWriter(cfg)
    dcp.save(state, checkpoint_id="step-3", storage_writer=w, no_dist=True)
    w.wait()
    assert exporter.idle(timeout=240)
    assert [c.checkpoint_id for c in list_checkpoints(LocalTier(tmp_path / "local"))] == ["step-3"]


def test_background_export_span_and_figures(saved, tmp_path):
    """``[job] telemetry = "otel"``: a background export is a ``tierckpt.export`` span with its
    figures (bytes, shards, tensors) and adds its bytes to ``tierckpt.bytes`` (op ``export``)."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tierckpt.chain.engine import get_engine
    from tierckpt.telemetry import otel

    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    otel.use_providers(tp, mp)
    try:
        path = _bg_config(saved, tmp_path, every=1)
        path.write_text('[job]\ntelemetry = "otel"\n' + path.read_text())
        cfg = load_config(path)
        w = TieredWriter(cfg)
        dcp.save({"model": saved["state"]}, checkpoint_id="step-1", storage_writer=w, no_dist=True)
        w.wait()
        exporter = get_engine(cfg).exporter
        assert exporter is not None and exporter.idle(timeout=240) and exporter.done == ["step-1"]
        TieredWriter(cfg).wait()  # flushes the telemetry thread
        [span] = [s for s in spans.get_finished_spans() if s.name == "tierckpt.export"]
        total = sum(v.numel() * v.element_size() for v in saved["state"].values())
        attrs = dict(span.attributes or {})
        assert attrs["tierckpt.checkpoint_id"] == "step-1" and attrs["tierckpt.bytes"] == total
        assert attrs["tierckpt.export.shards"] == len(list(saved["ref"].glob("*.safetensors")))
        assert attrs["tierckpt.export.tensors"] == len(saved["state"])
        assert exporter.results[0]["bytes"] == total
        points = [
            (dict(p.attributes), p.value)
            for rm in reader.get_metrics_data().resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.name == "tierckpt.bytes"
            for p in m.data.data_points
        ]
        assert ({"tierckpt.op": "export"}, total) in points
    finally:
        otel.use_providers()
        mp.shutdown()
        tp.shutdown()


# -- 2 gloo ranks, FSDP2 shards, exported in the background -------------------------------------


def _fsdp_worker(config: str, full_out: str) -> None:
    """One rank: the tiny Llama under FSDP2 (CPU, gloo), 3 training steps on the same batches on
    both ranks, its sharded state (DTensors) saved through TieredWriter as ``step-3``; rank 0 also
    writes the full state (``torch.save``) for the parent to compare with."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_tiny_config())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    w = TieredWriter(load_config(config))
    dcp.save({"model": get_model_state_dict(model), "step": 3}, checkpoint_id="step-3", storage_writer=w)
    w.wait()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(full, full_out)
    dist.barrier()
    dist.destroy_process_group()


def _tiny_config():
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def test_fsdp2_two_ranks_exported_in_the_background(saved, tmp_path):
    """2 gloo ranks train under FSDP2 and save sharded; ``[export] every = 1`` exports step-3 in a
    worker started by rank 0 (the node's metadata writer) after the commit. The folder loads with
    from_pretrained, bit-exact to the trained weights, and its files equal save_pretrained's of a
    model holding the same weights."""
    import socket

    _bg_config(saved, tmp_path, every=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE="2",
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            TIERCKPT_NODE="node0",
            PYTHONPATH=str(REPO),
        )
        log = open(tmp_path / f"rank{r}.log", "w")
        cmd = [sys.executable, __file__, "fsdp-save", str(tmp_path / "bg.toml"), str(tmp_path / "full.pt")]
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for p, log in procs:
        try:
            p.wait(timeout=240)
        finally:
            if p.poll() is None:
                p.kill()
            log.close()
    assert [p.returncode for p, _ in procs] == [0, 0], [(tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1)]
    folder = tmp_path / "exports" / "step-3"
    deadline = time.monotonic() + 240  # the worker outlives the ranks; a bound, not a timing check
    while not folder.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (folder / "model.safetensors.index.json").is_file()
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    model = transformers.LlamaForCausalLM(_tiny_config())
    model.load_state_dict(full)
    ref = tmp_path / "ref"
    model.save_pretrained(ref, max_shard_size=SHARD)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in ref.iterdir())
    for p in ref.glob("*.safetensors"):
        assert (folder / p.name).read_bytes() == p.read_bytes(), p.name
    assert (folder / "model.safetensors.index.json").read_bytes() == (ref / "model.safetensors.index.json").read_bytes()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert set(loaded) == set(full)
    for k, v in full.items():
        assert torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)), k
    assert not torch.equal(
        full["model.layers.0.mlp.up_proj.weight"], saved["state"]["model.layers.0.mlp.up_proj.weight"]
    )


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "fsdp-save":
    _fsdp_worker(sys.argv[2], sys.argv[3])


def test_one_exporter_per_job_unless_the_path_names_the_node(tmp_path):
    """Node-local disks: each node has a metadata writer (ranks 0 and 2 of 4 here). Exports into
    one S3 prefix or directory come from rank 0 alone (two nodes' workers would each abort and
    replace the other's files); with ``{node}`` in the path each node writes its own folder."""
    from tierckpt.chain.exporter import BackgroundExporter
    from tierckpt.config import config_from_dict

    def exporters(path: str) -> list[int]:
        cfg = config_from_dict({"local": {"path": str(tmp_path / "{node}")}, "export": {"every": 2, "path": path}})
        ex = BackgroundExporter(cfg)
        return [r for r in range(4) if ex.wants("step-4", 4, r, 0 if r < 2 else 2)]

    assert exporters("s3://bucket/exports/{checkpoint_id}") == [0]
    assert exporters(str(tmp_path / "exports" / "{checkpoint_id}")) == [0]
    assert exporters(str(tmp_path / "exports" / "{node}" / "{checkpoint_id}")) == [0, 2]
    cfg = config_from_dict(
        {"local": {"path": str(tmp_path / "x")}, "export": {"every": 2, "path": "/e/{checkpoint_id}"}}
    )
    assert not BackgroundExporter(cfg).wants("step-3", 3, 0, 0)  # not a multiple of every
