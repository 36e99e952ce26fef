"""The restore service and CLI (``restore/``): list, latest, verify, fetch, consolidate, gc.

The CLI runs in subprocesses (``python -m restore``) exactly as a person would run it; the
library functions are also called directly. Checkpoints are made with ``dcp.save`` through
``TieredWriter`` (single process with ``no_dist=True``, and 2 gloo ranks with DTensor shards
for real multi-chunk tensors); S3 is a moto server on loopback.

This file is also the worker of the 2-rank save: ``python tests/test_restore_cli.py dist-save
CONFIG ID`` (run by :func:`_run_dist_save`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import tierckpt
from tierckpt import TieredReader, TieredWriter, load_config
from tierckpt.config import MiB, S3Config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# -- helpers ------------------------------------------------------------------------------------


def write_config(
    path: Path,
    *,
    local: Path | None = None,
    s3: S3Config | None = None,
    keep: int = 0,
    s3_keep: int = 0,
    keep_every: int = 0,
) -> Path:
    """A TOML config with small test sizes; returns its path."""
    lines = ["[host]", 'buffer_size = "8MiB"', 'chunk_size = "1MiB"']
    if local is not None:
        lines += ["[local]", f'path = "{local}"', "fsync = false", f"keep = {keep}"]
    if s3 is not None:
        lines += [
            "[s3]",
            f'bucket = "{s3.bucket}"',
            f'prefix = "{s3.prefix}"',
            f'endpoint_url = "{s3.endpoint_url}"',
            'part_size = "5MiB"',
            "concurrency = 4",
            "max_attempts = 3",
            "connect_timeout = 2.0",
            "read_timeout = 10.0",
            f"keep = {s3_keep}",
            f"keep_every = {keep_every}",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def sample_state(seed: int, big: int = 0) -> dict:
    """A nested state dict with several dtypes, a 0-dim and an empty tensor, and non-tensor items."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(64, 33, generator=g),
            "b": torch.randn(33, generator=g).bfloat16(),
            "emb": torch.randint(0, 1000, (100, 8), generator=g),
            "mask": torch.rand(10, generator=g) > 0.5,
            "half": torch.randn(7, 3, generator=g).half(),
            "scale": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
        },
        "optim": {
            "m": torch.randn(max(big, 16), 1024, generator=g) if big else torch.randn(16, 1024, generator=g),
            "lr": 0.1,
        },
        "step": seed,
        "extra": {"name": f"run-{seed}"},
    }


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def save(cfg: Path | tierckpt.TierConfig, checkpoint_id: str, sd: dict) -> None:
    c = cfg if isinstance(cfg, tierckpt.TierConfig) else load_config(cfg)
    w = TieredWriter(c)
    dcp.save(sd, checkpoint_id=checkpoint_id, storage_writer=w, no_dist=True)
    w.wait()


def load(cfg: Path | tierckpt.TierConfig, checkpoint_id: str, like: dict) -> tuple[dict, TieredReader]:
    """Load into zeroed copies of ``like``; returns the state and the reader (for ``served``)."""

    def zero(d):
        return {
            k: zero(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in d.items()
        }

    out = zero(like)
    r = TieredReader(cfg if isinstance(cfg, tierckpt.TierConfig) else load_config(cfg))
    dcp.load(out, checkpoint_id=checkpoint_id, storage_reader=r, no_dist=True)
    return out, r


def assert_same(got: dict, want: dict) -> None:
    fg, fw = flatten(got), flatten(want)
    assert set(fg) == set(fw)
    for k, v in fw.items():
        if isinstance(v, torch.Tensor):
            assert fg[k].dtype == v.dtype and fg[k].shape == v.shape and torch.equal(fg[k], v), k
        else:
            assert fg[k] == v, k


class Result:
    """What a CLI run gave: exit status, stdout, stderr (like ``subprocess.CompletedProcess``)."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def cli(*args: str, config: Path | None = None, env: dict | None = None) -> Result:
    """Run the CLI in this process (``restore.cli.main``): the same parsing, printing and error
    mapping as the command, without paying for a Python start-up (torch takes seconds)."""
    import contextlib
    import io

    from restore.cli import main

    argv = (["--config", str(config)] if config else []) + list(args)
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    lg = logging.getLogger("tierckpt")  # main() configures it for a CLI process: put it back after
    saved_log = (lg.handlers[:], lg.propagate, lg.level)
    try:
        os.environ.pop("TIERCKPT_CONFIG", None)
        os.environ.update(env or {})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse: usage errors and --help
                code = int(e.code or 0)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        lg.handlers[:], lg.propagate, lg.level = saved_log[0], saved_log[1], saved_log[2]
    return Result(code, out.getvalue(), err.getvalue())


def cli_proc(*args: str, config: Path | None = None, env: dict | None = None, timeout: float = 180) -> Result:
    """Run ``python -m restore ...`` in a subprocess, exactly as a person would."""
    cmd = [sys.executable, "-m", "restore"] + (["--config", str(config)] if config else []) + list(args)
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("TIERCKPT_CONFIG", None)
    e.update(env or {})
    p = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout)
    return Result(p.returncode, p.stdout, p.stderr)


def assert_one_line_error(p: Result, code: int, *needles: str) -> str:
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert lines[0].startswith("tierckpt-restore: error: ")
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def data_files(root: Path, checkpoint_id: str) -> list[Path]:
    """The data files of a checkpoint on a local tier, wherever the layout puts them."""
    return sorted(p for p in root.rglob("rank-*.data") if p.parent.name == checkpoint_id)


def ids_on(root: Path) -> list[str]:
    from tierckpt.catalog.listing import list_checkpoints
    from tierckpt.tiers.local import LocalTier

    return sorted(c.checkpoint_id for c in list_checkpoints(LocalTier(root)))


def data_path(root: Path, checkpoint_id: str, file: str) -> Path:
    from tierckpt.format.layout import data_key

    return root.joinpath(*data_key(checkpoint_id, file).split("/"))


# -- local-only: list, latest, verify, gc ------------------------------------------------------


@pytest.fixture
def local_ckpts(tmp_path: Path) -> tuple[Path, Path, dict]:
    """Two committed checkpoints (step-1, step-2) and a partial one (step-3) on a local tier."""
    root = tmp_path / "local"
    cfg = write_config(tmp_path / "tiers.toml", local=root)
    sd = sample_state(2)
    save(cfg, "step-1", sample_state(1))
    save(cfg, "step-2", sd)
    (root / "step-3").mkdir()
    (root / "step-3" / "rank-00000-deadbeef.data").write_bytes(b"\0" * 1000)
    return cfg, root, sd


def test_list_table_and_json(local_ckpts):
    cfg, _root, _sd = local_ckpts
    p = cli_proc("list", config=cfg)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["ID", "STEP", "LOCAL", "STORED", "FILES", "AGE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["step-1"][2] == "committed" and rows["step-2"][2] == "committed" and rows["step-3"][2] == "partial"
    assert rows["step-2"][5] == "1"  # one rank file

    p = cli("list", "--json", config=cfg)
    assert p.returncode == 0, p.stderr
    doc = {c["checkpoint_id"]: c for c in json.loads(p.stdout)}
    assert set(doc) == {"step-1", "step-2", "step-3"}
    assert doc["step-2"]["committed"] and doc["step-2"]["step"] == 2 and doc["step-2"]["rank_files"] == 1
    assert doc["step-2"]["tiers"]["local"]["state"] == "committed" and doc["step-2"]["size"] > 0
    assert doc["step-3"]["tiers"]["local"] == {**doc["step-3"]["tiers"]["local"], "state": "partial", "rank_files": 1}
    assert not doc["step-3"]["committed"]


def test_latest_and_empty(local_ckpts, tmp_path):
    cfg, _root, _sd = local_ckpts
    p = cli("latest", config=cfg)
    assert p.returncode == 0 and p.stdout.strip() == "step-2", p.stderr
    p = cli("latest", "--json", env={"TIERCKPT_CONFIG": str(cfg)})  # config from the environment
    assert json.loads(p.stdout)["checkpoint_id"] == "step-2"

    empty = write_config(tmp_path / "empty.toml", local=tmp_path / "nothing")
    p = cli("latest", config=empty)
    assert p.stdout == ""
    assert_one_line_error(p, 1, "no committed checkpoint")


def test_verify_ok_then_flipped_byte(local_ckpts):
    cfg, root, _sd = local_ckpts
    p = cli("verify", "latest", config=cfg)
    assert p.returncode == 0, p.stderr
    assert "step-2 on local" in p.stdout and "OK" in p.stdout

    from restore import verify_checkpoint
    from tierckpt.catalog.listing import read_checkpoint_metadata
    from tierckpt.tiers.local import LocalTier

    md, _man = read_checkpoint_metadata(LocalTier(root), "step-2")
    rec = next(r for i, r in md.storage_data.items() if i.fqn == "model.emb")
    f = data_path(root, "step-2", rec.file)
    raw = bytearray(f.read_bytes())
    raw[rec.pos + 17] ^= 0x40
    f.write_bytes(bytes(raw))

    p = cli_proc("verify", "step-2", config=cfg)
    assert_one_line_error(p, 1, "step-2 failed verification")
    assert "BAD local" in p.stdout and rec.file in p.stdout and "'model.emb'" in p.stdout

    rep = verify_checkpoint(cfg, "step-2", progress=False)
    assert not rep.ok
    [prob] = rep.problems
    assert (prob.tier, prob.file, prob.kind, prob.fqn) == ("local", rec.file, "crc", "model.emb")

    # A truncated file is a size problem.
    f.write_bytes(bytes(raw[:-64]))
    p = cli("verify", "step-2", "--json", config=cfg)
    assert p.returncode == 1
    doc = json.loads(p.stdout)
    assert not doc["ok"] and doc["problems"][0]["kind"] == "size"


def test_gc_dry_run_then_delete(tmp_path):
    root = tmp_path / "local"
    cfg = write_config(tmp_path / "save.toml", local=root, keep=0)  # the writer keeps everything
    for i in range(1, 5):
        save(cfg, f"step-{i}", sample_state(i))
    stale = root / "step-0"
    stale.mkdir()
    (stale / "rank-00000-00000000.data").write_bytes(b"x" * 10)
    os.utime(stale / "rank-00000-00000000.data", (1_000_000, 1_000_000))
    from tierckpt.catalog import lease
    from tierckpt.tiers.local import LocalTier

    # a save in flight (in this process): it holds a lease from before its first file, so it stays
    in_flight = lease.acquire(LocalTier(root), "step-9", kind="save", require_committed=False, check_tombs=False)
    fresh = root / "step-9"
    fresh.mkdir()
    (fresh / "rank-00000-11111111.data").write_bytes(b"y" * 10)
    gc_cfg = write_config(tmp_path / "gc.toml", local=root, keep=2)

    p = cli("gc", "--dry-run", config=gc_cfg)
    assert p.returncode == 0, p.stderr
    assert "would delete" in p.stdout
    for cid in ("step-0", "step-1", "step-2"):
        assert cid in p.stdout
    assert "step-3" not in p.stdout and "step-4" not in p.stdout and "step-9" not in p.stdout
    assert ids_on(root) == ["step-0", "step-1", "step-2", "step-3", "step-4", "step-9"]

    p = cli("gc", "--json", config=gc_cfg)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert not doc["dry_run"]
    assert sorted(a["checkpoint_id"] for a in doc["actions"] if a["deleted"]) == ["step-0", "step-1", "step-2"]
    assert ids_on(root) == ["step-3", "step-4", "step-9"]
    assert not data_files(root, "step-1") and not (root / "step-1").exists()

    from restore import gc_checkpoints

    # keep=1 still never removes the newest committed checkpoint.
    res = gc_checkpoints(write_config(tmp_path / "gc1.toml", local=root, keep=1), dry_run=True)
    assert [a.checkpoint_id for a in res.actions] == ["step-3"]
    assert "step-4" in res.kept["local"]
    in_flight.release()  # the save died without committing: its partial goes now
    res = gc_checkpoints(write_config(tmp_path / "gc2.toml", local=root, keep=0))
    assert [a.checkpoint_id for a in res.actions] == ["step-9"]


# -- consolidate --------------------------------------------------------------------------------


def test_consolidate_pt_and_safetensors(local_ckpts, tmp_path):
    cfg, _root, sd = local_ckpts
    want = flatten(sd)

    out_pt = tmp_path / "out" / "full.pt"
    p = cli("consolidate", "latest", "--out", str(out_pt), config=cfg)
    assert p.returncode == 0, p.stderr
    assert "wrote" in p.stdout and "step-2" in p.stdout
    got = torch.load(out_pt, weights_only=True)
    assert list(got) == list(want)  # the metadata's key order
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k
    with zipfile.ZipFile(out_pt) as z:
        assert z.testzip() is None  # CRC-32 of every record is right: a valid zip
    assert not list(out_pt.parent.glob(".*partial*"))

    st = pytest.importorskip("safetensors.torch")
    out_st = tmp_path / "out" / "full.safetensors"
    p = cli("consolidate", "step-2", "--out", str(out_st), "--json", config=cfg)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert sorted(doc["skipped"]) == ["extra.name", "optim.lr", "step"]
    assert "warning: safetensors holds tensors only: leaving out 3 non-tensor" in p.stderr
    got = st.load_file(str(out_st))
    assert set(got) == {k for k, v in want.items() if isinstance(v, torch.Tensor)}
    for k in got:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_consolidate_keys_and_exclude(local_ckpts, tmp_path):
    cfg, _root, sd = local_ckpts
    from restore import consolidate_checkpoint

    out = tmp_path / "model.pt"
    res = consolidate_checkpoint(cfg, "step-2", out=out, keys=["model."], exclude=["model.emb"], progress=False)
    got = torch.load(out, weights_only=True)
    assert sorted(got) == sorted(k for k in flatten(sd) if k.startswith("model.") and k != "model.emb")
    assert res.tensors == len(got) and res.objects == 0 and set(res.served.values()) == {"local"}

    p = cli("consolidate", "step-2", "--out", str(tmp_path / "x.pt"), "--keys", "nosuch.", config=cfg)
    assert_one_line_error(p, 1, "no key matches")
    p = cli("consolidate", "step-2", "--out", str(tmp_path / "x.txt"), config=cfg)
    assert_one_line_error(p, 2, "cannot tell the format")


def test_consolidate_reads_verified(local_ckpts, tmp_path):
    """A flipped byte fails consolidation (no other tier has a good copy) and leaves no output."""
    cfg, root, _sd = local_ckpts
    f = data_files(root, "step-2")[0]
    raw = bytearray(f.read_bytes())
    raw[100] ^= 1
    f.write_bytes(bytes(raw))
    out = tmp_path / "m.safetensors"
    p = cli("consolidate", "step-2", "--out", str(out), "--keys", "model.", config=cfg)
    assert_one_line_error(p, 1, "'model.w'", f.name, "CRC32C")
    assert not out.exists() and not list(tmp_path.glob(".m.safetensors*"))


# -- errors -------------------------------------------------------------------------------------


def test_bad_input_is_one_line(local_ckpts, tmp_path):
    cfg, _root, _sd = local_ckpts
    assert_one_line_error(cli("verify", "step-77", config=cfg), 1, "step-77")
    assert_one_line_error(cli("list", config=tmp_path / "missing.toml"), 2, "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[local]\npath = 3\n")
    assert_one_line_error(cli("list", config=bad), 2, "[local] path")
    assert_one_line_error(cli("list"), 2, "TIERCKPT_CONFIG")
    assert_one_line_error(cli("frobnicate", config=cfg), 2, "invalid choice")
    assert_one_line_error(cli("verify", config=cfg), 2, "required")
    assert_one_line_error(cli("verify", "../etc", config=cfg), 2, "invalid checkpoint id")
    assert_one_line_error(cli("list", "--tier", "s3", config=cfg), 2, "no [s3] section")
    assert_one_line_error(cli("fetch", "latest", config=cfg), 2, "needs both sections")
    assert_one_line_error(cli("consolidate", "latest", config=cfg), 2, "--out")


def test_error_map():
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    from restore.errors import classify

    assert classify(KeyboardInterrupt())[1] == 130
    assert classify(tierckpt.ConfigError("x"))[1] == 2
    assert classify(tierckpt.CheckpointNotFound("x"))[1] == 1
    assert classify(tierckpt.ChecksumMismatch("x"))[1] == 1
    assert classify(tierckpt.TierUnavailable("down"))[1] == 3
    assert classify(PermissionError(13, "Permission denied", "/x"))[0] == "/x: Permission denied"
    assert classify(NoCredentialsError())[1] == 2
    assert classify(EndpointConnectionError(endpoint_url="http://h"))[1] == 3
    msg, code = classify(
        ClientError(
            {"Error": {"Code": "AccessDenied", "Message": "no"}, "ResponseMetadata": {"HTTPStatusCode": 403}},
            "GetObject",
        )
    )
    assert code == 3 and "AccessDenied" in msg and "403" in msg
    assert "TIERCKPT_DEBUG" in classify(RuntimeError("boom"))[0]


def test_debug_prints_traceback(tmp_path):
    p = cli("list", config=tmp_path / "missing.toml", env={"TIERCKPT_DEBUG": "1"})
    assert p.returncode == 2 and "Traceback" in p.stderr


def test_help_has_examples():
    from restore.cli import COMMANDS, build_parser

    parser = build_parser()
    assert "examples:" in parser.format_help()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, sp in sub.choices.items():
        assert "examples:" in sp.format_help() and f"tierckpt-restore {name}" in sp.format_help(), name
    assert len(sub.choices) == len(COMMANDS)


# -- S3: fetch ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_url():
    import s3servers

    url, stop = s3servers.start_moto()
    yield url
    stop()


def _s3(moto_url: str, name: str) -> S3Config:
    import uuid

    import s3servers

    bucket = f"restore-{name}-{uuid.uuid4().hex[:8]}"
    s3servers.make_bucket(moto_url, bucket)
    return S3Config(bucket=bucket, prefix="ckpt", endpoint_url=moto_url, part_size=5 * MiB, concurrency=4)


@pytest.fixture(scope="module")
def s3_saved(tmp_path_factory, moto_url):
    """step-5 saved through local tier A and promoted to S3 (once for the module)."""
    d = tmp_path_factory.mktemp("s3saved")
    s3 = _s3(moto_url, "fetch")
    cfg_a = write_config(d / "a.toml", local=d / "a", s3=s3)
    sd = sample_state(5, big=3000)  # optim.m: 12 MiB -> 3 ranges of 5 MiB in one file
    save(cfg_a, "step-5", sd)
    return s3, cfg_a, d / "a", sd


@pytest.fixture
def s3_ckpt(tmp_path, s3_saved):
    """The S3 checkpoint step-5, and a config with an empty local tier B on the same S3."""
    s3, cfg_a, _root_a, sd = s3_saved
    cfg_b = write_config(tmp_path / "b.toml", local=tmp_path / "b", s3=s3)
    return cfg_a, cfg_b, tmp_path / "b", sd


def test_fetch_into_empty_local_then_load_local_only(s3_ckpt, tmp_path):
    _cfg_a, cfg_b, root_b, sd = s3_ckpt
    p = cli_proc("fetch", "latest", "--json", config=cfg_b)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["checkpoint_id"] == "step-5" and doc["committed"]
    assert doc["bytes_downloaded"] == sum(f.stat().st_size for f in data_files(root_b, "step-5")) > 10 * MiB
    assert (root_b / "step-5" / "metadata.json").is_file()
    assert not list(root_b.rglob("*.partial"))

    local_only = write_config(tmp_path / "b-local.toml", local=root_b)
    got, reader = load(local_only, "latest", sd)
    assert_same(got, sd)
    assert set(reader.served.values()) == {"local"}
    assert cli("verify", "step-5", config=cfg_b).returncode == 0  # both tiers

    # Again: nothing to download, everything checked and skipped.
    from restore import fetch_checkpoint

    res = fetch_checkpoint(cfg_b, "step-5", progress=False)
    assert res.bytes_downloaded == 0 and res.skipped == res.files and res.committed

    # latest agrees over tiers; list shows both tiers committed.
    p = cli("list", "--json", config=cfg_b)
    [c] = json.loads(p.stdout)
    assert c["tiers"]["local"]["state"] == c["tiers"]["s3"]["state"] == "committed"


def test_fetch_resumes_after_interruption(s3_ckpt, monkeypatch):
    _cfg_a, cfg_b, root_b, sd = s3_ckpt
    from restore import fetch_checkpoint
    from tierckpt.tiers.s3 import S3Tier

    real = S3Tier.read_into
    calls = {"n": 0}

    def flaky(self, key, start, buf):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, key, start, buf)

    monkeypatch.setattr(S3Tier, "read_into", flaky)
    with pytest.raises(KeyboardInterrupt):
        fetch_checkpoint(cfg_b, "step-5", progress=False)
    monkeypatch.setattr(S3Tier, "read_into", real)
    assert not (root_b / "step-5" / "metadata.json").exists()  # not committed locally
    [partial] = list(root_b.rglob("*.data.partial"))
    d = partial.parent
    side = json.loads(partial.with_name(partial.name.replace(".partial", ".ranges.partial")).read_text())
    assert 1 <= len(side["done"]) < 3

    res = fetch_checkpoint(cfg_b, "step-5", progress=False)
    assert res.resumed == [partial.name.removesuffix(".partial")]
    assert res.bytes_reused == len(side["done"]) * 5 * MiB
    assert res.bytes_downloaded + res.bytes_reused == sum((d / f).stat().st_size for f in res.files)
    got, _ = load(write_config(d.parent.parent / "b2.toml", local=root_b), "step-5", sd)
    assert_same(got, sd)


def test_fetch_resume_rechecks_ranges_and_repairs(s3_ckpt):
    """A hand-made .partial + sidecar claiming every range, one of them corrupt: only that one is fetched."""
    _cfg_a, cfg_b, root_b, sd = s3_ckpt
    from restore import fetch_checkpoint

    res = fetch_checkpoint(cfg_b, "step-5", progress=False)
    [f] = [p for p in data_files(root_b, "step-5") if p.stat().st_size > 10 * MiB]
    raw = bytearray(f.read_bytes())
    raw[5 * MiB + 123] ^= 0xFF  # in range 1
    partial = f.with_name(f.name + ".partial")
    partial.write_bytes(bytes(raw))
    f.unlink()
    token = json.loads((root_b / "step-5" / "metadata.json").read_bytes().split(b"\n", 1)[1])["save_token"]
    side = {
        "format": "tierckpt-restore/fetch-ranges/1",
        "checkpoint_id": "step-5",
        "save_token": token,
        "file": f.name,
        "size": len(raw),
        "range_size": 5 * MiB,
        "done": [0, 1, 2],
    }
    f.with_name(f.name + ".ranges.partial").write_text(json.dumps(side))
    (root_b / "step-5" / "metadata.json").unlink()
    res = fetch_checkpoint(cfg_b, "step-5", progress=False)
    assert f.name in res.resumed
    assert res.bytes_downloaded == 5 * MiB + sum(p.stat().st_size for p in data_files(root_b, "step-5") if p != f)
    got, _ = load(write_config(root_b.parent / "b3.toml", local=root_b), "step-5", sd)
    assert_same(got, sd)

    # A corrupt *final* file is repaired in place of its bad range only.
    raw = bytearray(f.read_bytes())
    raw[10 * MiB + 5] ^= 1
    f.write_bytes(bytes(raw))
    res = fetch_checkpoint(cfg_b, "step-5", progress=False)
    assert res.repaired == [f.name]
    assert res.bytes_downloaded == len(raw) - 10 * MiB
    assert cli("verify", "step-5", "--tier", "local", config=cfg_b).returncode == 0


def test_fetch_crash_in_subprocess_then_cli_resume(s3_ckpt):
    """The fetching process dies hard (os._exit) mid-download; the next fetch resumes from what
    was recorded. Progress is recorded every RECORD_EVERY bytes (256 MiB): set to one byte here so
    that the 5 MiB ranges of this small file are recorded one by one. Ranges are written (and
    recorded) by writer threads apart from the reader, so the 3rd read dies only once a range read
    before it has been recorded: what a crash loses is what was not recorded yet, by contract."""
    _cfg_a, cfg_b, root_b, sd = s3_ckpt
    crash = (
        "import os, sys, threading\n"
        "from tierckpt.tiers.s3 import S3Tier\n"
        "import tierckpt.tiers.localsinks as sinks; sinks.RECORD_EVERY = 1\n"
        "recorded = threading.Event()\n"
        "record = sinks._ResumableFile._record\n"
        "def recording(self):\n"
        "    record(self)\n"
        "    recorded.set()\n"
        "sinks._ResumableFile._record = recording\n"
        "real = S3Tier.read_into\n"
        "n = [0]\n"
        "def dying(self, key, start, buf):\n"
        "    n[0] += 1\n"
        "    if n[0] == 3:\n"
        "        recorded.wait()\n"
        "        os._exit(9)\n"
        "    return real(self, key, start, buf)\n"
        "S3Tier.read_into = dying\n"
        "from restore.fetch import fetch_checkpoint\n"
        "from tierckpt.config import load_config\n"
        "cfg = load_config(sys.argv[1]); cfg.s3.concurrency = 1\n"
        "fetch_checkpoint(cfg, 'step-5', progress=False)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(
        [sys.executable, "-c", crash, str(cfg_b)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 9, p.stderr
    assert list(root_b.rglob("*.ranges.partial"))
    p = cli("fetch", "step-5", config=cfg_b)
    assert p.returncode == 0, p.stderr
    assert "resumed" in p.stdout and "MiB reused" in p.stdout
    got, _ = load(write_config(root_b.parent / "b4.toml", local=root_b), "step-5", sd)
    assert_same(got, sd)


def test_fetch_errors(s3_ckpt, tmp_path):
    _cfg_a, cfg_b, _root_b, _sd = s3_ckpt
    assert_one_line_error(cli("fetch", "step-6", config=cfg_b), 1, "step-6", "not committed")
    assert_one_line_error(cli("fetch", "step-5", "--rank", "3", config=cfg_b), 2, "--rank 3", "1 rank")
    from tierckpt.catalog.listing import read_checkpoint_metadata
    from tierckpt.format.layout import data_key
    from tierckpt.tiers import make_local, make_s3

    conf = load_config(cfg_b)
    s3t, local = make_s3(conf), make_local(conf)
    _md, man = read_checkpoint_metadata(s3t, "step-5")
    file = sorted(man.files)[0]
    held = local.open_resumable(data_key("step-5", file), man.files[file], block=5 * MiB)  # as if another fetch ran
    try:
        assert_one_line_error(cli("fetch", "step-5", config=cfg_b), 3, "another fetch of step-5")
    finally:
        held.abort()
        s3t.close()
        local.close()
    dead = write_config(
        tmp_path / "dead.toml",
        local=tmp_path / "d",
        s3=S3Config(bucket="nope", prefix="ckpt", endpoint_url="http://127.0.0.1:9", part_size=5 * MiB),
    )
    p = cli("fetch", "latest", config=dead, env={"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"})
    assert_one_line_error(p, 3)


def test_s3_corruption_is_caught(s3_ckpt, tmp_path):
    """A flipped byte in the S3 object: verify names the tier, file and item; fetch refuses it."""
    import s3servers

    from restore import fetch_checkpoint
    from tierckpt.format.layout import data_key

    cfg_a, cfg_b, root_b, _sd = s3_ckpt
    s3 = load_config(cfg_a).s3
    client = s3servers.s3_client(s3.endpoint_url)
    [f] = [p for p in data_files(Path(load_config(cfg_a).local.path), "step-5") if p.stat().st_size > 10 * MiB]
    key = f"{s3.prefix}/{data_key('step-5', f.name)}"
    good = f.read_bytes()
    bad = bytearray(good)
    bad[7 * MiB + 3] ^= 0x10
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(bad))
    try:
        p = cli("verify", "step-5", config=cfg_a)
        assert_one_line_error(p, 1, "failed verification: 1 problem")
        assert "on local" in p.stdout and f"BAD s3: {f.name}: item 'optim.m'" in p.stdout
        with pytest.raises(tierckpt.ChecksumMismatch, match="the S3 copy is corrupt"):
            fetch_checkpoint(cfg_b, "step-5", progress=False)
        assert not (root_b / "step-5" / "metadata.json").exists()
    finally:
        client.put_object(Bucket=s3.bucket, Key=key, Body=good)


def test_consolidate_many_batches(s3_ckpt, tmp_path, monkeypatch):
    """With a tiny batch budget every tensor is its own batch, read from S3 only: same result."""
    import restore.consolidate as rc

    _cfg_a, _cfg_b, _root_b, sd = s3_ckpt
    monkeypatch.setattr(rc, "BATCH_BYTES", 4096)
    s3_only = write_config(tmp_path / "s3.toml", s3=load_config(_cfg_a).s3)
    res = rc.consolidate_checkpoint(s3_only, "step-5", out=tmp_path / "m.pt", progress=False)
    assert set(res.served.values()) == {"s3"}
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    for k, v in flatten(sd).items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


# -- 2 gloo ranks with DTensor shards -----------------------------------------------------------


def _dist_full_state() -> dict:
    g = torch.Generator().manual_seed(42)
    return {
        "model.row": torch.randn(11, 6, generator=g),  # Shard(0): rows 0-5 on rank 0, 6-10 on rank 1
        "model.col": torch.randn(6, 9, generator=g),  # Shard(1): column blocks, not contiguous in the full tensor
        "model.rep": torch.arange(12, dtype=torch.int64).reshape(3, 4),  # replicated plain tensor
        "optim.m": torch.randn(4096, 300, generator=g),  # Shard(0), ~4.7 MiB
    }


def _dist_save_worker(config: str, checkpoint_id: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = _dist_full_state()
    sd = {
        "model": {
            "row": distribute_tensor(full["model.row"], mesh, [Shard(0)]),
            "col": distribute_tensor(full["model.col"], mesh, [Shard(1)]),
            "rep": full["model.rep"],
        },
        "optim": {"m": distribute_tensor(full["optim.m"], mesh, [Shard(0)])},
        "step": 7,
    }
    w = TieredWriter(load_config(config))
    dcp.save(sd, checkpoint_id=checkpoint_id, storage_writer=w)
    w.wait()
    dist.barrier()
    dist.destroy_process_group()


def _run_dist_save(config: Path, checkpoint_id: str, workdir: Path, world: int = 2) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            TIERCKPT_NODE="node0",
            PYTHONPATH=str(REPO),
        )
        log = open(workdir / f"rank{r}.log", "w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, __file__, "dist-save", str(config), checkpoint_id],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=120))
        finally:
            if p.poll() is None:
                p.kill()
            log.close()
    assert codes == [0] * world, [(workdir / f"rank{r}.log").read_text()[-3000:] for r in range(world)]


@pytest.fixture(scope="module")
def dist_ckpt(tmp_path_factory, moto_url):
    """step-7 saved by 2 gloo ranks (DTensor shards) through local tier A and promoted to S3."""
    d = tmp_path_factory.mktemp("dist")
    s3 = _s3(moto_url, "dist")
    cfg_a = write_config(d / "a.toml", local=d / "a", s3=s3)
    _run_dist_save(cfg_a, "step-7", d)
    return d, s3, cfg_a


def test_dist_checkpoint_consolidate(dist_ckpt, tmp_path):
    _d, s3, cfg_a = dist_ckpt
    want = _dist_full_state()
    p = cli("list", "--json", config=cfg_a)
    [c] = json.loads(p.stdout)
    assert c["rank_files"] == 2 and c["tiers"]["s3"]["state"] == "committed"

    out = tmp_path / "full.pt"
    p = cli("consolidate", "step-7", "--out", str(out), config=cfg_a)
    assert p.returncode == 0, p.stderr
    got = torch.load(out, weights_only=True)
    assert sorted(got) == sorted(list(want) + ["step"]) and got["step"] == 7
    for k, v in want.items():
        assert torch.equal(got[k], v), k

    st = pytest.importorskip("safetensors.torch")
    out = tmp_path / "model.safetensors"
    from restore import consolidate_checkpoint

    # From S3 only (no local section): same bytes.
    s3_only = write_config(tmp_path / "s3.toml", s3=s3)
    res = consolidate_checkpoint(s3_only, "latest", out=out, keys=["model."], progress=False)
    assert set(res.served.values()) == {"s3"} and len(res.served) == 2
    got = st.load_file(str(out))
    assert sorted(got) == ["model.col", "model.rep", "model.row"]
    for k in got:
        assert torch.equal(got[k], want[k]), k


def test_dist_fetch_one_rank(dist_ckpt, tmp_path):
    _d, s3, _cfg_a = dist_ckpt
    root_b = tmp_path / "b"
    cfg_b = write_config(tmp_path / "b.toml", local=root_b, s3=s3)
    p = cli("fetch", "step-7", "--rank", "1", config=cfg_b)
    assert p.returncode == 0, p.stderr
    assert "(ranks 1)" in p.stdout
    files = [f.name for f in data_files(root_b, "step-7")]
    assert len(files) == 1 and files[0].startswith("rank-00001-")
    assert (root_b / "step-7" / "metadata.json").is_file()

    # The reader takes rank 1's file from local and rank 0's from S3 (without filling the local
    # tier with it: kept partial for the checks below).
    want = _dist_full_state()
    like = {
        "model": {"row": torch.zeros(11, 6), "col": torch.zeros(6, 9), "rep": torch.zeros(3, 4, dtype=torch.int64)},
        "optim": {"m": torch.zeros(4096, 300)},
        "step": 0,
    }
    no_fill = load_config(cfg_b)
    no_fill.local.fill_on_load = False
    got, reader = load(no_fill, "step-7", like)
    for k, v in want.items():
        assert torch.equal(flatten(got)[k], v), k
    assert reader.served[files[0]] == "local"
    assert sorted(reader.served.values()) == ["local", "s3"]

    # verify: the missing rank-0 file is not a failure (S3 holds it intact).
    p = cli("verify", "step-7", "--json", config=cfg_b)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    local = next(t for t in doc["tiers"] if t["tier"] == "local")
    assert len(local["absent"]) == 1 and local["absent"][0].startswith("rank-00000-")

    # Fetching the rest later completes the local copy.
    from restore import fetch_checkpoint

    res = fetch_checkpoint(cfg_b, "step-7", progress=False)
    assert res.skipped == files and len(res.downloaded) == 1
    assert len(data_files(root_b, "step-7")) == 2

    # ... as does a load with [local] fill_on_load (the default) on a node holding only rank 1's file.
    root_c = tmp_path / "c"
    shutil.copytree(root_b, root_c)
    rank0 = next(f for f in data_files(root_c, "step-7") if f.name.startswith("rank-00000-"))
    rank0.unlink()
    cfg_c = write_config(tmp_path / "c.toml", local=root_c, s3=s3)
    got, reader = load(cfg_c, "step-7", like)
    for k, v in want.items():
        assert torch.equal(flatten(got)[k], v), k
    assert reader.served[rank0.name] == "s3" and reader.fill is not None
    reader.fill.wait()
    assert (
        reader.fill.committed == [rank0.name]
        and rank0.read_bytes() == (root_b / rank0.relative_to(root_c)).read_bytes()
    )


def test_s3_gc_dry_run(dist_ckpt, tmp_path):
    _d, s3, _cfg_a = dist_ckpt
    cfg = write_config(tmp_path / "s3gc.toml", s3=s3, s3_keep=1)
    p = cli("gc", "--dry-run", "--tier", "s3", config=cfg)
    assert p.returncode == 0 and "nothing to delete" in p.stdout, p.stderr


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "dist-save":
    _dist_save_worker(sys.argv[2], sys.argv[3])
