"""tierckpt's log lines say who speaks (issue 33, item 5), checked on a real process's stderr.

Where the application configures no logging, ``[job] log_level = "INFO"`` shows INFO lines and
every line carries the logger name, the level and the rank; where it configures logging, before
or after importing tierckpt, each record is printed once, by the application's handler.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SAVE = """
import sys, logging, torch, torch.distributed.checkpoint as dcp
{before}
from tierckpt import TieredWriter
from tierckpt.config import config_from_dict
{after}
cfg = config_from_dict({{"local": {{"path": sys.argv[1]}}, "job": {{"log_level": "INFO"}}}})
w = TieredWriter(cfg)
dcp.save({{"w": torch.ones(4)}}, checkpoint_id="step-1", storage_writer=w, no_dist=True)
w.wait()
logging.getLogger("tierckpt.preempt").warning("SIGTERM: a warning")
"""


def _run(tmp_path: Path, before: str = "", after: str = "") -> list[str]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SAVE.format(before=before, after=after)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "5", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [ln for ln in out.stderr.splitlines() if "step-1 committed" in ln or "a warning" in ln]


def test_no_logging_configured_prints_name_level_rank_and_info(tmp_path: Path) -> None:
    lines = _run(tmp_path)
    assert len(lines) == 2, lines
    committed, warning = lines
    assert committed.startswith("tierckpt INFO [rank 5] checkpoint step-1 committed on local"), committed
    assert warning == "tierckpt.preempt WARNING [rank 5] SIGTERM: a warning", warning


def test_logging_configured_before_import_prints_once_in_its_format(tmp_path: Path) -> None:
    lines = _run(tmp_path, before='logging.basicConfig(format="APP %(name)s|%(message)s")')
    assert len(lines) == 2, lines
    assert lines[1] == "APP tierckpt.preempt|SIGTERM: a warning", lines


def test_logging_configured_after_import_prints_once_in_its_format(tmp_path: Path) -> None:
    lines = _run(tmp_path, after='logging.basicConfig(format="APP %(levelname)s %(message)s", level="INFO")')
    assert len(lines) == 2, lines
    assert all(ln.startswith("APP ") for ln in lines), lines


def test_handler_on_the_tierckpt_logger_prints_once(tmp_path: Path) -> None:
    after = (
        'h = logging.StreamHandler(sys.stderr); h.setFormatter(logging.Formatter("MINE %(message)s")); '
        'logging.getLogger("tierckpt").addHandler(h)'
    )
    lines = _run(tmp_path, after=after)
    assert len(lines) == 2, lines
    assert all(ln.startswith("MINE ") for ln in lines), lines
