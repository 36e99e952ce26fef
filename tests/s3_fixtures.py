"""pytest fixtures for S3 tests, meant to be imported into ``tests/conftest.py``
(``from s3_fixtures import *``) or loaded with ``pytest_plugins = ["s3_fixtures"]``.

* ``moto_endpoint`` (session): moto's S3 server on loopback; its URL.
* ``seaweed_endpoint`` (session): ``weed mini`` on loopback; its URL. Skips the test, with the
  reason, when the SeaweedFS binary is missing or does not start.
* ``serve_seaweedfs(workdir, **kw)``: the body of such a fixture, for servers with other options.
* ``s3cfg`` (function): a factory ``s3cfg(endpoint_url, **overrides) -> S3Config`` that creates
  a fresh bucket and returns a validated config with test-friendly defaults (5 MiB parts, short
  timeouts, a ``ckpt`` prefix).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import s3servers  # tools/s3servers.py (conftest puts tools/ on sys.path)

from tierckpt.config import MiB, S3Config

__all__ = [
    "moto_endpoint",
    "seaweed_endpoint",
    "s3cfg",
    "S3CfgFactory",
]  # what conftest takes; serve_seaweedfs is imported by name

S3CfgFactory = Callable[..., S3Config]


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """URL of a moto S3 server running in this process for the whole session."""
    url, stop = s3servers.start_moto()
    try:
        yield url
    finally:
        stop()


def serve_seaweedfs(workdir: Path, **kw: Any) -> Iterator[str]:
    """Body of a SeaweedFS fixture: start ``weed mini`` in ``workdir`` (``kw``: passed to
    :func:`s3servers.start_seaweedfs`, e.g. ``identities``), yield its URL, stop it afterwards;
    skips the test, with the reason, when it is unavailable."""
    try:
        url, stop = s3servers.start_seaweedfs(workdir, **kw)
    except s3servers.ServerUnavailable as e:
        pytest.skip(f"SeaweedFS unavailable: {e}")
    try:
        yield url
    finally:
        stop()


@pytest.fixture(scope="session")
def seaweed_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a SeaweedFS ``weed mini`` server for the whole session (skips if unavailable)."""
    yield from serve_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))


@pytest.fixture
def s3cfg() -> S3CfgFactory:
    """Factory: ``s3cfg(endpoint_url, **overrides)`` -> an :class:`S3Config` on a new bucket.

    Defaults: prefix ``"ckpt"``, part_size 5 MiB (S3's minimum), concurrency 4, max_attempts 5,
    connect_timeout 2 s, read_timeout 10 s. The bucket is created on ``endpoint_url`` directly
    (pass ``endpoint_url=...`` in overrides to point the config elsewhere, e.g. at a proxy).
    """

    def make(endpoint_url: str, /, **overrides: Any) -> S3Config:
        bucket = f"tierckpt-{uuid.uuid4().hex[:12]}"
        s3servers.make_bucket(endpoint_url, bucket)
        fields: dict[str, Any] = {
            "bucket": bucket,
            "prefix": "ckpt",
            "endpoint_url": endpoint_url,
            "part_size": 5 * MiB,
            "concurrency": 4,
            "max_attempts": 5,
            "connect_timeout": 2.0,
            "read_timeout": 10.0,
        }
        fields.update(overrides)
        cfg = S3Config(**fields)
        cfg.validate()
        return cfg

    return make
