"""Issue 33: node view, fetch, push and delete when this host cannot read another node's directory.

On a real cluster a node's disk is seen by that node only; an operator's host may see some node
directories (NFS) and not others. Here the 2-rank job of :mod:`test_operator_view` (ranks on
nodes ``0`` and ``1``, ``[local] path = ".../{node}"``, no ``[peer]`` copies: each node holds
only its own rank's files; ``step-2`` never reached S3) leaves two node directories, and node 1's
is made unreadable by permissions (``chmod 000``): the CLI, a child process, then cannot read it,
as on a host that does not see that node's disk. The CLI is never given a neighbour's files any
other way.

Permissions must really apply to the child: a test run as root would read a ``chmod 000``
directory anyway (``CAP_DAC_OVERRIDE``), so as root the child drops ``CAP_DAC_OVERRIDE`` and
``CAP_DAC_READ_SEARCH`` from its capability bounding set before it runs (``prctl``; it stays uid
0, so it still reads the interpreter under a private home such as ``/root``, where an
unprivileged user like ``nobody`` could not run it). A probe child checks that a ``chmod 000``
directory is refused before any test relies on it; where that cannot be arranged the tests skip
and say why.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_operator_view import NODE_VARS, _conf, _toml, crashed  # noqa: F401 - crashed: the fixture

from tierckpt.catalog import lease as leases
from tierckpt.catalog.listing import list_checkpoints
from tierckpt.config import config_from_dict
from tierckpt.tiers import make_s3
from tierckpt.tiers.local import LocalTier

REPO = Path(__file__).resolve().parent.parent
PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def _drop_dac() -> None:
    """preexec_fn: this child (and what it runs) no longer bypasses file permissions."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(err)}")


def _unprivileged() -> tuple[Callable[[], None] | None, str]:
    """(the preexec_fn that makes a child subject to permissions, or None when it already is;
    why not, when it cannot be)."""
    preexec = _drop_dac if os.geteuid() == 0 else None
    with tempfile.TemporaryDirectory() as d:
        shut = Path(d) / "shut"
        shut.mkdir()
        (shut / "f").write_text("x")
        shut.chmod(0)
        try:
            probe = subprocess.run(
                [sys.executable, "-c", f"import os; os.listdir({str(shut)!r})"],
                preexec_fn=preexec,
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"cannot start a child without CAP_DAC_OVERRIDE: {e}"
        finally:
            shut.chmod(stat.S_IRWXU)
    if probe.returncode == 0:
        return None, (
            "a child process reads a chmod 000 directory here (root, and the capability bounding set "
            "cannot be reduced): permissions cannot simulate a node this host cannot see"
        )
    if "PermissionError" not in probe.stderr:
        return None, f"the permission probe failed otherwise: {probe.stderr.strip()[-300:]}"
    return preexec, ""


PREEXEC, WHY_NOT = _unprivileged()
pytestmark = [
    pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


def cli(*args: str, config: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``tierckpt-restore --config CONFIG ARGS`` in a child process subject to file permissions,
    run as an operator runs it outside torchrun (no node variables: its node is the host name)."""
    child_env = {k: v for k, v in os.environ.items() if k not in NODE_VARS}
    child_env.update(PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", COLUMNS="200", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "restore", "--config", str(config), *args],
        cwd=REPO,
        env=child_env,
        preexec_fn=PREEXEC,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture
def nodes(crashed: dict, tmp_path: Path) -> Iterator[dict]:  # noqa: F811 - the imported fixture
    """A copy of the job's node directories with an S3 prefix of their own (empty: nothing was
    ever pushed there) and the original prefix (``step-1`` only); ``shut(node)`` makes a node
    directory unreadable until the test ends."""
    base = tmp_path / "ckpt"
    shutil.copytree(crashed["base"], base)
    s3_orig = crashed["conf"]["s3"]
    fresh = dict(s3_orig, prefix="p-" + os.urandom(4).hex())
    shut: list[Path] = []

    def close(node: str) -> None:
        (base / node).chmod(0)
        shut.append(base / node)

    def reopen() -> None:
        for p in shut:
            p.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        shut.clear()

    try:
        yield {
            "base": base,
            "toml": _toml(tmp_path / "tiers.toml", _conf(base, fresh)),
            "toml_orig": _toml(tmp_path / "orig.toml", _conf(base, s3_orig)),
            "s3": fresh,
            "shut": close,
            "reopen": reopen,
        }
    finally:
        reopen()


def _committed(base: Path, node: str) -> list[str]:
    tier = LocalTier(base / node, fsync=False)
    try:
        return sorted(c.checkpoint_id for c in list_checkpoints(tier) if c.committed)
    finally:
        tier.close()


def _s3_keys(s3: dict) -> list[str]:
    """Every object under the S3 prefix ``s3`` names (data files, metadata, leases)."""
    t = make_s3(config_from_dict({"host": {"buffer_size": "8MiB", "chunk_size": "1MiB"}, "s3": s3}))
    assert t is not None
    try:
        return sorted(o.key for o in t.list(""))
    finally:
        t.close()


def _s3_committed(s3: dict) -> list[str]:
    return sorted(k.split("/")[0] for k in _s3_keys(s3) if k.endswith("/metadata.json"))


# -- node view ------------------------------------------------------------------------------------


def test_list_shows_what_is_readable_and_names_the_node_it_cannot_read(nodes) -> None:
    nodes["shut"]("1")
    r = cli("list", config=nodes["toml"])
    assert r.returncode == 0, r
    rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines()[1:]}
    assert sorted(rows) == ["step-1", "step-2"], r.stdout
    assert rows["step-2"][2:5] == ["committed", "-", "0"], r.stdout  # node 0 only: node 1 is not readable
    warn = [ln for ln in r.stderr.splitlines() if "node 1" in ln]
    assert len(warn) == 1 and "could not be read" in warn[0] and str(nodes["base"] / "1") in warn[0], r.stderr
    j = json.loads(cli("list", "--json", config=nodes["toml"]).stdout)
    assert {e["checkpoint_id"]: e["tiers"]["local"]["nodes"] for e in j}["step-2"] == {"0": "committed"}
    strict = cli("list", "--strict", config=nodes["toml"])
    assert strict.returncode != 0 and "step-2" in strict.stdout, strict


def test_fetch_takes_from_s3_what_an_unreadable_node_holds(nodes) -> None:
    """Node 0's disk was replaced (empty) and node 1's directory cannot be read here: ``latest``
    is the newest checkpoint readable in full (``step-1``, on S3: ``step-2``'s rank 1 file is on
    node 1 only) and both its files come from S3 into node 0's own directory."""
    base = nodes["base"]
    shutil.rmtree(base / "0")
    (base / "0").mkdir()
    nodes["shut"]("1")
    r = cli("fetch", "latest", "--node", "0", "--json", config=nodes["toml_orig"])
    assert r.returncode == 0, r
    res = json.loads(r.stdout)
    assert res["checkpoint_id"] == "step-1" and res["local_url"] == f"{base}/0/step-1", res
    assert set(res["sources"].values()) == {"s3"}, res
    nodes["reopen"]()
    assert _committed(base, "0") == ["step-1"]
    assert _committed(base, "1") == ["step-1", "step-2"]  # untouched


# -- push -----------------------------------------------------------------------------------------


def test_push_gathers_a_checkpoints_ranks_from_every_node(nodes) -> None:
    """No node directory holds ``step-2`` whole (no peer copies): rank 0's file is on node 0,
    rank 1's on node 1. One push reads both and commits it on S3, loadable from S3 alone."""
    r = cli("push", "--no-gc", config=nodes["toml"])
    assert r.returncode == 0, r
    assert "pushed 2 checkpoint(s): step-1, step-2" in r.stdout, r.stdout
    assert _s3_committed(nodes["s3"]) == ["step-1", "step-2"]
    v = cli("verify", "step-2", "--tier", "s3", "--json", config=nodes["toml"])
    assert v.returncode == 0, v
    rep = json.loads(v.stdout)
    assert rep["ok"] and {t["tier"]: t["files_checked"] for t in rep["tiers"]} == {"s3": 2}, rep
    again = cli("push", "--json", config=nodes["toml"])
    assert again.returncode == 0 and json.loads(again.stdout)["tiers"][0]["needed"] == [], again


def test_push_refuses_a_checkpoint_whose_ranks_live_on_an_unreadable_node(nodes) -> None:
    nodes["shut"]("1")
    r = cli("push", "--no-gc", config=nodes["toml"])
    assert r.returncode == 3, r
    lines = {ln.split(" not pushed: ")[0].split()[-1]: ln for ln in r.stdout.splitlines() if " not pushed: " in ln}
    assert sorted(lines) == ["step-1", "step-2"], r.stdout
    for ln in lines.values():
        assert "rank(s) 1 " in ln and "node 1 could not be read" in ln and str(nodes["base"] / "1") in ln, ln
    assert "node 1" in r.stderr and "could not be read" in r.stderr, r.stderr
    assert _s3_keys(nodes["s3"]) == []  # nothing of them copied: no partial checkpoint on S3
    nodes["reopen"]()  # the host can read node 1 again: the same command pushes both
    ok = cli("push", "--no-gc", config=nodes["toml"])
    assert ok.returncode == 0 and "pushed 2 checkpoint(s): step-1, step-2" in ok.stdout, ok


# -- delete ---------------------------------------------------------------------------------------


def test_delete_all_removes_from_every_readable_node_and_names_the_rest(nodes) -> None:
    base = nodes["base"]
    nodes["shut"]("1")
    r = cli("delete", "--all", "--yes", "--tier", "local", config=nodes["toml"])
    assert r.returncode == 1, r
    assert "deleted from local (node 0): step-1, step-2" in r.stdout.splitlines(), r.stdout
    assert "not read, nothing deleted there: local (node 1)" in r.stdout, r.stdout
    assert "local (node 1) could not be read" in r.stderr and str(base / "1") in r.stderr, r.stderr
    nodes["reopen"]()
    assert _committed(base, "0") == [] and _committed(base, "1") == ["step-1", "step-2"]
    # node 1 readable again, a process loading step-2 there: it is left, the rest goes
    tier = LocalTier(base / "1", fsync=False)
    try:
        with leases.acquire(tier, "step-2", purpose="a load on node 1"):
            busy = cli("delete", "--all", "--yes", "--tier", "local", config=nodes["toml"])
        assert busy.returncode == 1, busy
        assert "deleted from local (node 1): step-1" in busy.stdout, busy.stdout
        assert "in use on local (node 1) (not deleted): step-2" in busy.stdout, busy.stdout
    finally:
        tier.close()
    assert _committed(base, "1") == ["step-2"]
    last = cli("delete", "step-2", "--yes", config=nodes["toml"])
    assert last.returncode == 0 and "deleted from local (node 1): step-2" in last.stdout, last
    assert _committed(base, "0") == [] and _committed(base, "1") == []
