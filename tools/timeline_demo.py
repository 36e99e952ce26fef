"""A real job's checkpoint timeline, drawn by ``tierckpt-restore timeline`` (docs/img/timeline.png).

    python tools/timeline_demo.py [--out docs/img/timeline.png] [--steps 16] [--ckpt-every 4] [--last 3]

Two simulated nodes (n0, n1; one rank each, gloo) train ``tools/train_gpt.py``'s small GPT on CPU
with a checkpoint every ``--ckpt-every`` steps through host memory -> local disk (``{node}``) ->
a peer copy on the other node -> S3 (moto on loopback). Then, as an operator on node n0 would:

    tierckpt-restore --config tiers.toml timeline --last 3 --out timeline.png
    tierckpt-restore --config tiers.toml advise --mtbf 8h

Everything lives in a temporary directory, removed at the end; only the picture stays.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import s3servers  # noqa: E402

from tierckpt.testing import launch_ranks  # noqa: E402

BUCKET = "tierckpt-timeline"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "timeline.png"))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--ckpt-every", type=int, default=4)
    ap.add_argument("--last", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=256)
    a = ap.parse_args(argv)
    url, stop = s3servers.start_moto()
    try:
        s3servers.make_bucket(url, BUCKET)
        with tempfile.TemporaryDirectory(prefix="tierckpt-timeline-") as tmp:
            work = Path(tmp)
            cfg = work / "tiers.toml"
            cfg.write_text(
                f'[host]\nbuffer_size = "64MiB"\nchunk_size = "4MiB"\n'
                f'[local]\npath = "{work}/{{node}}"\nkeep = 2\nflush_threads = 2\n'
                f"[peer]\nreplicas = 1\n"
                f'[s3]\nbucket = "{BUCKET}"\nendpoint_url = "{url}"\npart_size = "5MiB"\nconcurrency = 4\n'
            )

            def argv_of(r: int) -> list[str]:
                return [
                    sys.executable,
                    str(HERE / "train_gpt.py"),
                    "--config",
                    str(cfg),
                    "--steps",
                    str(a.steps),
                    "--ckpt-every",
                    str(a.ckpt_every),
                    "--d-model",
                    str(a.d_model),
                ]

            codes, logs = launch_ranks(
                2, argv_of, work / "run", timeout=900, env_of=lambda r: {"TIERCKPT_NODE": f"n{r}"}
            )
            if any(c != 0 for c in codes):
                raise SystemExit(f"training failed: exit codes {codes}\n{logs[0][-3000:]}\n{logs[1][-3000:]}")
            from restore.cli import main as restore

            os.environ["TIERCKPT_NODE"] = "n0"  # the operator's shell on node n0 (n1's directory is readable)
            rc = restore(["--config", str(cfg), "timeline", "--last", str(a.last), "--out", a.out])
            rc = rc or restore(["--config", str(cfg), "advise", "--mtbf", "8h"])
            return rc
    finally:
        stop()


if __name__ == "__main__":
    sys.exit(main())
