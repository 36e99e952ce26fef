"""docs/operations.md, "A day of operations", run as written (issue 33).

Every fenced ``bash`` block of that section (the section after the ``<!-- ops-day -->`` marker)
runs in ``bash`` in a directory holding the operator's ``tiers.toml``, with ``tierckpt-restore``
being this checkout's CLI (``python -m restore``), and the ``python`` blocks run in a fresh
interpreter there; each is checked for its exit status and a key line of its output.

The night the section starts from is real: a 2-rank gloo job, ranks on nodes ``0`` and ``1``
(``GROUP_RANK``, as torchrun sets it; ``[local] path = ".../{node}"``), saves ``step-1`` ..
``step-3`` while S3 (a moto server over HTTP, behind :class:`faultproxy.FaultProxy`) is down
(every connection reset), and is SIGKILLed; restarted, it saves ``step-4`` and ``step-5``, S3
still down. In the day S3 comes back (the proxy forwards again), node 1's disk is replaced (its
directory emptied), and the run ends.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from faultproxy import FaultProxy

from tierckpt.testing.launch import launch_ranks

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "ops_day_job.py"
NODE_VARS = ("TIERCKPT_NODE", "GROUP_RANK", "NODE_RANK", "TIERCKPT_CONFIG")


def ops_day_blocks() -> list[tuple[str, str]]:
    """The fenced blocks of the "A day of operations" section, in order: (language, text)."""
    text = (REPO / "docs" / "operations.md").read_text()
    start = text.index("<!-- ops-day -->")
    end = text.find("\n## ", text.index("\n## ", start) + 1)
    section = text[start : end if end != -1 else len(text)]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(bash|python)\n(.*?)```", section, re.S)]


def _toml(conf: dict) -> str:
    lines = []
    for section, values in conf.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def _job(conf: dict, steps: list[int], kill: bool, work: Path) -> list[int | None]:
    """The 2-rank job on nodes 0 and 1; its exit codes."""
    clean = {k: v for k, v in os.environ.items() if k not in NODE_VARS}
    saved_env = dict(os.environ)
    os.environ.clear()
    os.environ.update(clean)
    try:
        args = json.dumps({"config": conf, "steps": steps, "kill": kill})
        codes, logs = launch_ranks(
            2,
            lambda r: [sys.executable, str(JOB), "save_steps", args, str(work / f"result{r}.json")],
            work,
            timeout=120,
            env_of=lambda r: {"GROUP_RANK": str(r), "PYTHONWARNINGS": "ignore"},
        )
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    assert codes == ([-signal.SIGKILL] * 2 if kill else [0, 0]), logs
    return codes


@pytest.fixture(scope="module")
def night(tmp_path_factory: pytest.TempPathFactory, moto_endpoint: str):
    """The operator's directory (``tiers.toml``), the node directories' parent and the S3 proxy
    after the night described in the module docstring."""
    import s3servers

    tmp = tmp_path_factory.mktemp("opsday")
    bucket = "opsday-" + os.urandom(4).hex()
    s3servers.make_bucket(moto_endpoint, bucket)
    with FaultProxy(moto_endpoint, error_rate=0, drop_rate=0) as proxy:
        proxy.outage_mode = "reset"
        proxy.outage = True
        base = tmp / "ckpt"
        conf = {
            "host": {"buffer_size": "8MiB", "chunk_size": "1MiB"},
            "local": {"path": f"{base}/{{node}}", "fsync": False},
            "s3": {
                "bucket": bucket,
                "prefix": "ckpt",
                "endpoint_url": proxy.url,
                "part_size": "5MiB",
                "max_attempts": 1,
                "connect_timeout": 2.0,
                "read_timeout": 10.0,
            },
        }
        _job(conf, [1, 2, 3], True, tmp / "run1")
        _job(conf, [4, 5], False, tmp / "run2")
        ops = tmp / "ops"
        ops.mkdir()
        (ops / "tiers.toml").write_text(_toml(conf))
        yield {"dir": ops, "base": base, "proxy": proxy}
