"""The many-rank simulator (tierckpt.testing.simulator) runs the load's own coordination code for
many simulated ranks: what a load costs per rank must not grow with the job."""

from __future__ import annotations

import pytest

from tierckpt.testing.simulator import build_job, simulate_load


@pytest.mark.parametrize("scenario", ["restart", "node_loss", "full_loss"])
def test_per_rank_cost_is_flat(scenario):
    small = simulate_load(build_job(16, 2), scenario)
    big = simulate_load(build_job(256, 2), scenario)
    if scenario == "full_loss":  # a load from S3: the metadata GET and the ranged GETs of its files
        assert big["s3_requests"] <= 3 * 256 + 8, big
        assert big["s3_requests"] / 256 <= small["s3_requests"] / 16 + 0.1, (small, big)
    else:  # the bucket is read once per job, not once per rank
        assert big["s3_requests"] == small["s3_requests"] <= 10, (small, big)
    # object-collective bytes grow linearly: the same per rank (within the longer rank names)
    assert big["collective_bytes"] / 256 <= 1.2 * small["collective_bytes"] / 16, (small, big)
    assert big["collective_rounds"] == small["collective_rounds"] == 2


def test_restart_reads_the_bucket_only_on_the_coordinator():
    out = simulate_load(build_job(32, 4), "restart")
    assert out["s3_by_op"] == {"ListObjectsV2": 1, "GetObject": 2}, out  # one listing, one header per checkpoint
    assert out["checkpoint"] == "step-000002"


def test_node_loss_takes_metadata_and_items_from_other_nodes():
    out = simulate_load(build_job(16, 2), "node_loss")
    assert out["checkpoint"] == "step-000002"
    assert out["p2p_bytes"] >= 2 * out["metadata_bytes"], out  # both ranks of the lost node got it point to point
