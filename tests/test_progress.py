"""Progress on long work, seen the way a person sees it: ``tierckpt-restore`` in a real pseudo-
terminal (``os.openpty``) shows tqdm bars (done so far, rate, time left) for ``verify``,
``fetch`` and ``consolidate``; through pipes, or with ``-q``, it prints none; a training process
that exits while its checkpoints are still being copied to S3 says so on stderr.

Real parts: a moto S3 server over HTTP on loopback (behind :class:`faultproxy.FaultProxy` for a
slow S3), checkpoints saved with ``dcp.save``, the CLI and the training script as subprocesses.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from faultproxy import FaultProxy
from test_restore_cli import REPO, sample_state, save, write_config

from tierckpt.config import S3Config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BAR = "%|"  # tqdm's bar: "verify step-1:  16%|███  | 32.0M/200M [00:00<00:02, 75.6MiB/s]"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("TIERCKPT_CONFIG", None)
    return e


def in_pty(args: list[str], size: tuple[int, int] | None = None, timeout: float = 120) -> tuple[int, str]:
    """Run ``args`` with stdin, stdout and stderr on a new pseudo-terminal (of ``size`` rows x
    columns; None leaves the size unset: 0 x 0, as ``docker exec -t`` and CI runners give);
    returns the exit status and everything written to the terminal."""
    master, slave = os.openpty()
    if size is not None:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[0], size[1], 0, 0))
    p = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=env(), close_fds=True)
    os.close(slave)
    out = b""
    try:
        while True:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every holder of the slave side closed it
                break
            if not data:
                break
            out += data
    finally:
        os.close(master)
    return p.wait(timeout=timeout), out.decode(errors="replace")


def restore(*args: str) -> list[str]:
    return [sys.executable, "-m", "restore", *args]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, moto_url) -> Path:
    """A 16 MiB checkpoint ``step-1`` committed on the local tier and on S3; returns the config."""
    from test_restore_cli import _s3

    tmp = tmp_path_factory.mktemp("progress")
    cfg = write_config(tmp / "tiers.toml", local=tmp / "local", s3=_s3(moto_url, "progress"))
    save(cfg, "step-1", sample_state(1, big=4096))
    return cfg


@pytest.fixture(scope="module")
def moto_url():
    import s3servers

    url, stop = s3servers.start_moto()
    yield url
    stop()


def test_bars_on_a_terminal(saved: Path, tmp_path: Path) -> None:
    # a terminal that reports no size: tqdm alone drew nothing there
    code, out = in_pty(restore("--config", str(saved), "verify", "latest"))
    assert code == 0, out
    assert "verify step-1" in out and BAR in out and "iB/s" in out, out
    assert "step-1 on local" in out and "OK" in out
    code, out = in_pty(
        restore("--config", str(saved), "consolidate", "latest", "--out", str(tmp_path / "m.pt")), (24, 120)
    )
    assert code == 0, out
    assert "consolidate step-1" in out and BAR in out, out
    # fetch: the local copy is gone (a replacement node), S3 has it
    local = Path(str(saved.read_text()).split('path = "')[1].split('"')[0])
    shutil.rmtree(local)
    code, out = in_pty(restore("--config", str(saved), "fetch", "latest"), (24, 120))
    assert code == 0, out
    assert "fetch step-1" in out and BAR in out and "iB/s" in out, out


def test_no_bars_through_pipes_or_with_quiet(saved: Path) -> None:
    p = subprocess.run(
        restore("--config", str(saved), "verify", "latest"), cwd=REPO, env=env(), capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    assert BAR not in p.stderr and BAR not in p.stdout and "\r" not in p.stderr
    code, out = in_pty(restore("--config", str(saved), "-q", "verify", "latest"), (24, 120))
    assert code == 0, out
    assert BAR not in out and "OK" in out


CHILD = """
import sys, torch, torch.distributed.checkpoint as dcp
from tierckpt import TieredWriter, load_config
w = TieredWriter(load_config(sys.argv[1]))
dcp.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, checkpoint_id="step-7", storage_writer=w, no_dist=True)
print("saved", flush=True)
"""


def test_exit_says_it_still_copies_to_s3(tmp_path: Path, moto_url: str) -> None:
    """A job that ends right after ``dcp.save`` while S3 answers slowly: the exit waits for the
    copy, and says so on stderr instead of seconds of silence."""
    from test_restore_cli import _s3

    s3 = _s3(moto_url, "exit")
    with FaultProxy(moto_url, error_rate=0.0, drop_rate=0.0, stall_rate=1.0, stall_s=0.1) as proxy:
        slow = S3Config(bucket=s3.bucket, prefix=s3.prefix, endpoint_url=proxy.url, part_size=s3.part_size)
        cfg = write_config(tmp_path / "tiers.toml", local=tmp_path / "local", s3=slow)
        p = subprocess.run(
            [sys.executable, "-c", CHILD, str(cfg)], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300
        )
    assert p.returncode == 0, p.stderr
    assert "saved" in p.stdout
    assert "at exit: 1 checkpoint(s) still copying to s3 (step-7)" in p.stderr, p.stderr


LOG_DURING_BAR = """
import logging
from restore.cli import _setup_logging
from restore.work import progress_bar
_setup_logging(False, False)
bar = progress_bar(100 << 20, "fetch step-1", True)
bar.update(10 << 20)
bar.refresh()
logging.getLogger("tierckpt.restore").warning("a range failed its CRC32C on node n0: read from s3")
bar.update(10 << 20)
bar.close()
"""


def test_a_warning_during_a_bar_gets_a_line_of_its_own() -> None:
    """The CLI's log handler writes above the bar (the bar is cleared, then drawn again)."""
    code, out = in_pty([sys.executable, "-c", LOG_DURING_BAR], (24, 100))
    assert code == 0, out
    msg = "tierckpt-restore: warning: a range failed its CRC32C on node n0: read from s3"
    before, _, after = out.partition(msg)
    assert after, out
    assert before.endswith(" \r"), out  # the bar's line was blanked before the message
    assert after.startswith("\r\n") and "fetch step-1" in after, out  # a line of its own, then the bar again
