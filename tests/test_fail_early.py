"""A tier that fails is reported when it matters, not only by the last ``wait()`` (issue 32, "Also").

On real parts: a local directory (unwritable by permission, or under a regular file: that one
fails for root too), moto's S3 server on loopback (a bucket that does not exist, no credentials),
SeaweedFS with two identities (a wrong secret), a loopback socket that accepts and never answers
(a hung S3), and a pass-through proxy in front of moto that goes away mid-run (``outage``: every
new connection is reset).

* ``TieredWriter(cfg)`` checks every tier at once: an unusable one raises there with a message
  naming it (never a secret); a hung S3 is a WARNING, and construction returns.
* A checkpoint that could not be committed on the first tier is raised by the next ``dcp.save``.
* A failed copy to S3 keeps training going: one WARNING per checkpoint naming the tier and the
  backlog; ``wait()`` raises :class:`CopiesPending` naming what is committed where and what is
  pending; ``wait(tiers="local")`` returns; the next writer (a new job) copies the backlog first.

Behaviour only: no timed assertions (the timeouts bound the test, they are not measured).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import uuid
from collections.abc import Iterator
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import pytest
import s3servers  # tools/ (conftest puts it on sys.path)
import torch
import torch.distributed.checkpoint as dcp
from faultproxy import FaultProxy

from tierckpt import TieredReader, TieredWriter
from tierckpt.config import HostConfig, LocalConfig, MiB, S3Config, TierConfig
from tierckpt.errors import (
    CopiesPending,
    ReplicationError,
    SaveError,
    TierAccessDenied,
    TierckptError,
    TierError,
)
from tierckpt.testing import find_error

SECRET = "tierckpt-test-secret-never-printed"


def config(local: Path | None, s3: S3Config | None = None) -> TierConfig:
    return TierConfig(
        host=HostConfig(buffer_size=8 * MiB, chunk_size=1 * MiB),
        local=None if local is None else LocalConfig(path=str(local), keep=0, fsync=False),
        s3=s3,
    )


def s3_config(endpoint: str, bucket: str, **kw: Any) -> S3Config:
    fields: dict[str, Any] = {
        "bucket": bucket,
        "prefix": "ckpt",
        "endpoint_url": endpoint,
        "part_size": 5 * MiB,
        "concurrency": 2,
        "max_attempts": 2,
        "connect_timeout": 1.0,
        "read_timeout": 2.0,
        "keep": 0,
    }
    fields.update(kw)
    cfg = S3Config(**fields)
    cfg.validate()
    return cfg


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 256, generator=g), "step": step}


def save(w: TieredWriter, cid: str, step: int) -> None:
    dcp.save(state(step), checkpoint_id=cid, storage_writer=w, no_dist=True)
    w.wait_captured()


def on_s3(endpoint: str, bucket: str) -> set[str]:
    """Checkpoint ids committed on S3 (their metadata object exists), read with a client of the test's."""
    c = s3servers.s3_client(endpoint)
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix="ckpt/").get("Contents", [])]
    return {k.split("/")[1] for k in keys if k.endswith("/metadata.json")}


@pytest.fixture
def bucket(moto_endpoint: str) -> str:
    name = f"tierckpt-{uuid.uuid4().hex[:12]}"
    s3servers.make_bucket(moto_endpoint, name)
    return name


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    """A pass-through proxy in front of moto; ``outage = True`` makes the endpoint go away."""
    with FaultProxy(moto_endpoint, error_rate=0.0, drop_rate=0.0) as p:
        p.outage_mode = "reset"
        yield p


@pytest.fixture
def hung_endpoint() -> Iterator[str]:
    """A loopback port that accepts connections (the kernel's backlog) and never answers."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


# -- checks at construction -------------------------------------------------------------------


def test_local_path_under_a_file_fails_at_construction(tmp_path):
    """A [local] path that cannot be a directory (a component is a regular file): fails for root too."""
    (tmp_path / "plain").write_text("not a directory")
    with pytest.raises(TierError) as ei:
        TieredWriter(config(tmp_path / "plain" / "ckpt"))
    msg = str(ei.value)
    assert "[local]" in msg and str(tmp_path / "plain" / "ckpt") in msg and "is a file" in msg, msg


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_local_path_without_write_permission_fails_at_construction(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(TierError) as ei:
            TieredWriter(config(parent / "ckpt"))
        msg = str(ei.value)
        assert "[local]" in msg and str(parent / "ckpt") in msg and "not writable" in msg, msg
    finally:
        parent.chmod(stat.S_IRWXU)


def test_missing_bucket_fails_at_construction(moto_endpoint, tmp_path):
    name = f"tierckpt-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(TierckptError) as ei:
        TieredWriter(config(tmp_path / "local", s3_config(moto_endpoint, name)))
    msg = str(ei.value)
    assert name in msg and "does not exist" in msg and "[s3]" in msg, msg
    assert not (tmp_path / "local").exists() or not any((tmp_path / "local").iterdir())


def test_no_credentials_fail_at_construction(moto_endpoint, bucket, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(TierAccessDenied, match="no usable S3 credentials"):
        TieredWriter(config(tmp_path / "local", s3_config(moto_endpoint, bucket)))


def test_wrong_secret_fails_at_construction_without_echo(tmp_path_factory, monkeypatch, tmp_path, caplog):
    """SeaweedFS enforcing identities: a known key with a wrong secret is refused by the one check."""
    from s3_fixtures import serve_seaweedfs
    from test_s3_access import ADMIN, READER, as_identity

    gen = serve_seaweedfs(tmp_path_factory.mktemp("seaweedfs-auth"), identities=[ADMIN, READER])
    url = next(gen)
    try:
        name = f"tierckpt-{uuid.uuid4().hex[:12]}"
        s3servers.make_bucket(url, name, credentials=ADMIN.credentials)
        as_identity(monkeypatch, ADMIN.access_key, SECRET)
        with caplog.at_level(logging.DEBUG, logger="tierckpt"), pytest.raises(TierAccessDenied) as ei:
            TieredWriter(config(tmp_path / "local", s3_config(url, name)))
        msg = str(ei.value)
        assert "access denied" in msg and "SignatureDoesNotMatch" in msg and name in msg, msg
        assert SECRET not in msg and SECRET not in caplog.text
    finally:
        gen.close()


def test_hung_s3_at_construction_is_a_warning(hung_endpoint, tmp_path, caplog, monkeypatch):
    """An endpoint that accepts and never answers: the check gives up after the tier's timeouts,
    one attempt; the writer is created, a WARNING says S3 cannot be used now, saves commit locally."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    s3 = s3_config(hung_endpoint, "never-answered", connect_timeout=0.5, read_timeout=0.5, max_attempts=1)
    cfg = config(tmp_path / "local", s3)
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        w = TieredWriter(cfg)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "cannot be used now" in r.getMessage()]
    assert len(warned) == 1 and "[s3]" in warned[0].getMessage(), [r.getMessage() for r in caplog.records]
    save(w, "step-1", 1)
    w.wait(tiers="local")
    assert (tmp_path / "local" / "step-1" / "metadata.json").exists()
    w.engine.close()


# -- the first tier fails: the next dcp.save raises --------------------------------------------


def test_first_tier_failure_is_raised_by_the_next_save(tmp_path, caplog):
    local = tmp_path / "local"
    w = TieredWriter(config(local))
    save(w, "step-1", 1)
    w.wait()
    # The local tier goes bad behind the writer's back (a file where its directory was: this
    # refuses root too).
    shutil.rmtree(local)
    local.write_text("gone")
    dcp.save(state(2), checkpoint_id="step-2", storage_writer=w, no_dist=True)  # returns: it fails in the background
    job = w.last
    assert job is not None and job.id == "step-2"
    futures_wait([job.committed])
    assert job.committed.exception() is not None
    with pytest.raises(BaseException) as ei:  # DCP wraps it in its CheckpointException
        dcp.save(state(3), checkpoint_id="step-3", storage_writer=w, no_dist=True)
    err = find_error(ei.value, SaveError) or find_error(ei.value, TierError)
    assert err is not None, repr(ei.value)
    assert "step-2" in str(err), str(err)
    # raised once: with the tier back, training goes on and wait() has nothing left to raise
    local.unlink()
    local.mkdir()
    save(w, "step-4", 4)
    w.wait()
    assert (local / "step-4" / "metadata.json").exists()
    w.engine.close()


# -- a later tier fails: training goes on, wait() tells what is where ----------------------------


def test_s3_outage_mid_run(proxy, moto_endpoint, bucket, tmp_path, caplog):
    """S3 goes away after the first checkpoint: saves go on (committed locally), one WARNING per
    checkpoint names S3 and the backlog, ``wait()`` says what is committed where and what is
    pending, ``wait(tiers="local")`` returns, and the next job copies the backlog first."""
    s3 = s3_config(proxy.url, bucket)
    cfg = config(tmp_path / "local", s3)
    w = TieredWriter(cfg)
    save(w, "step-1", 1)
    w.wait()
    assert on_s3(moto_endpoint, bucket) == {"step-1"}

    proxy.outage = True  # every new connection is reset from now on
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        for step in (2, 3, 4):
            save(w, f"step-{step}", step)  # never raises: the checkpoints are committed locally
        with pytest.raises(CopiesPending) as ei:
            w.wait()
    err = ei.value
    assert isinstance(err, ReplicationError)
    msg = str(err)
    assert "committed on local, pending on s3: step-2, step-3, step-4 (3 checkpoints)" in msg, msg
    assert "more background errors" not in msg and "more background errors" not in caplog.text
    assert err.committed_on == "local" and err.pending == {"s3": ["step-2", "step-3", "step-4"]}
    assert isinstance(err.__cause__, TierckptError)
    for step in (2, 3, 4):
        cid = f"step-{step}"
        assert (tmp_path / "local" / cid / "metadata.json").exists()
        mine = [
            r
            for r in caplog.records
            if r.levelno >= logging.WARNING and f"checkpoint {cid} is committed on local" in r.getMessage()
        ]
        assert len(mine) == 1, [r.getMessage() for r in caplog.records]
        assert r"copy to s3 failed and is pending" in mine[0].getMessage()
        assert "not on s3 yet" in mine[0].getMessage()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR and cid in r.getMessage()]
    # raised once: a second wait has nothing new to say
    w.wait()

    # One more save while S3 is down; the job ends on its commits only.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        save(w, "step-5", 5)
        w.wait(tiers="local")
        w.engine.close()  # the job's end (atexit): bounded, warns, never raises for a later tier
    assert any("copies pending" in r.getMessage() and "step-5" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    assert on_s3(moto_endpoint, bucket) == {"step-1"}

    # The next job, S3 back: its writer copies the backlog first.
    proxy.outage = False
    w2 = TieredWriter(cfg)
    save(w2, "step-6", 6)
    w2.wait()
    assert on_s3(moto_endpoint, bucket) == {f"step-{i}" for i in range(1, 7)}
    # and S3 alone serves them
    out = {"w": torch.zeros(256, 256), "step": 0}
    dcp.load(out, checkpoint_id="step-3", storage_reader=TieredReader(config(None, s3)), no_dist=True)
    assert torch.equal(out["w"], state(3)["w"]) and out["step"] == 3
    w2.engine.close()


def test_wait_tiers_names_are_checked(tmp_path):
    w = TieredWriter(config(tmp_path / "local"))
    with pytest.raises(ValueError, match="no tier 's4'"):
        w.wait(tiers="s4")
    w.wait(tiers="first")
    w.wait(tiers=["local"])
    w.engine.close()
