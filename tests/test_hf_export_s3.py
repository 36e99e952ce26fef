"""Hugging Face export to S3 (``export --out s3://bucket/prefix``, ``[export] path = "s3://..."``).

Real parts: moto's S3 server over HTTP on loopback; the exporter is the CLI in a subprocess,
SIGKILL-ed while its last shard is being converted (an adapter that waits on it), after its first
shards are uploaded; the prefix is downloaded with boto3 and loaded with
``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from test_hf_export import SHARD, _cli_cmd, _env, saved  # noqa: E402,F401 - saved: the module's fixture

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

INDEX = "model.safetensors.index.json"


def wait_on_lm_head(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A test adapter (identity) that blocks on the real ``lm_head.weight`` (the last tensor, in
    the last shard) until ``$HOLD_FILE`` disappears, so that a test can kill the export there."""
    hold = os.environ.get("HOLD_FILE", "")
    for k, v in sd.items():
        if k == "lm_head.weight" and not v.is_meta:
            while hold and os.path.exists(hold):
                time.sleep(0.05)
    return sd


def _keys(client, bucket: str, prefix: str) -> list[str]:
    resp = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1 :] for o in resp.get("Contents", ()))


def _download(client, bucket: str, prefix: str, to: Path) -> Path:
    to.mkdir()
    for k in _keys(client, bucket, prefix):
        client.download_file(bucket, f"{prefix}/{k}", str(to / k))
    return to


def test_export_to_s3_shards_first_index_last_and_rerun_replaces(saved, tmp_path, moto_endpoint, s3cfg):  # noqa: F811
    import boto3

    from restore.export import ExportExists, export_hf, is_export
    from tierckpt import load_config

    s3 = s3cfg(moto_endpoint)  # a fresh bucket; its [s3] tier lives under "ckpt"
    cfg_path = tmp_path / "s3.toml"
    cfg_path.write_text(
        saved["cfg"].read_text()
        + f'[s3]\nbucket = "{s3.bucket}"\nprefix = "ckpt"\nendpoint_url = "{moto_endpoint}"\npart_size = "5MiB"\n'
    )
    cfg = load_config(cfg_path)
    client = boto3.client("s3", endpoint_url=moto_endpoint)
    url, prefix = f"s3://{s3.bucket}/hf/{{checkpoint_id}}", "hf/step-3"
    common = dict(keys=["model."], strip_prefix="model.", files=[saved["ref"] / "config.json"], progress=False)

    # an older export, split differently, is there
    old = export_hf(cfg, "step-3", out=url, max_shard_size="60KB", **common)
    assert old.out == f"s3://{s3.bucket}/{prefix}" and len(old.shards) > 3
    assert INDEX in _keys(client, s3.bucket, prefix) and is_export(old.out, cfg)
    with pytest.raises(ExportExists, match="an export already"):
        export_hf(cfg, "step-3", out=url, max_shard_size=SHARD, **common)
    # inside the [s3] tier's own prefix: refused before anything is written
    from restore.errors import UsageError

    with pytest.raises(UsageError, match="inside the \\[s3\\] tier"):
        export_hf(cfg, "step-3", out=f"s3://{s3.bucket}/ckpt/hf", **common)

    # the CLI exports over it and is SIGKILL-ed on its last shard, after the first ones are uploaded
    hold = tmp_path / "hold"
    hold.touch()
    env = _env()
    env["PYTHONPATH"] = str(Path(__file__).parent) + os.pathsep + env["PYTHONPATH"]
    env["HOLD_FILE"] = str(hold)
    cmd = _cli_cmd(saved, url, "--force", "--adapter", "test_hf_export_s3:wait_on_lm_head")
    cmd[cmd.index("--config") + 1] = str(cfg_path)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        ref_shards = sorted(p.name for p in saved["ref"].glob("*.safetensors"))
        while not set(ref_shards[:-1]) <= set(_keys(client, s3.bucket, prefix)):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = _keys(client, s3.bucket, prefix)
    # the older export stopped looking complete before its files were replaced; no marker now
    assert INDEX not in left and "model.safetensors" not in left and ref_shards[-1] not in left
    assert not is_export(f"s3://{s3.bucket}/{prefix}", cfg)
    with pytest.raises(OSError):
        transformers.AutoModelForCausalLM.from_pretrained(_download(client, s3.bucket, prefix, tmp_path / "partial"))

    # the rerun completes and removes the older export's files
    res = export_hf(cfg, "step-3", out=url, max_shard_size=SHARD, overwrite=True, **common)
    ref = saved["ref"]
    assert sorted(_keys(client, s3.bucket, prefix)) == sorted([*ref_shards, INDEX, "config.json"])
    assert res.shards == ref_shards
    folder = _download(client, s3.bucket, prefix, tmp_path / "got")
    for name in [*ref_shards, INDEX, "config.json"]:
        assert (folder / name).read_bytes() == (ref / name).read_bytes(), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for k, v in saved["state"].items():
        assert torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)), k
    # nothing staged is left behind (the killed run's staging directory included)
    import tempfile

    assert not [p for p in Path(tempfile.gettempdir()).glob(".tierckpt-s3export.partial-*") if p.exists()]


def test_s3_export_path_inside_the_s3_tier_is_refused_at_load(tmp_path):
    from tierckpt import load_config
    from tierckpt.errors import ConfigError

    base = f'[local]\npath = "{tmp_path / "local"}"\n[s3]\nbucket = "b"\nprefix = "ckpt"\n'
    for path, ok in (("s3://b/ckpt/hf/{checkpoint_id}", False), ("s3://b/hf/{checkpoint_id}", True),
                     ("s3://other/ckpt/hf", True), ("s3://b", False), ("s3://b/ckptx/hf", True)):  # fmt: skip
        p = tmp_path / "c.toml"
        p.write_text(base + f'[export]\nevery = 1\npath = "{path}"\n')
        if ok:
            assert load_config(p).export.path == path
        else:
            with pytest.raises(ConfigError, match=r"\[export\] path"):
                load_config(p)
