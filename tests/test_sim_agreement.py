"""The coordinator's decision against an object store (tierckpt.load.agreement.decide), run on the
simulator's in-memory tiers: its lease on the chosen checkpoint reads the metadata after the
tombstone check, and a deletion under way or done since the listing makes it fall back."""

from __future__ import annotations

import json
import time

from tierckpt.catalog import lease as leases
from tierckpt.format.layout import metadata_key
from tierckpt.load import agreement
from tierckpt.testing.simulator import build_job


def _views(job):
    return [agreement.NodeView(f"/sim/n{job.node_of(r)}") for r in range(job.world)]  # every disk lost


def test_the_lease_reads_the_metadata_the_coordinator_shares():
    job = build_job(4, 2)
    d = agreement.decide(_views(job), [job.s3], "latest")
    try:
        v = d.verdict
        assert v.checkpoint_id == "step-000002" and v.leased == ("s3",), v
        assert d.metadata == ("s3", job.metadata["step-000002"])
        assert (v.md_rank, v.md_from, v.md_size) == (0, "s3", len(job.metadata["step-000002"]))
        assert agreement.expand(v.md_send) == [1, 2, 3]
        assert agreement.metadata_source(v, 0, False, True) == "lease"
        assert agreement.metadata_source(v, 1, False) == "peer"
        assert [k for k in job.s3.keys() if k.startswith("_leases/step-000002/read-")], job.s3.keys()
    finally:
        d.release()
    assert not [k for k in job.s3.keys() if k.startswith("_leases/")], job.s3.keys()
    assert "HeadObject" not in job.s3.by_op()


def test_a_deletion_under_way_makes_the_coordinator_fall_back():
    job = build_job(4, 2)
    tomb = "_leases/step-000002/tomb-0123456789abcdef.json"
    job.s3.seed(tomb, json.dumps({"owner": "elsewhere:1", "kind": "tomb", "expires": time.time() + 60}).encode())
    d = agreement.decide(_views(job), [job.s3], "latest")
    try:
        assert d.verdict.checkpoint_id == "step-000001", d.verdict
        assert d.metadata == ("s3", job.metadata["step-000001"])  # the one it fell back to, read after its lease
    finally:
        d.release()
    assert job.s3.keys().count(tomb) == 1  # the reader backed off, leaving the deletion alone
    assert not [k for k in job.s3.keys() if "/read-" in k], job.s3.keys()


def test_a_deletion_done_since_the_listing_makes_the_coordinator_fall_back():
    """A deletion that finished between the header reads and the lease (its tombstone gone): the
    lease's read of the metadata finds it missing, as the HEAD did."""
    job = build_job(4, 2)
    put = job.s3.put_volatile

    def deleted_first(key, data):
        if key.startswith("_leases/step-000002/read-"):
            for k in [k for k in job.s3.keys() if "step-000002/" in k and not k.startswith("_leases/")]:
                job.s3.delete(k)
        put(key, data)

    job.s3.put_volatile = deleted_first  # type: ignore[method-assign]
    d = agreement.decide(_views(job), [job.s3], "latest")
    try:
        assert d.verdict.checkpoint_id == "step-000001", d.verdict
        assert d.metadata == ("s3", job.metadata["step-000001"])
    finally:
        d.release()
    assert not [k for k in job.s3.keys() if k.startswith("_leases/")], job.s3.keys()


def test_a_metadata_replaced_since_the_listing_is_not_shared():
    """Same id committed again between the listing and the lease (another seq): the lease is
    given back and the coordinator falls back, rather than sharing bytes the job did not agree on."""
    job = build_job(4, 2)
    put = job.s3.put_volatile

    def recommitted_first(key, data):
        if key.startswith("_leases/step-000002/read-"):
            job.s3.seed(metadata_key("step-000002"), job.metadata["step-000001"].replace(b"000001", b"000002"))
        put(key, data)

    job.s3.put_volatile = recommitted_first  # type: ignore[method-assign]
    d = agreement.decide(_views(job), [job.s3], "latest")
    try:
        assert d.verdict.checkpoint_id == "step-000001", d.verdict
    finally:
        d.release()


def test_acquire_reading_the_metadata_refuses_a_deleted_checkpoint():
    job = build_job(2, 2)
    size = len(job.metadata["step-000001"])
    with leases.acquire(job.s3, "step-000001", read_metadata=size) as lease:
        assert lease.metadata == job.metadata["step-000001"]
    job.s3.delete(metadata_key("step-000001"))
    try:
        leases.acquire(job.s3, "step-000001", read_metadata=size)
    except leases.CheckpointNotFound as e:
        assert "not committed" in str(e)
    else:
        raise AssertionError("a lease on a deleted checkpoint")
    assert not [k for k in job.s3.keys() if k.startswith("_leases/")], job.s3.keys()
