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
    start = text.index("<!-- ops-day")
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
            "local": {"path": f"{base}/{{node}}", "fsync": False, "keep": 10},
            "peer": {"replicas": 1},
            "s3": {
                "bucket": bucket,
                "prefix": "ckpt",
                "keep": 10,
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


def _run(block: tuple[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """One block as the operator runs it: ``bash`` (every command must succeed: ``set -e``, a
    command allowed to fail says so with ``||``) with ``tierckpt-restore`` being ``python -m
    restore`` of this checkout, or a fresh ``python``; no torchrun variables, no
    ``TIERCKPT_CONFIG``."""
    lang, code = block
    env = {k: v for k, v in os.environ.items() if k not in NODE_VARS}
    env.update(PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", PY=sys.executable, COLUMNS="200")
    if lang == "python":
        cmd = [sys.executable, "-c", code]
    else:
        prelude = 'set -e -o pipefail\ntierckpt-restore() { "$PY" -m restore "$@"; }\n'
        cmd = ["bash", "-c", prelude + code]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _rows(out: str) -> dict[str, list[str]]:
    """The rows of a ``list`` (or ``timeline``) table, by checkpoint id."""
    return {ln.split()[0]: ln.split() for ln in out.splitlines() if re.match(r"step-\d+ +\d+ ", ln)}


def _check(block: str, r: subprocess.CompletedProcess, base: Path, ops: Path) -> str:
    """Assert what ``block`` must have done (its exit status and key lines); return which check ran."""
    out, err = r.stdout, r.stderr
    assert r.returncode == 0, (block, out, err)
    if "delete --all --yes" in block:
        assert out.splitlines()[:3] == [
            "deleted from local (node 0): step-1, step-2, step-3, step-4, step-5",
            "deleted from local (node 1): step-5",  # node 1's new disk: what fetch put there
            "deleted from s3: step-1, step-2, step-3, step-4, step-5",
        ], out
        assert out.rstrip().endswith("no checkpoint left") and "no committed checkpoint on any tier" in err
        assert not [p for p in base.glob("*/step-*") if p.is_dir() and any(p.iterdir())], "left on a node"
        return "delete"
    if "fetch latest --node 1" in block:
        assert f"fetched step-5 to node 1 ({base}/1/step-5): 2 file(s) (from node 0: 2)" in out, out
        assert re.search(r"^step-5 on node 1 \(.*\): 2 file\(s\).*: OK$", out, re.M), out
        return "fetch"
    if "push ||" in block:
        assert out.strip() == "push failed with exit 3: S3 still down", (out, err)
        assert re.search(r"^tierckpt-restore: error: .*list s3://", err, re.M), err
        return "push-down"
    if "push\n" in block:
        assert "pushed 5 checkpoint(s): step-1, step-2, step-3, step-4, step-5" in out, (out, err)
        rows = _rows(out)
        assert rows["step-5"][2:6] == ["committed", "committed", "0,1", "yes"], out
        assert {ln.split(" (")[0] for ln in out.splitlines() if ln.endswith(": OK")} == {
            "step-5 on s3",
            "step-5 on node 0",
            "step-5 on node 1",
        }, out
        return "push"
    if "timeline" in block:
        # committed on node 0 (its copy to S3 failed in the outage, shown when the job recorded that
        # before it exited: "ok, copy to s3 failed, ..."), and the first save of the second job
        row = next(ln for ln in out.splitlines() if ln.startswith("step-4 "))
        assert re.search(r"\s+ok(, copy to s3 failed)?, job restarted before it$", row), out
        assert "wrote night.png: 5 checkpoint(s), 1 restart(s) of the job" in out, out
        assert (ops / "night.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        return "timeline"
    if "advise --mtbf 8h" in block:
        assert "from 5 checkpoint(s) (step-1 .. step-5), 2 rank(s)" in out, out
        assert "1 restart(s) of the job" in out and re.search(r"^advice: checkpoint every \S+ s of training", out, re.M)
        return "advise"
    if block.startswith("import tierckpt"):
        assert "step-5 ('local',) ('0', '1')" in out and out.splitlines()[-1] == "step-5", (out, err)
        return "python"
    if block.strip().endswith(" latest"):
        assert out.strip() == "step-5" and "unreachable" in err, (out, err)
        return "latest"
    if block.strip().endswith(" list"):
        head = out.splitlines()[0].split()
        assert head[:4] == ["ID", "STEP", "LOCAL", "NODES"], out  # S3 cannot be read: no S3 column
        rows = _rows(out)
        assert sorted(rows) == [f"step-{i}" for i in range(1, 6)], out
        assert all(row[2:4] == ["committed", "0,1"] for row in rows.values()), out
        assert "warning: tier s3" in err and "could not be read" in err, err
        return "list"
    raise AssertionError(f"a block of the ops-day section that the test does not check: {block!r}")


def test_a_day_of_operations_runs_as_written(night) -> None:
    ops, base, proxy = night["dir"], night["base"], night["proxy"]
    ran = []
    for lang, block in ops_day_blocks():
        if "push\n" in block:  # S3 is back
            proxy.outage = False
        if "--node 1" in block:  # node 1's disk is replaced
            shutil.rmtree(base / "1")
            (base / "1").mkdir()
        ran.append(_check(block, _run((lang, block), ops), base, ops))
    assert ran == ["list", "latest", "python", "push-down", "push", "timeline", "advise", "fetch", "delete"]


def test_the_readme_quickstart_is_two_commands() -> None:
    text = (REPO / "README.md").read_text()
    quick = text[text.index("## Quickstart\n") : text.index("\n## ", text.index("## Quickstart\n") + 1)]
    [block] = re.findall(r"```bash\n(.*?)```", quick, re.S)
    assert len([ln for ln in block.splitlines() if ln.strip()]) == 2, block
