"""The background export worker (:mod:`tierckpt.chain.exporter`): ``python -m restore.exportworker``.

Reads ``{"config": {...}, "checkpoint_id": ID}`` (JSON) on standard input, lowers its priority
(``nice`` 19, the ``SCHED_IDLE`` CPU class on Linux, the idle I/O class through the ``ionice``
command when present, one torch thread: :func:`_lower_priority`), and
exports the checkpoint as ``[export]`` says (:func:`restore.export.export_hf`; to a local
directory or an ``s3://`` prefix). A folder (or prefix) already exported under that path is left
as it is. Exit status 0 when the folder is there (its figures,
:meth:`restore.export.ExportResult.to_json`, as one JSON line on standard output), 1 with the
error on standard error otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from tierckpt.config import node_name
from tierckpt.config.sections import config_from_dict


def _lower_priority() -> None:
    """Yield to training: ``nice`` 19, then Linux's ``SCHED_IDLE`` class (CPU only when no other
    task wants it; a no-op where the call is missing or refused), the idle I/O class (``ionice -c 3``
    where the command exists), and one torch thread (the export's CPU work is per tensor: a cast, an
    adapter; reading and writing are I/O threads)."""
    try:
        os.nice(19 - os.nice(0))
    except OSError:
        pass
    setsched = getattr(os, "sched_setscheduler", None)
    if setsched is not None and hasattr(os, "SCHED_IDLE"):
        try:
            setsched(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass
    ionice = shutil.which("ionice")
    if ionice:
        subprocess.run([ionice, "-c", "3", "-p", str(os.getpid())], capture_output=True, check=False)
    import torch

    torch.set_num_threads(1)


def main() -> int:
    _lower_priority()
    try:
        doc = json.loads(sys.stdin.buffer.read())
        cfg = config_from_dict(doc["config"], source="[export] worker")
        cid = str(doc["checkpoint_id"])
        from .export import export_hf, is_export

        ex = cfg.export
        out = ex.path.replace("{checkpoint_id}", cid).replace("{node}", node_name())
        if "{checkpoint_id}" in ex.path and is_export(out, cfg):
            print(json.dumps({"checkpoint_id": cid, "out": out, "already": True}))
            return 0  # exported already (a rerun); a fixed path is replaced by each newer export
        res = export_hf(
            cfg,
            cid,
            out=out,
            keys=ex.keys or None,
            strip_prefix=ex.strip_prefix,
            dtype=ex.dtype,
            files=list(ex.files),
            adapter=ex.adapter or None,
            max_shard_size=ex.max_shard_size,
            overwrite=True,  # a non-empty folder without an index is an older failed attempt
            progress=False,
        )
        print(json.dumps(res.to_json()))  # the figures, for the trainer's telemetry
    except Exception as e:  # noqa: BLE001 - the parent reports it as a warning
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
