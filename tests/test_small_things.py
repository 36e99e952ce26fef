"""Small things a user trips on (issue 33, item 10), each on real parts: the CLI's ``main()`` in
this process over real files, a moto S3 server over HTTP (behind :class:`faultproxy.FaultProxy`
for a slow S3), ``dcp.save`` through ``TieredWriter``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from faultproxy import FaultProxy
from test_restore_cli import cli, flatten, sample_state, save, write_config

from tierckpt import TieredWriter, load_config
from tierckpt.config import S3Config
from tierckpt.errors import CommitError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def local_ckpt(tmp_path: Path) -> tuple[Path, dict]:
    cfg = write_config(tmp_path / "tiers.toml", local=tmp_path / "local")
    sd = sample_state(1)
    save(cfg, "step-1", sd)
    return cfg, sd


def test_consolidate_keys_before_the_id_and_strip_prefix(local_ckpt, tmp_path: Path) -> None:
    cfg, sd = local_ckpt
    out = tmp_path / "k.pt"
    # --keys takes one prefix (repeatable): it no longer swallows the id that follows it
    r = cli("consolidate", "--keys", "model.", "latest", "--out", str(out), "--strip-prefix", "model.", config=cfg)
    assert r.returncode == 0, r.stderr
    got = torch.load(out, weights_only=True)
    want = {k.removeprefix("model."): v for k, v in flatten(sd).items() if k.startswith("model.")}
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    r = cli("consolidate", "--keys", "model.", "--keys", "step", "latest", "--out", str(out), config=cfg)
    assert r.returncode == 0, r.stderr
    assert set(torch.load(out, weights_only=True)) == {k for k in flatten(sd) if k.startswith(("model.", "step"))}


def test_s3_compression_without_local_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "s3only.toml"
    cfg.write_text('[s3]\nbucket = "b"\nendpoint_url = "http://127.0.0.1:9"\ncompression = "zstd"\n')
    r = cli("list", config=cfg)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert str(cfg) in r.stderr and "[s3] compression" in r.stderr and "[local]" in r.stderr
    cfg.write_text('[s3]\nbucket = "b"\nendpoint_url = "http://127.0.0.1:9"\ncopy_unchanged = true\n')
    r = cli("list", config=cfg)
    assert r.returncode == 2 and "[s3] copy_unchanged" in r.stderr


def test_list_and_verify_say_which_size(local_ckpt) -> None:
    cfg, _sd = local_ckpt
    r = cli("list", config=cfg)
    assert r.returncode == 0 and r.stdout.splitlines()[0].split()[3] == "STORED", r.stdout
    r = cli("verify", "latest", config=cfg)
    assert r.returncode == 0 and "of data checked (logical size, as saved)" in r.stdout, r.stdout


def test_wait_timeout_names_the_tier_behind(tmp_path: Path) -> None:
    import s3servers

    url, stop = s3servers.start_moto()
    try:
        s3servers.make_bucket(url, "behind")
        with FaultProxy(url, error_rate=0.0, drop_rate=0.0, stall_rate=1.0, stall_s=2.0) as proxy:
            s3 = S3Config(bucket="behind", prefix="ckpt", endpoint_url=proxy.url, part_size=5 << 20)
            cfg = load_config(write_config(tmp_path / "tiers.toml", local=tmp_path / "local", s3=s3))
            w = TieredWriter(cfg)
            import torch.distributed.checkpoint as dcp

            dcp.save(sample_state(1), checkpoint_id="step-1", storage_writer=w, no_dist=True)
            w.wait(tiers="first")  # committed locally; every S3 request takes 2 s
            with pytest.raises(CommitError) as ei:
                w.wait(timeout=0.5)
            assert "after 0.5 s: s3 is behind" in str(ei.value), str(ei.value)
            proxy.stall_rate = 0.0
            w.wait()
    finally:
        stop()


def test_a_checkpoint_whose_copy_to_s3_failed_is_committed_not_failed():
    """The timeline's status: a record whose error is a failed copy to a later tier (S3 down) is a
    checkpoint committed on its first tier, pending on S3 ("ok, copy to s3 failed"); an error no
    failed copy explains (capture, flush, commit) is a failed checkpoint."""
    from tierckpt.telemetry.history import CheckpointRun, RankRecord
    from tierckpt.telemetry.phases import Phase

    def rec(rank: int, error: str | None, *phases: Phase) -> RankRecord:
        return RankRecord("step-4", "t", 4, rank, 2, rank, "0", 10, error, {}, list(phases), "p")

    ok = [Phase("capture", 0, 1), Phase("commit", 1, 2)]
    copy_failed = CheckpointRun(
        "step-4",
        "t",
        4,
        [rec(0, "replication to s3 failed", *ok, Phase("hop:s3", 2, 3, error="reset")), rec(1, None, *ok)],
    )
    assert not copy_failed.failed and copy_failed.copies_failed == ["s3"]
    lost = CheckpointRun(
        "step-4", "t", 4, [rec(0, "flush failed", Phase("flush", 0, 1, error="EIO")), rec(1, None, *ok)]
    )
    assert lost.failed and lost.copies_failed == []
