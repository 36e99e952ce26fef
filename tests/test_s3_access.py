"""S3 access: refused credentials, secrets in URLs, invalid endpoints and CLI numbers (issue 10,
items 5 and 6 and "S3 access denied").

* A SeaweedFS whose S3 gateway enforces two identities -- an admin key and a read-only key
  (Read and List only) -- runs once for this module. Saving or promoting with the read-only key
  fails with one clear :class:`TierAccessDenied` naming the bucket and key, after a handful of
  requests (counted by a pass-through :class:`FaultProxy` in front of the server: an access
  denial is never retried); loading with the read-only key works. A wrong secret key or an
  unknown access key is a clear error too, from the tier and from the CLI.
* No secret is ever printed: ``[s3] endpoint_url`` with user information is refused without
  echoing it, and URLs that still reach a message (botocore quotes the request URL) lose their
  user information and query string.
* Invalid endpoint URLs and out-of-range CLI numbers are one-line errors naming the key (and the
  configuration file) or the option, before anything contacts S3.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3servers
import torch
import torch.distributed.checkpoint as dcp
from faultproxy import FaultProxy
from s3_fixtures import serve_seaweedfs
from test_restore_cli import assert_one_line_error, cli, cli_proc, write_config

from tierckpt import (
    ConfigError,
    HostConfig,
    LocalConfig,
    TierConfig,
    TieredReader,
    TieredWriter,
    TierError,
    load_config,
)
from tierckpt.config import MiB, S3Config
from tierckpt.config.redact import redact, redact_url
from tierckpt.errors import TierAccessDenied
from tierckpt.testing import find_error as find
from tierckpt.tiers.s3 import S3Tier

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

ADMIN = s3servers.Identity("admin", "TIERCKPTADMIN0001", f"admin-secret-{uuid.uuid4().hex}")
READER = s3servers.Identity("reader", "TIERCKPTREADER001", f"reader-secret-{uuid.uuid4().hex}", ("Read", "List"))
WRONG_SECRET = f"wrong-secret-{uuid.uuid4().hex}"
SECRETS = (ADMIN.secret_key, READER.secret_key, WRONG_SECRET)
DENIAL_BOUND = 4
"""Requests a failed save may send in all (the denied write, perhaps an abort or a cleanup; 1-2
measured). The configs use ``max_attempts = 5``: a denial retried by botocore would alone send 5."""


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_s3(tmp_path_factory) -> Iterator[str]:
    """URL of a SeaweedFS that accepts only ADMIN (everything) and READER (Read, List)."""
    yield from serve_seaweedfs(tmp_path_factory.mktemp("seaweedfs-auth"), identities=[ADMIN, READER])


@pytest.fixture
def counter(auth_s3) -> Iterator[FaultProxy]:
    """A pass-through proxy in front of the server: ``counter.stats["requests"]`` counts every
    HTTP request that reached it (botocore's retries included)."""
    with FaultProxy(auth_s3, error_rate=0.0, drop_rate=0.0) as proxy:
        yield proxy


def as_identity(monkeypatch, key: str, secret: str) -> dict[str, str]:
    """Make boto3's credential chain yield ``key``/``secret`` (environment only); returns the env."""
    env = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1"}
    for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    return env


def new_s3(auth_s3: str, endpoint_url: str | None = None) -> S3Config:
    """A fresh bucket (made with the admin key) and an [s3] config for it."""
    bucket = f"tierckpt-{uuid.uuid4().hex[:12]}"
    s3servers.make_bucket(auth_s3, bucket, credentials=ADMIN.credentials)
    return S3Config(
        bucket=bucket,
        prefix="ckpt",
        endpoint_url=endpoint_url or auth_s3,
        part_size=5 * MiB,
        concurrency=4,
        max_attempts=5,
        connect_timeout=2.0,
        read_timeout=10.0,
    )


def tier_config(s3: S3Config, local: Path | None = None) -> TierConfig:
    return TierConfig(
        host=HostConfig(buffer_size=8 * MiB, chunk_size=1 * MiB),
        local=None if local is None else LocalConfig(path=str(local), keep=0, fsync=False),
        s3=s3,
    )


def state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(700, 300, generator=g), "b": torch.randn(10, generator=g).bfloat16(), "step": seed}


def zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


def save_error(cfg: TierConfig, checkpoint_id: str, sd: dict[str, Any]) -> BaseException:
    """Save and wait; return what was raised (by dcp.save or by the wait). Fails if nothing was."""
    w = TieredWriter(cfg)
    try:
        dcp.save(sd, checkpoint_id=checkpoint_id, storage_writer=w, no_dist=True)
        w.wait()
    except BaseException as e:  # noqa: BLE001 - DCP wraps errors in a BaseException
        return e
    raise AssertionError("the save succeeded with a read-only key")


def assert_no_secret(*texts: str) -> None:
    for t in texts:
        for s in SECRETS:
            assert s not in t, t[:500]


# -- access denied: saving and promoting with a read-only key ---------------------------------


def test_read_only_key_cannot_save_direct(auth_s3, counter, monkeypatch, caplog):
    """[s3] only: chunks stream from the host pool to S3; the first write is denied."""
    s3 = new_s3(auth_s3, counter.url)
    as_identity(monkeypatch, *READER.credentials)
    before = counter.stats["requests"]
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        raised = save_error(tier_config(s3), "step-1", state())
    sent = counter.stats["requests"] - before
    err = find(raised, TierAccessDenied)
    assert err is not None, repr(raised)
    msg = str(err)
    assert "access denied" in msg and "AccessDenied" in msg and f"s3://{s3.bucket}/ckpt/" in msg and "step-1" in msg
    assert isinstance(err, TierError) and isinstance(err, PermissionError)
    assert 1 <= sent <= DENIAL_BOUND, sent
    assert_no_secret(msg, caplog.text)
    assert (
        list(
            s3servers.s3_client(auth_s3, credentials=ADMIN.credentials)
            .list_objects_v2(Bucket=s3.bucket)
            .get("Contents", [])
        )
        == []
    )


def test_read_only_key_cannot_promote(auth_s3, counter, monkeypatch, tmp_path, caplog):
    """[local] + [s3]: the local commit succeeds, the promotion is denied at its first write and
    ``wait()`` raises the denial; the checkpoint stays loadable from the local tier."""
    s3 = new_s3(auth_s3, counter.url)
    cfg = tier_config(s3, tmp_path / "local")
    as_identity(monkeypatch, *READER.credentials)
    sd = state(1)
    before = counter.stats["requests"]
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        raised = save_error(cfg, "step-2", sd)
    sent = counter.stats["requests"] - before
    err = find(raised, TierAccessDenied)
    assert err is not None, repr(raised)
    assert "access denied" in str(err) and f"s3://{s3.bucket}/ckpt/" in str(err)
    assert 1 <= sent <= DENIAL_BOUND, sent
    assert_no_secret(str(err), caplog.text)
    out = zeros_like(sd)
    dcp.load(
        out, checkpoint_id="step-2", storage_reader=TieredReader(tier_config(s3, tmp_path / "local")), no_dist=True
    )
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])


def test_tier_operations_with_a_read_only_key(auth_s3, counter, monkeypatch):
    """Every write primitive of the S3 tier is denied in one request each; reads work."""
    s3 = new_s3(auth_s3, counter.url)
    admin = s3servers.s3_client(auth_s3, credentials=ADMIN.credentials)
    admin.put_object(Bucket=s3.bucket, Key="ckpt/x/metadata.json", Body=b"hello")
    as_identity(monkeypatch, *READER.credentials)
    tier = S3Tier(s3)
    try:
        assert tier.get("x/metadata.json") == b"hello"
        assert [o.key for o in tier.list("")] == ["x/metadata.json"]
        big = bytes(6 * MiB)
        ops = {
            "put": lambda: tier.put("y/a", b"1"),
            "put if absent": lambda: tier.put("y/metadata.json", b"1", if_absent=True),
            "multipart": lambda: tier.open_sink("y/big", len(big)),
            "delete": lambda: tier.delete("x/metadata.json"),
            "delete prefix": lambda: tier.delete_prefix("x/"),
        }
        for name, op in ops.items():
            before = counter.stats["requests"]
            with pytest.raises(TierAccessDenied, match="access denied") as ei:
                op()
            assert f"s3://{s3.bucket}/ckpt/" in str(ei.value), name
            assert counter.stats["requests"] - before <= 2, (name, counter.stats["requests"] - before)
            assert_no_secret(str(ei.value))
        assert tier.get("x/metadata.json") == b"hello"
    finally:
        tier.close()


def test_read_only_key_loads(auth_s3, monkeypatch, tmp_path):
    """A checkpoint saved with the admin key loads with the read-only key (explicit id and
    ``latest``), and the CLI lists, finds and verifies it."""
    s3 = new_s3(auth_s3)
    cfg = tier_config(s3)
    sd = state(3)
    as_identity(monkeypatch, *ADMIN.credentials)
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id="step-3", storage_writer=w, no_dist=True)
    w.wait()
    env = as_identity(monkeypatch, *READER.credentials)
    for cid in ("step-3", "latest"):
        out = zeros_like(sd)
        dcp.load(out, checkpoint_id=cid, storage_reader=TieredReader(tier_config(s3)), no_dist=True)
        assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["step"] == 3
    conf = write_config(tmp_path / "tiers.toml", s3=s3)
    p = cli("latest", config=conf, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "step-3", p.stderr
    p = cli("verify", "step-3", config=conf, env=env)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr
    p = cli("list", config=conf, env=env)
    assert p.returncode == 0 and "step-3" in p.stdout, p.stderr


# -- wrong credentials ------------------------------------------------------------------------


@pytest.mark.parametrize("who", ["wrong secret", "unknown key"])
def test_wrong_credentials_are_a_clear_error(auth_s3, counter, monkeypatch, tmp_path, who):
    s3 = new_s3(auth_s3, counter.url)
    s3servers.s3_client(auth_s3, credentials=ADMIN.credentials).put_object(
        Bucket=s3.bucket, Key="ckpt/step-4/metadata.json", Body=b"{}"
    )
    key, code = (
        (ADMIN.access_key, "SignatureDoesNotMatch")
        if who == "wrong secret"
        else ("TIERCKPTNOSUCHKEY", "InvalidAccessKeyId")
    )
    env = as_identity(monkeypatch, key, WRONG_SECRET)
    tier = S3Tier(s3)
    try:
        for name, op in {
            "get": lambda: tier.get("step-4/metadata.json"),
            "list": lambda: list(tier.list("")),
            "put": lambda: tier.put("step-5/metadata.json", b"{}", if_absent=True),
        }.items():
            before = counter.stats["requests"]
            with pytest.raises(TierAccessDenied) as ei:
                op()
            msg = str(ei.value)
            assert "access denied" in msg and code in msg and f"s3://{s3.bucket}/ckpt/" in msg, msg
            assert counter.stats["requests"] - before == 1, name  # never retried
            assert_no_secret(msg)
        with pytest.raises(TierAccessDenied, match="access denied"):  # HEAD: a 403 without a body
            tier.exists("step-4/metadata.json")
    finally:
        tier.close()
    # the CLI: one line, exit status 2 (credentials), the code named, no secret
    conf = write_config(tmp_path / "tiers.toml", s3=s3)
    p = cli("verify", "step-4", config=conf, env=env)
    line = assert_one_line_error(p, 2, "access denied", code, s3.bucket)
    assert_no_secret(line, p.stdout)
    # an explicit id through the reader: the denial (DCP keeps only its text)
    with pytest.raises(BaseException) as ei:
        dcp.load(state(), checkpoint_id="step-4", storage_reader=TieredReader(tier_config(s3)), no_dist=True)
    text = str(find(ei.value, TierAccessDenied) or ei.value)
    assert "access denied" in text and code in text, text[:2000]
    assert_no_secret(text)


def test_no_credentials_at_all(monkeypatch, tmp_path):
    """No credentials anywhere: a clear TierAccessDenied (before any request), exit status 2
    from the CLI."""
    s3 = S3Config(
        bucket="nobody", prefix="ckpt", endpoint_url=f"http://127.0.0.1:{s3servers.free_port()}", max_attempts=1
    )
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    tier = S3Tier(s3)
    try:
        with pytest.raises(TierAccessDenied, match="no usable S3 credentials"):
            tier.get("a/metadata.json")
    finally:
        tier.close()
    conf = write_config(tmp_path / "tiers.toml", s3=s3)
    assert_one_line_error(
        cli("verify", "a", config=conf, env={"AWS_EC2_METADATA_DISABLED": "true"}), 2, "no usable S3 credentials"
    )


# -- secrets never printed --------------------------------------------------------------------


def test_endpoint_with_user_info_is_refused_without_echo(tmp_path):
    """Issue item 5: ``http://user:secret@host:port`` put the password into "Could not connect to
    the endpoint URL: ...". Now the configuration is refused, naming the key, not the secret."""
    secret = f"pw-{uuid.uuid4().hex}"
    conf = tmp_path / "tiers.toml"
    conf.write_text(f'[s3]\nbucket = "b"\nendpoint_url = "http://user:{secret}@127.0.0.1:9"\n')
    p = cli_proc("list", config=conf)
    line = assert_one_line_error(p, 2, "[s3] endpoint_url", str(conf), "user name or password")
    assert secret not in p.stderr + p.stdout and "127.0.0.1:9" not in line
    with pytest.raises(ConfigError) as ei:
        load_config(conf)
    assert secret not in str(ei.value)
    unchecked = S3Config(bucket="b", endpoint_url=f"https://key:{secret}@s3.example.com")
    with pytest.raises(ConfigError) as ei:  # also when built in Python
        unchecked.validate()
    assert secret not in str(ei.value) and "[s3] endpoint_url" in str(ei.value)
    assert secret not in repr(unchecked) and "s3.example.com" in repr(unchecked)


def test_urls_reaching_messages_are_redacted(monkeypatch, caplog):
    """Defence in depth: a client whose endpoint carries user information (built outside the
    configuration checks) fails to connect; botocore's message quotes the URL, ours does not
    carry the password."""
    import boto3
    from botocore.config import Config

    secret = f"pw-{uuid.uuid4().hex}"
    port = s3servers.free_port()  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    client = boto3.session.Session().client(
        "s3",
        endpoint_url=f"http://user:{secret}@127.0.0.1:{port}",
        region_name="us-east-1",
        config=Config(
            retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=1, s3={"addressing_style": "path"}
        ),
    )
    tier = S3Tier(
        S3Config(bucket="b", prefix="p", endpoint_url=f"http://127.0.0.1:{port}", max_attempts=1), client=client
    )
    with caplog.at_level(logging.DEBUG, logger="tierckpt"):
        for op in (
            lambda: tier.get("k"),
            lambda: list(tier.list("")),
            lambda: tier.put("k", b"1"),
            lambda: tier.exists("k"),
        ):
            with pytest.raises(TierError) as ei:
                op()
            assert secret not in str(ei.value) and f"127.0.0.1:{port}" in str(ei.value), str(ei.value)
            assert "***@" in str(ei.value) or "user" not in str(ei.value)
    assert secret not in caplog.text
    tier.close()

    from restore.errors import report

    err = RuntimeError(f'Could not connect to the endpoint URL: "http://user:{secret}@h:1/b?X-Amz-Signature={secret}"')
    buf = io.StringIO()
    monkeypatch.setenv("TIERCKPT_DEBUG", "1")
    with contextlib.redirect_stderr(buf):
        try:
            raise err
        except RuntimeError as e:
            assert report(e) == 3
    assert secret not in buf.getvalue() and "Traceback" in buf.getvalue() and "http://***@h:1/b?***" in buf.getvalue()


@pytest.mark.parametrize(
    "text, hidden, kept",
    [
        ("http://user:pw1@host:9000/b/k?list-type=2", ["pw1", "user"], ["http://***@host:9000/b/k?***"]),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=A&X-Amz-Credential=AKIA%2F1&X-Amz-Signature=abcdef",
            ["AKIA", "abcdef"],
            ["https://b.s3.amazonaws.com/k?***"],
        ),
        ("s3://bucket/ckpt/step@1/metadata.json: no such object", [], ["s3://bucket/ckpt/step@1/metadata.json"]),
        (
            "aws_secret_access_key=hunter2 password=pw2&x=1 {'SecretAccessKey': 'pw3'}",
            ["hunter2", "pw2", "pw3"],
            ["x=1"],
        ),
        ("http://u:p/w@host/x", ["u:p", "/w@"], ["***@host/x"]),
    ],
)
def test_redaction(text, hidden, kept):
    out = redact(text)
    for h in hidden:
        assert h not in out, out
    for k in kept:
        assert k in out, out


def test_redact_url_never_raises():
    for u in ["", "http://", "://@", "http://[::1", "a" * 10_000, "http://u:p@h:1?#", "\x00@\x00", None, 12]:
        assert isinstance(redact_url(u), str)  # type: ignore[arg-type]
        assert isinstance(redact(u), str)


# -- invalid endpoints and numbers: refused before contacting S3 ------------------------------

BAD_ENDPOINTS = [
    "not a url",
    "127.0.0.1:8333",
    "ftp://h",
    "http://",
    "http:///x",
    "http://h:99999",
    "http://h:0",
    "http://h:-1",
    "http://h:abc",
    "http://h:",
    "http:// h",
    "http://h x",
    "http://h\tx",
    "http://[::1",
    "http://[zz]:1",
    "http://h_1",
    "http://-h",
    "http://h/x?a=1",
    "http://h#f",
    "http://hé",
    "s3://bucket",
]


@pytest.mark.parametrize("url", BAD_ENDPOINTS)
def test_bad_endpoint_url_is_a_config_error(tmp_path, url):
    conf = tmp_path / "tiers.toml"
    conf.write_text('[s3]\nbucket = "b"\nendpoint_url = ' + repr(url).replace("'", '"') + "\n")
    p = cli("list", config=conf)
    line = assert_one_line_error(p, 2, "[s3] endpoint_url", str(conf))
    assert "internal error" not in line


def test_not_a_url_through_the_cli(tmp_path):
    """Issue item 6, as reported: ``internal error: ValueError`` (exit 3) before; now a config error."""
    conf = tmp_path / "tiers.toml"
    conf.write_text('[s3]\nbucket = "b"\nendpoint_url = "not a url"\n')
    assert_one_line_error(cli_proc("list", config=conf), 2, "[s3] endpoint_url", str(conf), "not a URL")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8333",
        "https://s3.us-east-1.amazonaws.com",
        "http://[::1]:9000",
        "http://minio.local:9000/",
        "HTTP://Example.COM.",
        "http://h:1/some/path",
    ],
)
def test_good_endpoint_urls(url):
    S3Config(bucket="b", endpoint_url=url).validate()


@pytest.mark.parametrize(
    "body, key",
    [
        ('[s3]\nbucket = "b"\nconnect_timeout = nan\n', "connect_timeout"),
        ('[s3]\nbucket = "b"\nread_timeout = inf\n', "read_timeout"),
        ('[s3]\nbucket = "b"\nread_timeout = 1e300\n', "read_timeout"),
        ('[s3]\nbucket = "b"\nmax_attempts = 100000\n', "max_attempts"),
        ('[s3]\nbucket = "b"\nregion = "not a region"\n', "region"),
        ('[s3]\nbucket = "Not A Bucket"\n', "bucket"),
        ('[s3]\nbucket = "b"\npart_size = "99999999999999999999999999999999999999999TiB"\n', "part_size"),
        ('[s3]\nbucket = "b"\nkeep = 99999999999999999999999999\n', "keep"),
        ('[job]\ncommit_timeout = nan\n[s3]\nbucket = "b"\n', "commit_timeout"),
        ('[host]\nbuffer_size = 1e400\n[s3]\nbucket = "b"\n', "buffer_size"),
    ],
)
def test_out_of_range_settings(tmp_path, body, key):
    conf = tmp_path / "tiers.toml"
    conf.write_text(body)
    assert_one_line_error(cli("list", config=conf), 2, key, str(conf))


@pytest.mark.parametrize("rank", ["-1", "-2", "x", "1.5", "99999999999999999999", "", "0x1"])
def test_fetch_rank_is_checked_before_contacting_s3(tmp_path, rank):
    """Issue item 6: ``fetch --rank -1`` went to S3 first. The endpoint here is a counting
    proxy: no connection reaches it."""
    with FaultProxy("http://127.0.0.1:9", error_rate=0.0, drop_rate=0.0) as proxy:
        conf = write_config(
            tmp_path / "tiers.toml",
            local=tmp_path / "local",
            s3=S3Config(bucket="b", prefix="ckpt", endpoint_url=proxy.url),
        )
        p = cli("fetch", "latest", "--rank", rank, config=conf)
        assert_one_line_error(p, 2, "--rank")
        assert proxy.stats["connections"] == 0


def test_fetch_rank_through_the_cli(tmp_path):
    with FaultProxy("http://127.0.0.1:9", error_rate=0.0, drop_rate=0.0) as proxy:
        conf = write_config(
            tmp_path / "tiers.toml",
            local=tmp_path / "local",
            s3=S3Config(bucket="b", prefix="ckpt", endpoint_url=proxy.url),
        )
        assert_one_line_error(cli_proc("fetch", "latest", "--rank", "-1", config=conf), 2, "--rank", "-1")
        assert proxy.stats["connections"] == 0
