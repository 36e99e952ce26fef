"""Promotion to S3 and loads from S3, end to end, against real S3 servers over HTTP on loopback.

* moto's threaded server (``moto_endpoint``) and SeaweedFS ``weed mini`` (``seaweed_endpoint``;
  skipped with the reason when the binary cannot run), never moto's in-process mock;
* :class:`faultproxy.FaultProxy` in front of moto for 500/503 errors, dropped connections and a
  full outage;
* multi-rank saves/loads in real processes over gloo (``tests/s3_scenarios.py``).

Every comparison is bit-exact (raw bytes). Nothing here asserts durations. What is on the server is
checked with a plain boto3 client talking to the server directly (never through the proxy).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from botocore.exceptions import ClientError
from faultproxy import FaultProxy
from s3_scenarios import compare, expected_state, placeholder, run_world
from s3servers import s3_client

from tierckpt import TierckptError, TieredReader, TieredWriter
from tierckpt.config import S3Config, config_from_dict
from tierckpt.format.layout import data_key, split_key
from tierckpt.testing import errors_in

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20
PREFIX = "ckpt"  # the s3cfg fixture's default prefix
SECRET = "tierckpt-TEST-SECRET-d41d8cd98f00b204e9800998ecf8427e"


# -- helpers ------------------------------------------------------------------------------------


def make_cfg(
    tmp_path: Path,
    s3: S3Config | None,
    *,
    local: bool = True,
    local_keep: int = 0,
    commit_timeout: float = 60.0,
    **s3_over: Any,
):
    """A TierConfig built the way a TOML file is (sizes as strings): small host pool, [local]
    without fsync under ``tmp_path/local``, ``[s3]`` from the fixture's config (+ overrides)."""
    d: dict[str, Any] = {
        "job": {"commit_timeout": commit_timeout},
        "host": {"buffer_size": "16MiB", "chunk_size": "4MiB"},
    }
    if local:
        d["local"] = {"path": str(tmp_path / "local"), "keep": local_keep, "fsync": False}
    if s3 is not None:
        s = dataclasses.asdict(s3)
        s["part_size"] = "5MiB"
        s.update(s3_over)
        d["s3"] = s
    return config_from_dict(d)


def rand_bytes(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def state(seed: int, big_mib: int = 12) -> dict:
    """~``big_mib`` MiB of random bits (NaN payloads, -0, subnormals) plus small items."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "big": rand_bytes(big_mib * MiB + 12, g).view(torch.float32),
            "bf16": rand_bytes(2 * 257 * 33, g).view(torch.bfloat16).reshape(257, 33),
            "i64": rand_bytes(8 * 100, g).view(torch.int64),
            "scalar": torch.tensor(seed + 0.25),
        },
        "meta": {"seed": seed, "name": f"run-{seed}"},
    }


def save(writer: TieredWriter, sd: dict, cid: str) -> None:
    dcp.save(sd, checkpoint_id=cid, storage_writer=writer, no_dist=True)


def load(cfg, expected: dict, cid: str = "latest") -> tuple[dict, TieredReader]:
    target = placeholder(expected)
    reader = TieredReader(cfg)
    dcp.load(target, checkpoint_id=cid, storage_reader=reader, no_dist=True)
    return target, reader


def assert_loads_exact(cfg, expected: dict, cid: str = "latest") -> TieredReader:
    got, reader = load(cfg, expected, cid)
    assert compare(expected, got) == [], f"{cid}: loaded state differs"
    return reader


def local_files(root: Path, cid: str) -> dict[str, Path]:
    """Tier key -> path of every file of checkpoint ``cid`` under a local tier root."""
    out = {}
    for p in root.rglob("*"):
        if p.is_file():
            key = p.relative_to(root).as_posix()
            sk = split_key(key)
            if sk is not None and sk[0] == cid:
                out[key] = p
    return out


def local_ids(root: Path) -> tuple[set[str], set[str]]:
    """(committed ids, every id with any file) on a local tier root."""
    every, done = set(), set()
    if root.is_dir():
        for p in root.rglob("*"):
            if p.is_file():
                sk = split_key(p.relative_to(root).as_posix())
                if sk is not None:
                    every.add(sk[0])
                    if sk[1] == "metadata.json":
                        done.add(sk[0])
    return done, every


def s3_objects(client, bucket: str, prefix: str = PREFIX) -> dict[str, dict]:
    """Tier key (relative to the prefix) -> ListObjectsV2 entry, straight from the server."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", ()):
            out[o["Key"][len(prefix) + 1 :]] = o
    return out


def s3_ids(client, bucket: str) -> tuple[set[str], set[str]]:
    """(committed ids, every id with any object) in the bucket, straight from the server."""
    every, done = set(), set()
    for key in s3_objects(client, bucket):
        sk = split_key(key)
        if sk is not None:
            every.add(sk[0])
            if sk[1] == "metadata.json":
                done.add(sk[0])
    return done, every


def s3_get(client, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=f"{PREFIX}/{key}")["Body"].read()


def s3_has(client, bucket: str, key: str) -> bool:
    try:
        client.head_object(Bucket=bucket, Key=f"{PREFIX}/{key}")
        return True
    except ClientError as e:
        if e.response["ResponseMetadata"]["HTTPStatusCode"] == 404:
            return False
        raise


def open_uploads(client, bucket: str) -> list[dict]:
    return client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) or []


def md_doc(raw: bytes) -> dict:
    head, _, body = raw.partition(b"\n")
    return json.loads(body)


def item_of(doc: dict, fqn: str) -> dict:
    for it in doc["items"]:
        if it["index"][0] == fqn:
            return it
    raise KeyError(fqn)


def flip_byte(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x5A
    return bytes(b)


def watch_s3_commits(writer: TieredWriter, client, bucket: str) -> dict[str, dict]:
    """Observe the engine's S3 tier: at the moment each ``ID/metadata.json`` is put, record
    whether it was absent and whether every data file it names was already complete on the server
    (checked with a direct client). The real put then runs unchanged."""
    tier = writer.engine.tier("s3")
    seen: dict[str, dict] = {}
    real_put = tier.put

    def put(key: str, data: bytes, *, if_absent: bool = False) -> None:
        sk = split_key(key)
        if sk is not None and sk[1] == "metadata.json":
            cid = sk[0]
            files = md_doc(bytes(data))["files"]
            complete = {}
            for f, size in files.items():
                try:
                    head = client.head_object(Bucket=bucket, Key=f"{PREFIX}/{data_key(cid, f)}")
                    complete[f] = head["ContentLength"] == size
                except ClientError:
                    complete[f] = False
            seen[cid] = {
                "absent_before": not s3_has(client, bucket, key),
                "data_complete": complete,
                "if_absent": if_absent,
            }
        real_put(key, data, if_absent=if_absent)

    tier.put = put  # type: ignore[method-assign]
    return seen


@pytest.fixture
def writers() -> Any:
    """Writers made by a test; their engines (threads) and S3 clients are closed afterwards."""
    made: list[TieredWriter] = []
    yield made
    for w in made:
        try:
            w.engine.close()
        except TierckptError:
            pass
        for t in w.engine.chain.built():
            if t.name == "s3":
                t.close()


def new_writer(cfg, writers: list) -> TieredWriter:
    w = TieredWriter(cfg)
    writers.append(w)
    return w


# -- 1 + 4: promotion end to end, then the node is lost -------------------------------------------


def check_promoted_exact(cfg, client, bucket: str, ids: list[str], events: dict | None) -> None:
    """Each id committed on both tiers, metadata.json on S3 last, S3 objects bit-exact vs local."""
    root = cfg.local.resolved_path()
    part_size = 5 * MiB
    for cid in ids:
        files = local_files(root, cid)
        assert f"{cid}/metadata.json" in files, f"{cid} not committed locally"
        on_s3 = {k: o for k, o in s3_objects(client, bucket).items() if (split_key(k) or ("",))[0] == cid}
        assert set(on_s3) == set(files), f"{cid}: S3 holds {sorted(on_s3)}, local {sorted(files)}"
        for key, path in files.items():
            assert s3_get(client, bucket, key) == path.read_bytes(), f"{cid}: s3 {key} differs from the local file"
            if key.endswith(".data"):
                size = path.stat().st_size
                assert size > part_size  # the state is large enough for a multipart upload
                nparts = -(-size // part_size)
                assert on_s3[key]["ETag"].strip('"').endswith(f"-{nparts}"), (key, on_s3[key]["ETag"], nparts)
        if events is not None:
            ev = events.get(cid)
            assert ev is not None, f"{cid}: metadata.json was never put on S3"
            assert ev["absent_before"] and ev["if_absent"], ev
            assert ev["data_complete"] and all(ev["data_complete"].values()), (
                f"{cid}: metadata.json before its data: {ev}"
            )


def core_roundtrip(endpoint: str, s3cfg: Callable[..., S3Config], tmp_path: Path, writers: list, n: int = 3) -> None:
    """Promotion (1) and node loss (4) on one server, with ``n`` checkpoints."""
    s3 = s3cfg(endpoint)
    client = s3_client(endpoint)
    cfg = make_cfg(tmp_path, s3)
    w = new_writer(cfg, writers)
    events = watch_s3_commits(w, client, s3.bucket)
    ids = [f"step-{i}" for i in range(1, n + 1)]
    for seed, cid in enumerate(ids, start=1):
        save(w, state(seed), cid)
    w.wait()

    check_promoted_exact(cfg, client, s3.bucket, ids, events)
    assert s3_ids(client, s3.bucket)[0] == set(ids)
    hist = {h.checkpoint_id: h for h in w.history}
    assert set(hist) == set(ids)
    for cid in ids:
        assert hist[cid].error is None
        assert hist[cid].promote_s is not None and hist[cid].commit_s is not None, hist[cid]
    assert w.stats is not None and w.stats.checkpoint_id == ids[-1] and w.stats.promote_s is not None
    assert open_uploads(client, s3.bucket) == []

    # 4. the node is lost: only S3 holds the checkpoints now
    shutil.rmtree(cfg.local.resolved_path())
    reader = assert_loads_exact(cfg, state(n), "latest")
    assert reader.resolved_id == ids[-1]
    assert reader.served and set(reader.served.values()) == {"s3"}, reader.served
    assert [f for f in reader.served if f.startswith("rank-00000-")], reader.served
    reader = assert_loads_exact(cfg, state(1), "step-1")
    assert set(reader.served.values()) == {"s3"}


def test_promotion_end_to_end_then_node_lost_moto(moto_endpoint, s3cfg, tmp_path, writers):
    core_roundtrip(moto_endpoint, s3cfg, tmp_path, writers)


def test_promotion_end_to_end_then_node_lost_seaweedfs(seaweed_endpoint, s3cfg, tmp_path, writers):
    core_roundtrip(seaweed_endpoint, s3cfg, tmp_path, writers, n=2)


# -- 2: flaky network -----------------------------------------------------------------------------


def test_promotion_through_faulty_proxy(moto_endpoint, s3cfg, tmp_path, writers):
    client = s3_client(moto_endpoint)
    with FaultProxy(moto_endpoint, error_rate=0.10, drop_rate=0.05, seed=7) as proxy:
        s3 = s3cfg(moto_endpoint, endpoint_url=proxy.url)
        cfg = make_cfg(tmp_path, s3)
        w = new_writer(cfg, writers)
        ids = ["step-1", "step-2"]
        for seed, cid in enumerate(ids, start=1):
            save(w, state(seed), cid)
        w.wait()
        check_promoted_exact(cfg, client, s3.bucket, ids, None)
        assert s3_ids(client, s3.bucket)[0] == set(ids)

        shutil.rmtree(cfg.local.resolved_path())  # load from S3 only, through the proxy
        reader = assert_loads_exact(cfg, state(2), "latest")
        assert reader.resolved_id == "step-2" and set(reader.served.values()) == {"s3"}
        assert proxy.stats["errors"] > 0 and proxy.stats["drops"] > 0, proxy.stats


# -- 3: full outage during promotion --------------------------------------------------------------


def test_outage_during_promotion(moto_endpoint, s3cfg, tmp_path, writers, caplog, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)  # read by the tier's client (built lazily)
    caplog.set_level(logging.DEBUG, logger="tierckpt")
    client = s3_client(moto_endpoint)  # the server itself, never through the proxy
    with FaultProxy(moto_endpoint, error_rate=0.0, drop_rate=0.0, seed=3) as proxy:
        s3 = s3cfg(moto_endpoint, endpoint_url=proxy.url)
        cfg = make_cfg(tmp_path, s3, commit_timeout=2.0, max_attempts=2, connect_timeout=1.0, read_timeout=5.0)
        root = cfg.local.resolved_path()
        w = new_writer(cfg, writers)

        # The outage starts right after the first part of step-1 reached the server, so that a
        # multipart upload with parts is left behind (its abort fails too).
        tier = w.engine.tier("s3")
        real_upload_part = tier._upload_part

        def upload_part_then_outage(*a, **kw):
            entry = real_upload_part(*a, **kw)
            proxy.outage = True
            return entry

        tier._upload_part = upload_part_then_outage  # type: ignore[method-assign]

        save(w, state(1), "step-1")
        with pytest.raises(TierckptError) as ei:
            w.wait()
        msg = str(ei.value)
        assert "step-1" in msg and "s3" in msg.lower(), msg
        tier._upload_part = real_upload_part  # type: ignore[method-assign]
        assert proxy.stats["outage"] > 0
        assert not s3_has(client, s3.bucket, "step-1/metadata.json")
        assert [u for u in open_uploads(client, s3.bucket) if "/step-1/" in u["Key"]], "expected a dangling upload"
        assert (root / "step-1" / "metadata.json").is_file()
        assert_loads_exact(cfg, state(1), "step-1")  # the local copy, while S3 is still down
        errors_seen = [ei.value]

        # training goes on: the next save commits locally (its promotion fails as well)
        save(w, state(2), "step-2")
        with pytest.raises(TierckptError) as ei2:
            w.wait()
        assert "step-2" in str(ei2.value), str(ei2.value)
        errors_seen.append(ei2.value)
        assert (root / "step-2" / "metadata.json").is_file()
        assert_loads_exact(cfg, state(2), "step-2")
        assert not s3_has(client, s3.bucket, "step-2/metadata.json")

        # the outage ends; after commit_timeout the leftover upload is stale, and the next
        # checkpoint's promotion (retention) aborts it; the two checkpoints that missed S3 are
        # promoted first (the backlog), so every committed checkpoint reaches S3
        proxy.outage = False
        time.sleep(cfg.job.commit_timeout + 0.5)
        save(w, state(3), "step-3")
        w.wait()
        assert s3_ids(client, s3.bucket)[0] == {"step-1", "step-2", "step-3"}
        check_promoted_exact(cfg, client, s3.bucket, ["step-1", "step-2", "step-3"], None)
        assert open_uploads(client, s3.bucket) == []
        assert w.history[-1].promote_s is not None and w.history[-1].error is None

    # no secret anywhere: log records, error messages (and their causes), local checkpoint files
    for rec in caplog.records:
        assert SECRET not in rec.getMessage() and SECRET not in str(rec.args), rec.getMessage()
    # the failure was logged at once, naming the checkpoint and S3: a WARNING (committed locally,
    # the S3 copy pending; issue 32), not an ERROR
    assert any(
        r.levelno == logging.WARNING
        and "checkpoint step-1 is committed on local" in r.getMessage()
        and "s3" in r.getMessage().lower()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    for top in errors_seen:
        for e in errors_in(top):
            assert SECRET not in str(e) and SECRET not in repr(e)
    for p in root.rglob("*"):
        if p.is_file():
            assert SECRET.encode() not in p.read_bytes(), p


def test_outage_right_after_s3_commit_does_not_fail_the_promotion(moto_endpoint, s3cfg, tmp_path, writers):
    """S3 goes down right after ``metadata.json`` was put: the checkpoint *is* committed on S3, so
    the retention pass that follows (best effort, like local retention) must not turn it into a
    failed promotion."""
    client = s3_client(moto_endpoint)
    with FaultProxy(moto_endpoint, error_rate=0.0, drop_rate=0.0, seed=11) as proxy:
        s3 = s3cfg(moto_endpoint, endpoint_url=proxy.url)
        cfg = make_cfg(tmp_path, s3, max_attempts=1, connect_timeout=1.0, read_timeout=5.0)
        w = new_writer(cfg, writers)
        tier = w.engine.tier("s3")
        real_put = tier.put

        def put_then_outage(key: str, data: bytes, *, if_absent: bool = False) -> None:
            real_put(key, data, if_absent=if_absent)
            if key.endswith("/metadata.json"):
                proxy.outage = True

        tier.put = put_then_outage  # type: ignore[method-assign]
        save(w, state(1, big_mib=0), "step-1")
        try:
            w.wait()
            err = None
        except TierckptError as e:
            err = e
        proxy.outage = False
        assert s3_ids(client, s3.bucket)[0] == {"step-1"}  # committed on S3 ...
        assert err is None, f"... yet wait() reported a failed promotion: {err}"
        assert w.history[-1].promote_s is not None


def test_latest_during_outage_resolves_from_local(moto_endpoint, s3cfg, tmp_path, writers):
    """While S3 is unreachable, ``latest`` still resolves to the local tier's newest commit."""
    client = s3_client(moto_endpoint)
    with FaultProxy(moto_endpoint, error_rate=0.0, drop_rate=0.0, seed=5) as proxy:
        s3 = s3cfg(moto_endpoint, endpoint_url=proxy.url)
        cfg = make_cfg(tmp_path, s3, max_attempts=1, connect_timeout=1.0, read_timeout=5.0)
        w = new_writer(cfg, writers)
        save(w, state(1, big_mib=1), "step-1")
        w.wait()
        assert s3_ids(client, s3.bucket)[0] == {"step-1"}
        proxy.outage = True
        reader = assert_loads_exact(cfg, state(1, big_mib=1), "latest")
        assert reader.resolved_id == "step-1" and set(reader.served.values()) == {"local"}


# -- 5: corruption on one tier, then on both ------------------------------------------------------


@pytest.fixture
def promoted_one(moto_endpoint, s3cfg, tmp_path, writers):
    """``step-1`` committed on both tiers; returns (cfg, client, bucket, data key, item of model.big)."""
    s3 = s3cfg(moto_endpoint)
    client = s3_client(moto_endpoint)
    cfg = make_cfg(tmp_path, s3)
    w = new_writer(cfg, writers)
    save(w, state(1), "step-1")
    w.wait()
    root = cfg.local.resolved_path()
    doc = md_doc((root / "step-1" / "metadata.json").read_bytes())
    it = item_of(doc, "model.big")
    key = data_key("step-1", it["file"])
    return cfg, client, s3.bucket, key, it


def test_corrupt_s3_object_load_served_from_local(promoted_one, caplog):
    cfg, client, bucket, key, it = promoted_one
    good = s3_get(client, bucket, key)
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/{key}", Body=flip_byte(good, it["pos"] + 4321))
    assert s3_get(client, bucket, key) != good
    caplog.set_level(logging.INFO, logger="tierckpt")
    reader = assert_loads_exact(cfg, state(1), "step-1")
    assert reader.served == {it["file"]: "local"}
    assert not [r for r in caplog.records if "served from" in r.getMessage()]  # no fallback was needed
    # and when the local copy is gone the corruption on S3 is detected, never loaded
    shutil.rmtree(cfg.local.resolved_path())
    with pytest.raises(BaseException) as ei:
        load(cfg, state(1), "step-1")
    text = " | ".join(str(e) for e in errors_in(ei.value))
    assert "ChecksumMismatch" in repr([type(e).__name__ for e in errors_in(ei.value)]) or "CRC32C" in text, text
    assert "model.big" in text and "step-1" in text, text


def test_corrupt_local_file_served_from_s3_with_warning(promoted_one, caplog):
    cfg, client, bucket, key, it = promoted_one
    path = cfg.local.resolved_path() / key
    path.write_bytes(flip_byte(path.read_bytes(), it["pos"] + 4321))
    caplog.set_level(logging.INFO, logger="tierckpt")
    assert_loads_exact(cfg, state(1), "step-1")
    warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "served from" in r.getMessage()]
    assert len(warns) == 1, [r.getMessage() for r in caplog.records]
    msg = warns[0]
    assert "'model.big'" in msg and "step-1" in msg and "local" in msg and "s3" in msg, msg
    assert msg.index("local") < msg.index("served from s3"), msg


def test_corrupt_on_both_tiers_raises_checksum_mismatch(promoted_one):
    cfg, client, bucket, key, it = promoted_one
    path = cfg.local.resolved_path() / key
    path.write_bytes(flip_byte(path.read_bytes(), it["pos"] + 4321))
    good = s3_get(client, bucket, key)
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/{key}", Body=flip_byte(good, it["pos"] + 99))
    with pytest.raises(BaseException) as ei:
        load(cfg, state(1), "step-1")
    errs = errors_in(ei.value)
    names = [type(e).__name__ for e in errs]
    text = " | ".join(str(e) for e in errs)
    assert "ChecksumMismatch" in names or "ChecksumMismatch" in text, (names, text)
    assert "'model.big'" in text and "step-1" in text and "CRC32C" in text, text


# -- 6: retention on both tiers -------------------------------------------------------------------


def test_retention_keep_and_keep_every(moto_endpoint, s3cfg, tmp_path, writers):
    """[s3] keep=2, keep_every=3 over step-1..step-7: after each S3 commit the committed
    checkpoints older than the newest 2 go unless their step is a multiple of 3 (and the newest
    is never deleted), so exactly step-3, step-6 and step-7 stay. [local] keep=1: only step-7."""
    s3 = s3cfg(moto_endpoint, keep=2, keep_every=3)
    client = s3_client(moto_endpoint)
    cfg = make_cfg(tmp_path, s3, local_keep=1)
    w = new_writer(cfg, writers)
    ids = [f"step-{i}" for i in range(1, 8)]
    for seed, cid in enumerate(ids, start=1):
        save(w, state(seed, big_mib=0), cid)
    w.wait()
    committed, every = s3_ids(client, s3.bucket)
    assert committed == {"step-3", "step-6", "step-7"}
    assert every == committed, f"objects of deleted checkpoints remain on S3: {sorted(every - committed)}"
    # The last local retention pass may still be running when wait() returns (see
    # test_local_retention_done_when_wait_returns); close() joins the promoter thread.
    w.engine.close()
    done, anything = local_ids(cfg.local.resolved_path())
    assert done == {"step-7"} and anything == {"step-7"}, (done, anything)
    assert open_uploads(client, s3.bucket) == []
    reader = assert_loads_exact(cfg, state(7, big_mib=0), "latest")
    assert reader.resolved_id == "step-7" and set(reader.served.values()) == {"local"}
    reader = assert_loads_exact(cfg, state(3, big_mib=0), "step-3")  # kept forever, only on S3
    assert set(reader.served.values()) == {"s3"}


def test_local_retention_done_when_wait_returns(moto_endpoint, s3cfg, tmp_path, writers):
    """[local] keep=1: once wait() returns, only the newest checkpoint is left locally.

    Made deterministic by delaying (never skipping) two steps: the upload of step-1, so that it
    is still pending promotion when step-2 commits locally, and the promoter's post-promotion
    local retention pass."""
    s3 = s3cfg(moto_endpoint)
    cfg = make_cfg(tmp_path, s3, local_keep=1)
    w = new_writer(cfg, writers)
    tier = w.engine.tier("s3")
    real_copy = tier.copy_from

    def slow_step1_copy(src: Any, key: str) -> int:
        if "/step-1/" in key:
            time.sleep(0.5)
        return real_copy(src, key)

    tier.copy_from = slow_step1_copy  # type: ignore[method-assign]
    real_retention = w.engine.retain_first_tier

    def slow_retention(job: Any) -> None:
        time.sleep(0.5)
        real_retention(job)

    w.engine.retain_first_tier = slow_retention  # type: ignore[method-assign]
    save(w, state(1, big_mib=0), "step-1")
    save(w, state(2, big_mib=0), "step-2")
    w.wait()
    done, anything = local_ids(cfg.local.resolved_path())
    assert done == {"step-2"} and anything == {"step-2"}, (done, anything)


# -- 7: direct mode -------------------------------------------------------------------------------


def test_direct_mode_streams_to_s3(moto_endpoint, s3cfg, tmp_path, writers):
    s3 = s3cfg(moto_endpoint)
    client = s3_client(moto_endpoint)
    cfg = make_cfg(tmp_path, s3, local=False)
    assert cfg.local is None
    w = new_writer(cfg, writers)
    for seed, cid in enumerate(["step-1", "step-2"], start=1):
        save(w, state(seed), cid)
    w.wait()
    assert not (tmp_path / "local").exists()
    objs = s3_objects(client, s3.bucket)
    assert s3_ids(client, s3.bucket)[0] == {"step-1", "step-2"}
    for cid in ("step-1", "step-2"):
        doc = md_doc(s3_get(client, s3.bucket, f"{cid}/metadata.json"))
        assert doc["checkpoint_id"] == cid
        for f, size in doc["files"].items():
            o = objs[data_key(cid, f)]
            assert o["Size"] == size and size > 5 * MiB
            assert o["ETag"].strip('"').endswith(f"-{-(-size // (5 * MiB))}"), o["ETag"]  # multipart
    assert [h.commit_s is not None and h.error is None for h in w.history] == [True, True]
    reader = assert_loads_exact(cfg, state(2), "latest")
    assert reader.resolved_id == "step-2" and set(reader.served.values()) == {"s3"}
    assert_loads_exact(cfg, state(1), "step-1")
    assert open_uploads(client, s3.bucket) == []


# -- 8: two ranks on two simulated nodes ----------------------------------------------------------


def test_multirank_promotion_node_lost_and_single_process_load(moto_endpoint, s3cfg, tmp_path):
    s3 = s3cfg(moto_endpoint)
    client = s3_client(moto_endpoint)
    world = 2
    conf = {
        "job": {"commit_timeout": 60},
        "host": {"buffer_size": "16MiB", "chunk_size": "4MiB"},
        "local": {"path": str(tmp_path / "nodes" / "{node}"), "keep": 0, "fsync": False},
        "s3": dataclasses.asdict(s3) | {"part_size": "5MiB"},
    }
    ids = ["step-1", "step-2"]
    res = run_world(
        world,
        "save_promote_lose_node_load",
        {"config": conf, "ids": ids, "lost_rank": 1},
        tmp_path / "w",
        node_of=lambda r: f"node{r}",
    )
    for r, out in enumerate(res):
        assert out["errors"] == [], (r, out["errors"])
        assert out["mismatches"] == [], (r, out)
        assert out["resolved"] == "step-2"
        assert len(out["promote_s"]) == 2 and all(p is not None for p in out["promote_s"]), out
        assert out["local_root"] == str(tmp_path / "nodes" / f"node{r}")
    # rank 0 read its own file from node0's local tier; rank 1, whose node was lost, read its own
    # file from S3. (DCP saves a replicated item such as "step" once, in one rank's file; a rank
    # that reads a file written on the other node gets it from S3 too.)
    served0 = {f[:10]: t for f, t in res[0]["served"].items()}
    served1 = {f[:10]: t for f, t in res[1]["served"].items()}
    assert served0["rank-00000"] == "local" and served0.get("rank-00001", "s3") == "s3", res[0]["served"]
    assert served1["rank-00001"] == "s3" and set(served1.values()) == {"s3"}, res[1]["served"]

    committed, every = s3_ids(client, s3.bucket)
    assert committed == set(ids) and every == set(ids)
    for cid in ids:
        doc = md_doc(s3_get(client, s3.bucket, f"{cid}/metadata.json"))
        assert doc["world_size"] == world and len(doc["files"]) == world
        for f in doc["files"]:
            assert s3_has(client, s3.bucket, data_key(cid, f)), (cid, f)
        node0 = local_files(tmp_path / "nodes" / "node0", cid)
        for key, path in node0.items():  # node0's copy (its metadata + rank 0's file) equals S3's
            assert s3_get(client, s3.bucket, key) == path.read_bytes(), key
    # node1 lost its local tier; rank 1's load from S3 filled it back ([local] fill_on_load):
    # step-2's metadata and rank 1's own file, byte-identical to S3's copies
    node1 = local_files(tmp_path / "nodes" / "node1", "step-2")
    assert sorted(k.rsplit("/", 1)[1][:10] for k in node1) == ["metadata.j", "rank-00001"], sorted(node1)
    for key, path in node1.items():
        assert s3_get(client, s3.bucket, key) == path.read_bytes(), key
    assert not local_files(tmp_path / "nodes" / "node1", "step-1")
    assert open_uploads(client, s3.bucket) == []

    # one process (no_dist), S3 only: the whole checkpoint, both ranks' files, bit-exact
    cfg1 = make_cfg(tmp_path, s3, local=False)
    for seed, cid in enumerate(ids, start=1):
        expected = expected_state(world, seed)
        reader = assert_loads_exact(cfg1, expected, cid if cid != "step-2" else "latest")
        assert reader.resolved_id == cid
        assert sorted(f[:10] for f in reader.served) == ["rank-00000", "rank-00001"]
        assert set(reader.served.values()) == {"s3"}


def corrupt_local_metadata(cfg, cid: str) -> None:
    md = cfg.local.resolved_path() / cid / "metadata.json"
    raw_md = md.read_bytes()
    md.write_bytes(flip_byte(raw_md, len(raw_md) - 10))  # in the JSON body: the header CRC fails


def test_corrupt_local_metadata_falls_back_to_s3(promoted_one, caplog):
    """A corrupted local metadata.json is detected (header CRC), logged, and the S3 copy is used."""
    cfg, client, bucket, key, it = promoted_one
    corrupt_local_metadata(cfg, "step-1")
    caplog.set_level(logging.INFO, logger="tierckpt")
    assert_loads_exact(cfg, state(1), "step-1")
    errs = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("metadata.json" in m and "CRC32C" in m and "next tier" in m for m in errs), errs


def test_corrupt_local_metadata_latest_falls_back_to_s3(promoted_one):
    cfg, client, bucket, key, it = promoted_one
    corrupt_local_metadata(cfg, "step-1")
    reader = assert_loads_exact(cfg, state(1), "latest")
    assert reader.resolved_id == "step-1"
