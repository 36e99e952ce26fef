"""The many-rank simulator (tierckpt.testing.simulator) runs the load's own coordination code for
many simulated ranks: what a load costs per rank must not grow with the job."""

from __future__ import annotations

import pytest

from tierckpt.testing.simulator import build_job, simulate_load


@pytest.mark.parametrize("scenario", ["restart", "node_loss", "full_loss"])
def test_per_rank_cost_is_flat(scenario):
    # A load from S3 of more than 33 ranks: each rank's metadata GET and the ranged GETs of its
    # files (up to 33, the coordinator sends the metadata point to point: cheaper still)
    n = 64 if scenario == "full_loss" else 16
    small = simulate_load(build_job(n, 2), scenario)
    big = simulate_load(build_job(256, 2), scenario)
    if scenario == "full_loss":
        assert big["s3_requests"] <= 2 * 256 + 6, big
        assert big["s3_requests"] / 256 <= small["s3_requests"] / n + 0.1, (small, big)
    else:  # the bucket is read once per job (and by the ranks of the lost node), not once per rank
        assert big["s3_requests"] == small["s3_requests"] <= (10 if scenario == "restart" else 12), (small, big)
    # object-collective bytes grow linearly: the same per rank (within the longer rank names)
    assert big["collective_bytes"] / 256 <= 1.2 * small["collective_bytes"] / n, (small, big)
    assert big["collective_rounds"] == small["collective_rounds"] == 2


def test_restart_reads_the_bucket_only_on_the_coordinator():
    out = simulate_load(build_job(32, 4), "restart")
    assert out["s3_by_op"] == {"ListObjectsV2": 1, "GetObject": 2}, out  # one listing, one header per checkpoint
    assert out["checkpoint"] == "step-000002"


def test_full_loss_of_a_small_job_reads_the_metadata_once():
    """Every disk lost, 4 ranks: the coordinator's lease reads the metadata (a GET where a HEAD
    proved no more) and sends it to the 3 other ranks; each rank reads its own file: 11 requests,
    under 3 per rank (issue 21), and no HEAD."""
    out = simulate_load(build_job(4, 2), "full_loss")
    assert out["s3_by_op"] == {"ListObjectsV2": 2, "GetObject": 7, "PutObject": 1, "DeleteObject": 1}, out
    assert out["s3_requests"] <= 3 * 4, out
    assert out["p2p_bytes"] >= 3 * out["metadata_bytes"], out  # S3's own copy, from the coordinator
    big = simulate_load(build_job(64, 2), "full_loss")  # more than 32 lack it: each reads it from S3
    assert big["s3_by_op"]["GetObject"] == 2 + 1 + 63 + 64, big  # headers, the lease's read, 63 others, 64 files


def test_node_loss_takes_metadata_and_items_from_other_nodes():
    out = simulate_load(build_job(16, 2), "node_loss")
    assert out["checkpoint"] == "step-000002"
    assert out["p2p_bytes"] >= 2 * out["metadata_bytes"], out  # both ranks of the lost node got it point to point


@pytest.mark.timeout(900)  # 4 launches of 4 ranks: about a minute on 2 idle cores
def test_simulator_counts_equal_a_real_runs(moto_endpoint, s3cfg, tmp_path):
    """The simulator, given the files a real 4-rank job wrote (2 per node, {node} paths + S3 on
    moto), counts the same S3 requests, by operation, as the real processes did in each load."""
    import dataclasses
    import shutil

    import boto3

    from tierckpt.testing.scale import run_scale
    from tierckpt.testing.simulator import build_job_from

    cfg = s3cfg(moto_endpoint)
    snap: dict = {}

    def after_saves(workdir):
        shutil.copytree(workdir / "local", tmp_path / "snap")
        client = boto3.client(
            "s3",
            endpoint_url=moto_endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )
        root = cfg.prefix.rstrip("/") + "/" if cfg.prefix else ""
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=cfg.bucket, Prefix=root):
            for o in page.get("Contents", ()):
                if "/_leases/" not in "/" + o["Key"]:
                    snap[o["Key"][len(root) :]] = client.get_object(Bucket=cfg.bucket, Key=o["Key"])["Body"].read()

    real = run_scale(
        4,
        dataclasses.asdict(cfg),
        tmp_path / "run",
        ranks_per_node=2,
        timeout=600,
        phases=("restart", "node_loss", "full_loss"),
        after_saves=after_saves,
    )
    for phase in ("restart", "node_loss", "full_loss"):
        job = build_job_from(tmp_path / "snap", snap, 4, 2)
        sim = simulate_load(job, phase, wants=lambda r: (f"r{r}", "shared", "step"))
        got, want = dict(sim["s3_by_op"]), dict(real["phases"][phase]["s3_by_op"])
        # A real run may send up to one GET more per rank, depending on timing (a lease read, a
        # retried range, a fill reading the metadata before the peer's copy arrived); every other
        # operation is the same, and the simulator never counts more than the real run.
        sim_get, real_get = got.pop("GetObject", 0), want.pop("GetObject", 0)
        assert got == want and sim_get <= real_get <= sim_get + 4, (phase, sim, real["phases"][phase])


def test_simulator_counts_equal_the_recorded_real_runs_up_to_16_ranks():
    """The real runs of ``python tools/bench.py --only scale --scale-ranks 4,8,16`` (16 processes
    at most, moto; recorded in docs/data/scale.json): the simulator, given a job of the same shape,
    counts the same S3 requests, operation by operation, in every load, at every recorded N."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).resolve().parent.parent / "docs/data/scale.json").read_text())
    real = {r["world"]: r for r in data["sections"]["scale"]["results"] if r["source"] == "real"}
    assert 16 in real, sorted(real)
    for n, run in sorted(real.items()):
        for phase in ("restart", "node_loss", "full_loss"):
            sim = dict(simulate_load(build_job(n, run["ranks_per_node"]), phase)["s3_by_op"])
            assert sim == dict(run["phases"][phase]["s3_by_op"]), (n, phase, sim, run["phases"][phase]["s3_by_op"])
