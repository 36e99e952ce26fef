"""A stale tombstone never blocks a resume (issue 32, item 9).

A ``gc`` on another host crashes in the middle of deleting the newest checkpoint from the shared
S3 tier: it wrote its tombstone (``_leases/ID/tomb-*.json``) and died before deleting anything, so
the checkpoint stays committed there but cannot be loaded until the tombstone expires (10
minutes; its process cannot be checked from here). A job resuming on a fresh host (its local tier
empty, S3 a moto server on loopback) must not be stuck for those 10 minutes:

* ``tierckpt.latest()`` and ``tierckpt-restore latest`` skip it and name the previous checkpoint;
* loading it explicitly fails with :class:`~tierckpt.errors.CheckpointBeingDeleted`, a
  ``CorruptCheckpoint``, whose message says it "cannot be loaded" and why;
* the resume loop of docs/operations.md ("A bad newest checkpoint"), started from the stale
  name, resumes from the previous checkpoint.

Before the fix (b0e99ab) ``latest`` named the tombstoned checkpoint, the load raised a plain
``CheckpointNotFound`` ("... is being deleted ...: it cannot be load") that the loop re-raised.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierckpt
from tierckpt import CorruptCheckpoint, TieredReader, TieredWriter, load_config
from tierckpt.chain.engine import close_all
from tierckpt.errors import find_error

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# A gc on another host: it takes the tombstone of the newest checkpoint on S3 (the protocol of
# tierckpt.catalog.lease.guarded_delete, as retention and `tierckpt-restore gc` use it) and the
# process dies before its first deletion. Its host name is not this one, so its death cannot be
# seen from here: the tombstone stays live for TOMB_TTL.
CRASHING_GC = textwrap.dedent(
    """
    import os, socket, sys
    socket.gethostname = lambda: "gc-host-b"
    from tierckpt import load_config
    from tierckpt.catalog.lease import guarded_delete
    from tierckpt.tiers import make_s3
    s3 = make_s3(load_config(sys.argv[1]))
    def crash():
        print("CRASHING", flush=True)
        os._exit(9)  # killed (OOM, node lost) between its tombstone and its first deletion
    guarded_delete(s3, sys.argv[2], crash, reason="gc: keep 1")
    print("NOT CRASHED", flush=True)
    """
)


def write_config(path: Path, local: Path, s3) -> Path:  # type: ignore[no-untyped-def]
    path.write_text(
        "\n".join(
            [
                "[host]",
                'buffer_size = "8MiB"',
                'chunk_size = "1MiB"',
                "[local]",
                f'path = "{local}"',
                "fsync = false",
                "keep = 0",
                "[s3]",
                f'bucket = "{s3.bucket}"',
                f'prefix = "{s3.prefix}"',
                f'endpoint_url = "{s3.endpoint_url}"',
                'part_size = "5MiB"',
                "max_attempts = 3",
                "connect_timeout = 2.0",
                "read_timeout = 10.0",
                "keep = 0",
            ]
        )
        + "\n"
    )
    return path


def state(i: int) -> dict:
    return {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(i)), "step": i}


def restore_latest(config: Path) -> tuple[int, str, str]:
    """``tierckpt-restore --config CONFIG latest`` (the CLI's own ``main``, in this process)."""
    from restore.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--config", str(config), "latest"])
    return code, out.getvalue(), err.getvalue()


def test_a_crashed_gc_on_another_host_does_not_block_the_resume(tmp_path, moto_endpoint, s3cfg):
    s3 = s3cfg(moto_endpoint)
    first = load_config(write_config(tmp_path / "first.toml", tmp_path / "host-a", s3))
    w = TieredWriter(first)
    for i in (1, 2, 3):
        dcp.save(state(i), checkpoint_id=f"step-{i}", storage_writer=w, no_dist=True)
    w.wait()  # committed on the local tier and on S3
    close_all()

    # The job restarts on a fresh host: its local tier is empty, S3 holds everything.
    cfg_path = write_config(tmp_path / "resume.toml", tmp_path / "host-c", s3)
    cfg = load_config(cfg_path)
    assert tierckpt.latest(cfg) == "step-3"

    gc = subprocess.run(
        [sys.executable, "-c", CRASHING_GC, str(cfg_path), "step-3"], capture_output=True, text=True, timeout=120
    )
    assert gc.returncode == 9 and "CRASHING" in gc.stdout, gc.stdout + gc.stderr[-3000:]
    # step-3 is still committed on S3, under the tombstone the dead gc left
    listed = {c.id: c for c in tierckpt.list_checkpoints(cfg)}
    assert sorted(listed) == ["step-1", "step-2", "step-3"]

    # latest skips it, in the library and in the CLI
    assert tierckpt.latest(cfg) == "step-2"
    code, out, err = restore_latest(cfg_path)
    assert (code, out.strip()) == (0, "step-2"), err

    # loading it by name fails clearly, with an error the resume loop catches
    with pytest.raises(BaseException) as info:
        dcp.load(state(0), checkpoint_id="step-3", storage_reader=TieredReader(cfg), no_dist=True)
    bad = find_error(info.value, CorruptCheckpoint)
    assert isinstance(bad, tierckpt.CheckpointBeingDeleted), info.value
    msg = str(bad)
    assert "checkpoint step-3 cannot be loaded" in msg and "gc-host-b" in msg and "expires in" in msg, msg

    # the documented resume loop (docs/operations.md), from the name a job found before the gc
    # crashed, resumes from step-2; so does a plain "latest" load
    out_state = state(0)
    cid: str | None = "step-3"
    tried = []
    while True:
        assert cid is not None, f"nothing to resume from after {tried}"
        tried.append(cid)
        try:
            dcp.load(out_state, checkpoint_id=cid, storage_reader=TieredReader(cfg), no_dist=True)
            break
        except BaseException as e:
            if find_error(e, CorruptCheckpoint) is None:
                raise
            cid = tierckpt.latest(cfg, before=cid)
    assert tried == ["step-3", "step-2"]
    assert out_state["step"] == 2 and torch.equal(out_state["w"], state(2)["w"])

    fresh = state(0)
    dcp.load(fresh, checkpoint_id="latest", storage_reader=TieredReader(cfg), no_dist=True)
    assert fresh["step"] == 2

    # tierckpt.list_checkpoints says why step-3 is skipped, and until when
    listed = {c.id: c for c in tierckpt.list_checkpoints(cfg)}
    assert "gc: keep 1 by gc-host-b:" in listed["step-3"].deleting["s3"]
    assert "expires in" in listed["step-3"].deleting["s3"]
    assert listed["step-2"].deleting == {}
    close_all()
