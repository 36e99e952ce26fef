"""Compression and server-side copies on the S3 hop, end to end (moto and SeaweedFS on loopback):
saves promoted encoded, loads from S3 bit-exact for every dtype, unchanged frames copied by the
server, a flipped byte in a stored frame served from the next tier, the restore tools on encoded
checkpoints, and checkpoints written before compression loading after it was turned on."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_scenarios import compare, placeholder
from s3servers import s3_client

from tierckpt import TieredReader, TieredWriter
from tierckpt.catalog.listing import read_checkpoint_doc
from tierckpt.codec.view import decoding
from tierckpt.config import S3Config, config_from_dict
from tierckpt.format.layout import data_key
from tierckpt.load.readback import Readback, Request
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.s3 import S3Tier

PREFIX = "ckpt"


def make_cfg(tmp_path: Path, s3: S3Config, **s3_over: Any):
    s = dataclasses.asdict(s3)
    s["part_size"] = "5MiB"
    s.update(s3_over)
    return config_from_dict(
        {
            "job": {"commit_timeout": 60.0},
            "host": {"buffer_size": "32MiB", "chunk_size": "8MiB"},
            "local": {"path": str(tmp_path / "local"), "keep": 0, "fsync": False},
            "s3": s,
        }
    )


def every_dtype_state(seed: int, frozen: dict | None = None) -> dict:
    """Weights-like tensors of every dtype (a few MiB), a non-contiguous one, empty ones, objects;
    ``frozen``: tensors kept from an earlier state (unchanged between checkpoints)."""
    g = torch.Generator().manual_seed(seed)
    big = frozen or {
        "emb": (torch.randn(4 << 20, generator=torch.Generator().manual_seed(99)) * 0.02).to(torch.bfloat16),
        "w32": torch.randn(4 << 20, generator=torch.Generator().manual_seed(98)) * 0.02,
    }
    return {
        "model": dict(
            big,
            **{
                "bf16": (torch.randn(3001, generator=g) * 0.02).to(torch.bfloat16),
                "fp16": (torch.randn(777, generator=g)).to(torch.float16),
                "fp64": torch.randn(1001, generator=g, dtype=torch.float64),
                "i8": torch.randint(-128, 127, (333,), generator=g, dtype=torch.int8),
                "i64": torch.randint(-(1 << 40), 1 << 40, (129,), generator=g, dtype=torch.int64),
                "bool": torch.rand(77, generator=g) > 0.5,
                "c64": torch.randn(55, generator=g, dtype=torch.complex64),
                "c128": torch.randn(33, generator=g, dtype=torch.complex128),
                "empty": torch.empty(0, 7),
                "strided": torch.randn(64, 48, generator=g).t(),
                "scalar": torch.tensor(seed + 0.5),
            },
        ),
        "meta": {"seed": seed, "name": f"run-{seed}"},
    }


def save(writer: TieredWriter, sd: dict, cid: str) -> None:
    dcp.save(sd, checkpoint_id=cid, storage_writer=writer, no_dist=True)


def load_exact(cfg, expected: dict, cid: str) -> TieredReader:
    target = placeholder(expected)
    reader = TieredReader(cfg)
    dcp.load(target, checkpoint_id=cid, storage_reader=reader, no_dist=True)
    assert compare(expected, target) == [], f"{cid}: loaded state differs"
    return reader


@pytest.fixture(params=["moto", "seaweedfs"])
def endpoint(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("moto_endpoint" if request.param == "moto" else "seaweed_endpoint")


def test_encoded_promotion_loads_bit_exact_and_copies_unchanged_frames(
    tmp_path: Path, endpoint: str, s3cfg: Callable[..., S3Config]
) -> None:
    s3 = s3cfg(endpoint)
    cfg = make_cfg(tmp_path, s3, compression="zstd", copy_unchanged=True)
    w = TieredWriter(cfg)
    sd1 = every_dtype_state(1)
    save(w, sd1, "step-1")
    w.wait()
    st1 = w.history[-1]
    sd2 = every_dtype_state(2, frozen={k: sd1["model"][k] for k in ("emb", "w32")})
    save(w, sd2, "step-2")
    w.wait()
    st2 = w.history[-1]
    w.close()
    tier = S3Tier(s3)
    try:
        for cid, st in (("step-1", st1), ("step-2", st2)):
            man = read_checkpoint_doc(tier, cid).manifest
            ((file, idx),) = man.stored.items()
            assert idx.codec == "zstd" and st.stored_bytes == idx.stored < man.files[file]
            assert tier.size(data_key(cid, file)) == idx.stored
            assert st.compress_cpu_s > 0 or cid == "step-2"
        assert st1.copied_bytes == 0
        assert st2.copied_bytes and st2.copied_bytes >= 10 << 20  # most of the frozen 24 MiB: copied by the server
        assert st2.uploaded_bytes < st1.uploaded_bytes / 2
        # the local tier keeps plain files and its own metadata, without an index
        local_md = (tmp_path / "local" / "step-2" / "metadata.json").read_bytes()
        assert b'"stored"' not in local_md
    finally:
        tier.close()
    shutil.rmtree(tmp_path / "local")  # node lost: every byte comes from S3, decoded
    for cid, sd in (("step-1", sd1), ("step-2", sd2)):
        reader = load_exact(cfg, sd, cid)
        assert set(reader.served.values()) == {"s3"}


def test_flipped_byte_in_a_stored_frame_is_served_from_the_next_tier(
    tmp_path: Path, moto_endpoint: str, s3cfg: Callable[..., S3Config], caplog: pytest.LogCaptureFixture
) -> None:
    s3 = s3cfg(moto_endpoint)
    cfg = make_cfg(tmp_path, s3, compression="zstd")
    w = TieredWriter(cfg)
    sd = every_dtype_state(3)
    save(w, sd, "step-3")
    w.wait()
    w.close()
    tier = S3Tier(s3)
    local = LocalTier(tmp_path / "local", fsync=False)
    try:
        doc = read_checkpoint_doc(tier, "step-3")
        ((file, idx),) = doc.manifest.stored.items()
        key = data_key("step-3", file)
        client = s3_client(moto_endpoint)
        body = bytearray(client.get_object(Bucket=s3.bucket, Key=f"{PREFIX}/{key}")["Body"].read())
        for i in range(idx.frames):  # one byte in the middle of every stored frame
            body[(idx.offsets[i] + idx.offsets[i + 1]) // 2] ^= 0x55
        client.put_object(Bucket=s3.bucket, Key=f"{PREFIX}/{key}", Body=bytes(body))
        reqs = []
        for i, rec in doc.items:
            if rec.length:
                reqs.append(Request(rec, memoryview(bytearray(rec.length)), f"item {i.fqn}"))
        rb = Readback("step-3", [decoding(tier, "step-3"), local], doc.manifest.chunk_size)
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            rb.read(reqs)
        direct = Readback("step-3", [local], doc.manifest.chunk_size)
        expect = [Request(r.rec, memoryview(bytearray(r.rec.length)), r.what) for r in reqs]
        direct.read(expect)
        assert all(bytes(a.buf) == bytes(b.buf) for a, b in zip(reqs, expect))
        assert rb.recovered.get(file) == "local"
        assert "served from local" in caplog.text
        # verify names the damage on S3 and not on local
        from restore import verify_checkpoint

        rep = verify_checkpoint(cfg, "step-3", progress=False)
        assert not rep.ok
        assert {p.tier for p in rep.problems} == {"s3"}
    finally:
        tier.close()
        local.close()


def test_restore_tools_and_old_checkpoints(
    tmp_path: Path, moto_endpoint: str, s3cfg: Callable[..., S3Config], capsys: pytest.CaptureFixture
) -> None:
    from restore import fetch_checkpoint, verify_checkpoint
    from restore.cli import main as cli

    s3 = s3cfg(moto_endpoint)
    plain = make_cfg(tmp_path, s3)  # compression off: a checkpoint of before
    w = TieredWriter(plain)
    old = every_dtype_state(4)
    save(w, old, "step-4")
    w.wait()
    w.close()
    cfg = make_cfg(tmp_path, s3, compression="zstd", copy_unchanged=True)
    w = TieredWriter(cfg)
    new = every_dtype_state(5)
    save(w, new, "step-5")
    w.wait()
    w.close()
    original_md = (tmp_path / "local" / "step-5" / "metadata.json").read_bytes()
    shutil.rmtree(tmp_path / "local")
    assert verify_checkpoint(cfg, "step-5", progress=False).ok
    load_exact(cfg, old, "step-4")  # written before compression: read as it is
    res = fetch_checkpoint(cfg, "step-5", progress=False)
    assert res.files
    assert (tmp_path / "local" / "step-5" / "metadata.json").read_bytes() == original_md  # plain files, no index
    assert set(load_exact(cfg, new, "step-5").served.values()) == {"local"}
    toml = tmp_path / "tiers.toml"
    toml.write_text(_toml(cfg))
    assert cli(["--config", str(toml), "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    row = next(r for r in rows if r["checkpoint_id"] == "step-5")
    s3row = row["tiers"]["s3"]
    assert s3row["stored_bytes"] < s3row["logical_bytes"]
    old_row = next(r for r in rows if r["checkpoint_id"] == "step-4")["tiers"]["s3"]
    assert old_row["stored_bytes"] == old_row["logical_bytes"]
    out = tmp_path / "c.pt"
    shutil.rmtree(tmp_path / "local")
    assert cli(["--config", str(toml), "consolidate", "step-5", "--out", str(out)]) == 0
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["model.w32"] if "model.w32" in got else got["model"]["w32"], new["model"]["w32"])


def _toml(cfg) -> str:
    s3 = cfg.s3
    return (
        f'[local]\npath = "{cfg.local.path}"\nfsync = false\n'
        f'[s3]\nbucket = "{s3.bucket}"\nprefix = "{s3.prefix}"\nendpoint_url = "{s3.endpoint_url}"\n'
        f'part_size = "5MiB"\ncompression = "{s3.compression}"\n'
    )


def test_two_nodes_one_lost_load_decodes_and_fill_writes_plain_metadata(
    tmp_path: Path, moto_endpoint: str, s3cfg: Callable[..., S3Config]
) -> None:
    """Two ranks on two simulated nodes, [s3] compression on; node 1 loses its disk: the job's
    agreed load reads rank 1's file from S3 (decoded) and refills node 1 with plain files whose
    metadata.json has no stored index."""
    from s3_scenarios import run_world

    s3 = s3cfg(moto_endpoint)
    conf = {
        "job": {"commit_timeout": 60},
        "host": {"buffer_size": "16MiB", "chunk_size": "4MiB"},
        "local": {"path": str(tmp_path / "nodes" / "{node}"), "keep": 0, "fsync": False},
        "s3": dataclasses.asdict(s3) | {"part_size": "5MiB", "compression": "zstd", "copy_unchanged": True},
    }
    res = run_world(
        2,
        "save_promote_lose_node_load",
        {"config": conf, "ids": ["step-1", "step-2"], "lost_rank": 1},
        tmp_path / "w",
        node_of=lambda r: f"node{r}",
    )
    for r, out in enumerate(res):
        assert out["errors"] == [], (r, out["errors"])
        assert out["mismatches"] == [], (r, out)
    served1 = {f[:10]: t for f, t in res[1]["served"].items()}
    assert served1["rank-00001"] == "s3", res[1]["served"]
    tier = S3Tier(s3)
    try:
        man = read_checkpoint_doc(tier, "step-2").manifest
        assert set(man.stored) == set(man.files)  # both ranks' files stored encoded
    finally:
        tier.close()
    refilled = tmp_path / "nodes" / "node1" / "step-2" / "metadata.json"
    if refilled.exists():  # the fill committed the lost node's copy: plain files, no index
        assert b'"stored"' not in refilled.read_bytes()


def test_backlog_promoted_encoded_when_compression_is_turned_on(
    tmp_path: Path, moto_endpoint: str, s3cfg: Callable[..., S3Config]
) -> None:
    """A checkpoint committed locally before [s3] existed is promoted by the backlog pass, encoded,
    with its stored index in the metadata committed on S3; both checkpoints load from S3 alone."""
    s3 = s3cfg(moto_endpoint)
    cfg = make_cfg(tmp_path, s3, compression="zstd", copy_unchanged=True)
    local_only = config_from_dict(
        {
            "host": {"buffer_size": "32MiB", "chunk_size": "8MiB"},
            "local": {"path": str(tmp_path / "local"), "keep": 0, "fsync": False},
        }
    )
    w = TieredWriter(local_only)
    sd1 = every_dtype_state(6)
    save(w, sd1, "step-6")
    w.wait()
    w.close()
    w = TieredWriter(cfg)  # one process: the start-up backlog pass promotes step-6
    sd2 = every_dtype_state(7)
    save(w, sd2, "step-7")
    w.wait()
    w.close()
    tier = S3Tier(s3)
    try:
        for cid in ("step-6", "step-7"):
            man = read_checkpoint_doc(tier, cid).manifest
            assert set(man.stored) == set(man.files) and all(s.codec == "zstd" for s in man.stored.values())
    finally:
        tier.close()
    shutil.rmtree(tmp_path / "local")
    load_exact(cfg, sd1, "step-6")
    load_exact(cfg, sd2, "step-7")
