"""Case ``exportkill``: SIGKILL of ``tierckpt-restore export --format hf`` at a random moment.

One checkpoint (~10 MiB over a dozen tensors, one local tier) is exported once as the reference
folder (``restore.export.export_hf``, 3 MB shards: several shards and an index). Each trial runs
the exporter as a real process (``python -m restore export ... --out DIR``) and SIGKILLs it at a
random moment between its start and the time one whole run took. Then:

* ``DIR`` either does not exist or is a complete export: the same file names as the reference and
  every file the same bytes (a folder that ``from_pretrained`` would open while a shard is short
  or missing is a failure);
* the next run (``--force``) exits 0 and leaves the reference's files, byte for byte;
* no hidden ``.DIR.partial-PID`` folder is left next to it after that run.

Needs the ``hf`` extra (safetensors, huggingface_hub); skipped without it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from chaoslib.core import CaseResult, toml_text
from chaoslib.env import ROOT, Env
from tierckpt import TieredWriter
from tierckpt.config import config_from_dict
from tierckpt.testing import bits

MiB = 1 << 20
SHARD = "3MB"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {f"layers.{i}.weight": bits((MiB // 4,), torch.float32, g) for i in range(8)}
    model["embed.weight"] = bits((512, 1024), torch.bfloat16, g)
    model["norm.weight"] = bits((1024,), torch.float32, g)
    return {"model": model, "step": 1}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def case_exportkill(env: Env, trials: int, seed: int) -> CaseResult:
    """See the module docstring."""
    res = CaseResult("exportkill")
    t0 = time.perf_counter()
    try:
        import huggingface_hub  # noqa: F401
        import safetensors  # noqa: F401
    except ImportError as e:
        res.skipped = f"needs the hf extra ({e})"
        return res
    from restore.export import export_hf

    d = env.fresh("exportkill")
    cdict = env.config(d, s3=False)
    cfg_path = d / "tiers.toml"
    cfg_path.write_text(toml_text(cdict))
    w = TieredWriter(config_from_dict(cdict))
    dcp.save(_state(seed), checkpoint_id="step-1", storage_writer=w, no_dist=True)
    w.wait()
    export_hf(
        cfg_path, "step-1", out=d / "ref", keys=["model."], strip_prefix="model.", max_shard_size=SHARD, progress=False
    )
    ref = _files(d / "ref")
    env_vars = dict(os.environ)
    env_vars["PYTHONPATH"] = str(ROOT) + os.pathsep + env_vars.get("PYTHONPATH", "")
    env_vars.pop("TIERCKPT_CONFIG", None)

    def cmd(out: Path) -> list[str]:
        return [
            sys.executable, "-m", "restore", "--config", str(cfg_path), "-q", "export", "step-1", "--format", "hf",
            "--out", str(out), "--keys", "model.", "--strip-prefix", "model.", "--max-shard-size", SHARD, "--force",
        ]  # fmt: skip

    t = time.perf_counter()
    p = subprocess.run(cmd(d / "timed"), env=env_vars, capture_output=True, text=True)
    full = time.perf_counter() - t
    if p.returncode != 0 or _files(d / "timed") != ref:
        res.fail("setup", f"a whole export run failed or differs (status {p.returncode}): {p.stderr[-500:]}")
        res.seconds = time.perf_counter() - t0
        return res
    for i in range(trials):
        rng = random.Random(f"{seed}-exportkill-{i}")
        out = d / f"out-{i}"
        res.trials += 1
        proc = subprocess.Popen(cmd(out), env=env_vars, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.0, full))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():
            got = _files(out)
            if got != ref:
                short = sorted(n for n in ref if got.get(n) != ref[n])
                res.lose(i, f"{out.name} exists after the kill but is not a complete export (differs: {short})")
                continue
            res.note("finished before the kill")
        else:
            res.note("killed before publishing")
        p = subprocess.run(cmd(out), env=env_vars, capture_output=True, text=True)
        if p.returncode != 0:
            res.fail(i, f"the rerun failed (status {p.returncode}): {p.stderr.strip()[-500:]}")
            continue
        if _files(out) != ref:
            res.lose(i, f"{out.name}: the rerun's files differ from the reference")
        left = [x.name for x in d.iterdir() if x.name.startswith(f".{out.name}.")]
        if left:
            res.fail(i, f"left behind after the rerun: {left}")
    res.seconds = time.perf_counter() - t0
    return res
