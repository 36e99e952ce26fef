"""Worker side of tests/test_async_modes.py: every DCP async mode on real gloo ranks.

Each scenario trains a tiny model (SGD, the writer's pre-step hook attached), saves with
``dcp.async_save`` in one mode, and right after a save's future completes loads the checkpoint
into a fresh state dict (no ``writer.wait()`` in between: the future alone must mean committed
in process mode; thread mode calls it) and compares it bit for bit with the state at save time.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse  # noqa: E402

from tierckpt import TieredReader, TieredWriter  # noqa: E402
from tierckpt.catalog.listing import is_committed  # noqa: E402
from tierckpt.config import config_from_dict  # noqa: E402
from tierckpt.testing.bitexact import compare  # noqa: E402
from tierckpt.testing.launch import serve  # noqa: E402
from tierckpt.testing.state import clone_state, placeholder  # noqa: E402


def _upload(resp: Future | AsyncSaveResponse) -> Future:
    return resp.upload_completion if isinstance(resp, AsyncSaveResponse) else resp


def modes(args: dict, rank: int, world: int) -> dict:
    """``args``: config, mode ("thread" | "process"), stager (bool), saves, prefix."""
    cfg = config_from_dict(args["config"])
    ctype = AsyncCheckpointerType.PROCESS if args["mode"] == "process" else AsyncCheckpointerType.THREAD
    torch.manual_seed(1234)  # every rank holds the same (replicated) state
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    writer = TieredWriter(cfg)
    writer.attach(opt)
    pg = dist.new_group(backend="gloo")
    stager = DefaultStager(StagingOptions(False, False, True, False)) if args["stager"] else None
    errors: list[str] = []
    shapes: list[str] = []
    for i in range(args["saves"]):
        model(torch.randn(4, 16)).pow(2).sum().backward()
        sd = {"model": model.state_dict(), "step": i}
        expected = clone_state(sd)
        cid = f"{args['prefix']}-{i:03d}"
        resp = dcp.async_save(
            sd,
            checkpoint_id=cid,
            storage_writer=writer,
            process_group=pg,
            async_checkpointer_type=ctype,
            async_stager=stager,
        )
        shapes.append(type(resp).__name__)
        if isinstance(resp, AsyncSaveResponse):
            resp.staging_completion.result(timeout=120)  # a foreign stager's copy must be done before the step
        opt.step()  # the writer's hook waits for the capture (or, in process mode, the copy)
        opt.zero_grad()
        _upload(resp).result(timeout=300)
        if args["mode"] == "thread":
            writer.wait()  # in this process the future means captured; commit is wait()'s
        local = writer.engine.first_tier
        if not is_committed(local, cid):
            errors.append(f"{cid}: future done but not committed on {local.url}")
        got = placeholder(expected)
        dcp.load(got, checkpoint_id=cid, storage_reader=TieredReader(cfg))
        bad = compare(expected, got)
        if bad:
            errors.append(f"{cid}: differs at {bad[:5]}")
    if args["mode"] == "process":  # a failing save in the checkpoint process fails its future, loudly
        sd = {"model": model.state_dict(), "step": -1}
        resp = dcp.async_save(
            sd,
            checkpoint_id=f"{args['prefix']}-000",
            storage_writer=writer,
            process_group=pg,
            async_checkpointer_type=ctype,
            async_stager=stager,
        )
        try:
            _upload(resp).result(timeout=300)
            errors.append("saving an id already committed succeeded")
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if "already committed" not in str(e):
                errors.append(f"unexpected error: {e!r}"[:500])
    writer.close()
    writer.close()  # idempotent
    if stager is not None:
        stager.close()
    return {"errors": errors, "shapes": shapes}


if __name__ == "__main__":
    import faulthandler
    import os

    if os.environ.get("TIERCKPT_TEST_DUMP_AFTER"):
        faulthandler.dump_traceback_later(float(os.environ["TIERCKPT_TEST_DUMP_AFTER"]), exit=True)
    serve({"modes": modes}, report_errors=True)
