"""``tierckpt-restore push`` and ``delete`` on real parts: a local tier in ``tmp_path``, a moto S3
server over HTTP on loopback, checkpoints saved with ``dcp.save`` through ``TieredWriter``, the
CLI's ``main()`` in this process (the same parsing, printing and exit statuses as the command).

The backlog of an S3 outage is made by saving with a configuration without ``[s3]`` and then
pushing with one that has it (the job never reached S3: exactly what an outage leaves).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from test_restore_cli import cli, load, sample_state, save, write_config

from tierckpt import load_config
from tierckpt.catalog import lease as leases
from tierckpt.catalog.listing import list_checkpoints, read_checkpoint_doc
from tierckpt.errors import CommitConflict
from tierckpt.tiers import make_tiers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def committed(cfg: Path, tier: str) -> list[str]:
    """Ids committed on the tier of section ``tier``, in listing order."""
    tiers = make_tiers(load_config(cfg))
    try:
        (t,) = [t for t in tiers if t.name == tier]
        return sorted(c.checkpoint_id for c in list_checkpoints(t) if c.committed)
    finally:
        for t in tiers:
            t.close()


@pytest.fixture
def backlog(tmp_path: Path, moto_endpoint: str, s3cfg) -> tuple[Path, Path, dict]:
    """Three checkpoints committed on the local tier only; returns (local-only config, local+S3
    config with ``[s3] keep = 2``, the states saved)."""
    local = tmp_path / "local"
    only_local = write_config(tmp_path / "local.toml", local=local)
    both = write_config(tmp_path / "both.toml", local=local, s3=s3cfg(moto_endpoint), s3_keep=2)
    states = {}
    for step in (1, 2, 3):
        states[f"step-{step}"] = sample_state(step)
        save(only_local, f"step-{step}", states[f"step-{step}"])
    return only_local, both, states


def test_push_promotes_the_backlog_then_applies_retention(backlog, tmp_path: Path) -> None:
    _only_local, both, states = backlog
    assert committed(both, "s3") == []
    r = cli("push", config=both)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "pushed 3 checkpoint(s): step-1, step-2, step-3" in r.stdout
    # [s3] keep = 2: retention ran after the push and dropped the oldest from S3 only
    assert committed(both, "s3") == ["step-2", "step-3"]
    assert committed(both, "local") == ["step-1", "step-2", "step-3"]
    assert "step-1 (s3)" in r.stdout
    # what S3 holds is bit-exact: loaded through a configuration that has S3 only
    s3_only = tmp_path / "s3only.toml"
    s3_only.write_text(both.read_text().split("[local]")[0] + "[s3]" + both.read_text().split("[s3]")[1])
    got, _reader = load(s3_only, "step-3", states["step-3"])
    assert torch.equal(got["optim"]["m"], states["step-3"]["optim"]["m"])
    # nothing owed any more
    again = cli("push", "--json", config=both)
    assert again.returncode == 0 and '"needed": []' in again.stdout


def test_push_reports_a_tier_that_is_down(tmp_path: Path) -> None:
    local = tmp_path / "local"
    only_local = write_config(tmp_path / "local.toml", local=local)
    save(only_local, "step-1", sample_state(1))
    from tierckpt.config import S3Config

    down = S3Config(bucket="gone", prefix="ckpt", endpoint_url="http://127.0.0.1:9", part_size=5 << 20)
    cfg = write_config(tmp_path / "down.toml", local=local, s3=down)
    r = cli("push", "--no-gc", config=cfg)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "s3 (" in r.stdout and "could not push" in r.stdout


def test_delete_all_makes_a_fresh_start_possible(backlog, monkeypatch) -> None:
    _only_local, both, states = backlog
    assert cli("push", config=both).returncode == 0
    # a rerun from scratch: its first save meets the old run
    with pytest.raises(BaseException) as conflict:  # DCP wraps it in a CheckpointException (a BaseException)
        save(both, "step-1", states["step-1"])
    assert CommitConflict.__name__ in str(conflict.value) and "tierckpt-restore delete --all" in str(conflict.value)
    # asked, answered no: nothing deleted
    monkeypatch.setattr(sys, "stdin", io.StringIO("n\n"))
    r = cli("delete", "--all", config=both)
    assert r.returncode == 1 and "nothing deleted" in r.stderr and "[y/N]" in r.stderr
    assert committed(both, "local") == ["step-1", "step-2", "step-3"]
    # one checkpoint on one tier, confirmed on stdin
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    r = cli("delete", "step-2", "--tier", "s3", config=both)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert committed(both, "s3") == ["step-3"] and committed(both, "local") == ["step-1", "step-2", "step-3"]
    # the whole run, everywhere
    r = cli("delete", "--all", "--yes", config=both)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert committed(both, "local") == [] and committed(both, "s3") == []
    save(both, "step-1", states["step-1"])  # the fresh start
    assert committed(both, "local") == ["step-1"] and committed(both, "s3") == ["step-1"]


def test_delete_leaves_a_checkpoint_in_use(backlog) -> None:
    only_local, _both, _states = backlog
    tiers = make_tiers(load_config(only_local))
    try:
        with leases.acquire(tiers[0], "step-3", purpose="a load in another job"):
            r = cli("delete", "--all", "--yes", config=only_local)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "in use on local (not deleted): step-3" in r.stdout
        assert committed(only_local, "local") == ["step-3"]
    finally:
        for t in tiers:
            t.close()
    bad = cli("delete", config=only_local)
    assert bad.returncode == 2 and "--all" in bad.stderr
    missing = cli("delete", "step-9", "--yes", config=only_local)
    assert missing.returncode == 1 and "step-9" in missing.stderr


def test_push_into_a_compressing_s3(tmp_path: Path, moto_endpoint: str, s3cfg) -> None:
    """``[s3] compression = "zstd"``: the push stores encoded frames (the job's encoded copy) and
    records them in S3's metadata; a load from S3 alone decodes them bit-exact."""
    local = tmp_path / "local"
    only_local = write_config(tmp_path / "local.toml", local=local)
    sd = sample_state(5)
    save(only_local, "step-5", sd)
    both = write_config(tmp_path / "both.toml", local=local, s3=s3cfg(moto_endpoint))
    both.write_text(both.read_text() + 'compression = "zstd"\n')  # the [s3] section is last
    r = cli("push", config=both)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert committed(both, "s3") == ["step-5"]
    text = both.read_text()
    s3_only = tmp_path / "s3only.toml"
    s3_only.write_text(text.split("[local]")[0] + "[s3]" + text.split("[s3]")[1].replace('compression = "zstd"\n', ""))
    got, _reader = load(s3_only, "step-5", sd)
    assert torch.equal(got["optim"]["m"], sd["optim"]["m"]) and torch.equal(got["model"]["w"], sd["model"]["w"])
    tiers = make_tiers(load_config(both))
    try:
        assert read_checkpoint_doc(tiers[1], "step-5").manifest.stored  # encoded on S3
    finally:
        for t in tiers:
            t.close()


def test_delete_never_imports_torch(tmp_path: Path) -> None:
    """``delete`` is a launcher's command too (before a fresh start): it starts at once."""
    import os
    import subprocess

    from test_restore_cli import REPO

    cfg = write_config(tmp_path / "local.toml", local=tmp_path / "local")
    save(cfg, "step-1", sample_state(1))
    probe = (
        "import sys\nfrom restore.cli import main\n"
        f"code = main(['--config', {str(cfg)!r}, 'delete', '--all', '--yes'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\nprint('code', code)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "code 0" in p.stdout, p.stdout
    assert committed(cfg, "local") == []
