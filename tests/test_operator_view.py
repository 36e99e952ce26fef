"""Issue 33, items 1, 3 and 7: what an operator sees after a multi-node job, with a tier down, and
with a bad id.

A real 2-rank gloo job saves through ``TieredWriter`` with ``[local] path = ".../{node}"`` and
``GROUP_RANK`` set per process, as torchrun does (node directories ``0`` and ``1``), and an
``[s3]`` tier on a moto server over HTTP. The newest checkpoint's S3 copy is then removed (the
job crashed before it reached S3), so only the node directories hold it. The CLI runs as an
operator runs it, with no torchrun variables (its node is the host name, a directory no job
wrote) or with ``GROUP_RANK`` set; a dead S3 endpoint is a socket that accepts connections and
never answers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_restore_cli import cli as _cli

import tierckpt
from tierckpt.config import config_from_dict
from tierckpt.testing.launch import launch_ranks

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "peer_scenarios.py"
NODE_VARS = ("TIERCKPT_NODE", "GROUP_RANK", "NODE_RANK")


@dataclasses.dataclass
class Ran:
    """One CLI run (printed whole when an assertion fails)."""

    returncode: int
    stdout: str
    stderr: str


def cli(*args: str, config: Path | None = None) -> Ran:
    """``tierckpt-restore ARGS`` in this process (:func:`test_restore_cli.cli`)."""
    r = _cli(*args, config=config)
    return Ran(r.returncode, r.stdout, r.stderr)


def _conf(base: Path, s3: dict | None) -> dict:
    return {
        "host": {"buffer_size": "8MiB", "chunk_size": "1MiB"},
        "local": {"path": f"{base}/{{node}}", "fsync": False},
        **({"s3": s3} if s3 else {}),
    }


def _toml(path: Path, conf: dict) -> Path:
    lines = []
    for section, values in conf.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory, moto_endpoint: str) -> dict:
    """Steps 1 and 2 saved by 2 ranks on nodes '0' and '1' (GROUP_RANK); step-2 never reached S3."""
    import s3servers

    tmp = tmp_path_factory.mktemp("opsview")
    bucket = "opsview-" + os.urandom(4).hex()
    s3servers.make_bucket(moto_endpoint, bucket)
    s3 = {
        "bucket": bucket,
        "prefix": "ckpt",
        "endpoint_url": moto_endpoint,
        "part_size": "5MiB",
        "max_attempts": 2,
        "connect_timeout": 2.0,
        "read_timeout": 10.0,
    }
    base = tmp / "ckpt"
    conf = _conf(base, s3)
    clean = {k: v for k, v in os.environ.items() if k not in NODE_VARS}
    saved_env = dict(os.environ)
    os.environ.clear()
    os.environ.update(clean)
    try:
        codes, logs = launch_ranks(
            2,
            lambda r: [
                sys.executable,
                str(SCRIPT),
                "save_steps",
                json.dumps({"config": conf, "steps": [1, 2]}),
                str(tmp / f"result{r}.json"),
            ],
            tmp / "work",
            timeout=180,
            env_of=lambda r: {"GROUP_RANK": str(r)},
        )
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    assert codes == [0, 0], logs
    assert sorted(p.name for p in base.iterdir()) == ["0", "1"]
    from tierckpt.catalog.listing import list_checkpoints
    from tierckpt.tiers import make_s3

    s3t = make_s3(config_from_dict(conf))
    try:
        [step2] = [c for c in list_checkpoints(s3t) if c.checkpoint_id == "step-2"]
        for info in step2.objects.values():  # the crash came before step-2 reached S3
            s3t.delete(info.key)
        assert not s3t.exists("step-2/metadata.json")
    finally:
        s3t.close()
    return {"base": base, "conf": conf, "toml": _toml(tmp / "tiers.toml", conf), "tmp": tmp}


@pytest.fixture
def no_node_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI as an operator runs it outside torchrun: its node is the host name."""
    for var in NODE_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def dead_endpoint() -> Iterator[str]:
    """An S3 endpoint that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)  # the kernel completes the handshakes; nothing ever reads or answers
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        srv.close()


# -- item 1: one view of every node ---------------------------------------------------------------


def test_list_shows_every_node_and_which_holds_each(crashed, no_node_env):
    r = cli("list", config=crashed["toml"])
    assert r.returncode == 0, r
    lines = r.stdout.splitlines()
    head = lines[0].split()
    assert head[:5] == ["ID", "STEP", "LOCAL", "S3", "NODES"], r.stdout
    rows = {l.split()[0]: l.split() for l in lines[1:]}
    assert rows["step-2"][2:5] == ["committed", "-", "0,1"], r.stdout  # only on the nodes: the crash
    assert rows["step-1"][2:5] == ["committed", "committed", "0,1"], r.stdout
    j = json.loads(cli("list", "--json", config=crashed["toml"]).stdout)
    by_id = {e["checkpoint_id"]: e for e in j}
    assert by_id["step-2"]["tiers"]["local"]["nodes"] == {"0": "committed", "1": "committed"}
    assert by_id["step-2"]["tiers"]["local"]["rank_files"] == 2  # rank 0 on node 0, rank 1 on node 1
    assert "s3" not in by_id["step-2"]["tiers"]
    assert cli("latest", config=crashed["toml"]).stdout.strip() == "step-2"


def test_python_catalog_sees_every_node(crashed, no_node_env):
    listed = {c.id: c for c in tierckpt.list_checkpoints(crashed["toml"])}
    assert listed["step-2"].tiers == ("local",) and listed["step-2"].nodes == ("0", "1")
    assert listed["step-1"].tiers == ("local", "s3") and listed["step-1"].nodes == ("0", "1")
    assert [c.id for c in tierckpt.list_checkpoints(crashed["toml"])] == ["step-1", "step-2"]
    assert tierckpt.latest(crashed["toml"]) == "step-2"


def test_verify_latest_checks_every_node(crashed, no_node_env):
    r = cli("verify", "latest", "--json", config=crashed["toml"])
    assert r.returncode == 0, r
    rep = json.loads(r.stdout)
    assert rep["checkpoint_id"] == "step-2" and rep["ok"]
    checked = {t["tier"]: t["files_checked"] for t in rep["tiers"]}
    assert checked == {"node 0": 1, "node 1": 1}, rep


def _data_files(node_dir: Path, cid: str) -> int:
    """How many data files of committed ``cid`` the node directory holds."""
    from tierckpt.catalog.listing import list_checkpoints
    from tierckpt.format.layout import is_data_file
    from tierckpt.tiers.local import LocalTier

    tier = LocalTier(node_dir, fsync=False)
    try:
        [c] = [c for c in list_checkpoints(tier) if c.checkpoint_id == cid and c.committed]
        return sum(1 for n in c.objects if is_data_file(n))
    finally:
        tier.close()


def test_fetch_writes_into_the_node_asked_and_says_so(crashed, tmp_path, monkeypatch, no_node_env):
    import shutil

    base = tmp_path / "ckpt"
    shutil.copytree(crashed["base"], base)
    toml = _toml(tmp_path / "tiers.toml", _conf(base, crashed["conf"]["s3"]))
    # No torchrun variables: the host name's directory, with a warning naming the nodes and --node.
    r = cli("fetch", "latest", config=toml)
    host = socket.gethostname()
    assert r.returncode == 0, r
    assert f"to node {host} ({base}/{host}/step-2)" in r.stdout, r.stdout
    assert "--node" in r.stderr and "0, 1" in r.stderr, r.stderr
    again = cli("fetch", "latest", config=toml)  # a directory a job (or fetch) wrote: no warning
    assert again.returncode == 0 and "already there" in again.stdout and not again.stderr, again
    # --node 0: node 0's directory gets rank 1's file from node 1.
    r = cli("fetch", "latest", "--node", "0", "--json", config=toml)
    assert r.returncode == 0, r
    res = json.loads(r.stdout)
    assert res["node"] == "0" and res["local_url"] == f"{base}/0/step-2" and res["node_from"] == "--node"
    assert sorted(res["sources"].values()) == ["local", "node 1"], res
    assert _data_files(base / "0", "step-2") == 2
    # GROUP_RANK set (a launcher script run by torchrun): that node's directory, no --node needed.
    monkeypatch.setenv("GROUP_RANK", "1")
    r = cli("fetch", "step-2", config=toml)
    assert r.returncode == 0 and f"to node 1 ({base}/1/step-2)" in r.stdout and not r.stderr, r
    assert _data_files(base / "1", "step-2") == 2
    assert cli("fetch", "latest", "--node", "../x", config=toml).returncode == 2


# -- item 3: list degrades like latest ------------------------------------------------------------


def _dead_config(crashed: dict, tmp_path: Path, endpoint: str) -> Path:
    s3 = dict(crashed["conf"]["s3"], endpoint_url=endpoint, max_attempts=1, connect_timeout=0.5, read_timeout=0.5)
    return _toml(tmp_path / "dead.toml", _conf(crashed["base"], s3))


def test_list_with_s3_down_shows_the_local_rows(crashed, tmp_path, dead_endpoint, no_node_env):
    toml = _dead_config(crashed, tmp_path, dead_endpoint)
    r = cli("list", config=toml)
    assert r.returncode == 0, r
    assert {l.split()[0] for l in r.stdout.splitlines()[1:]} == {"step-1", "step-2"}, r.stdout
    warn = [l for l in r.stderr.splitlines() if "warning" in l]
    assert len(warn) == 1 and "tier s3" in warn[0] and "could not be read" in warn[0], r.stderr
    strict = cli("list", "--strict", config=toml)
    assert strict.returncode == 3 and "step-2" in strict.stdout, strict
    assert cli("latest", config=toml).stdout.strip() == "step-2"
    listed = [c.id for c in tierckpt.list_checkpoints(toml)]
    assert listed == ["step-1", "step-2"]


def test_list_without_credentials_shows_the_local_rows(crashed, monkeypatch, no_node_env):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    r = cli("list", "--json", config=crashed["toml"])
    assert r.returncode == 0, r
    assert {e["checkpoint_id"] for e in json.loads(r.stdout)} == {"step-1", "step-2"}
    assert "tier s3" in r.stderr and "credentials" in r.stderr.lower(), r.stderr
    assert cli("list", "--strict", config=crashed["toml"]).returncode == 2


def test_list_with_every_tier_down_fails(crashed, tmp_path, dead_endpoint):
    s3 = dict(crashed["conf"]["s3"], endpoint_url=dead_endpoint, max_attempts=1, connect_timeout=0.5, read_timeout=0.5)
    toml = _toml(tmp_path / "s3only.toml", {"host": crashed["conf"]["host"], "s3": s3})
    r = cli("list", config=toml)
    assert r.returncode == 3 and r.stdout == "", r


# -- item 7: one error class for bad ids ----------------------------------------------------------


@pytest.mark.parametrize("bad", ["step 1", "a:b", "a,b", "step-1\n\n", "latest\n\n"])
def test_cli_refuses_bad_ids_with_the_id_rules(crashed, bad, no_node_env):
    r = cli("verify", bad, config=crashed["toml"])
    assert r.returncode == 2 and "invalid checkpoint id" in r.stderr and "._-=+@" in r.stderr, r


def test_cli_strips_one_trailing_newline(crashed, no_node_env):
    r = cli("verify", "step-1\n", "--json", config=crashed["toml"])
    assert r.returncode == 0 and json.loads(r.stdout)["checkpoint_id"] == "step-1", r
    assert cli("verify", "latest\n", "--json", config=crashed["toml"]).returncode == 0


def test_library_entry_points_raise_invalid_checkpoint_id(crashed, no_node_env):
    from restore import fetch_checkpoint, verify_checkpoint

    for bad in ("step 1", "a:b", "a,b", "step-1\n"):
        with pytest.raises(tierckpt.InvalidCheckpointId) as ei:
            tierckpt.latest(crashed["toml"], before=bad)
        assert not isinstance(ei.value, tierckpt.CorruptCheckpoint) and isinstance(ei.value, ValueError)
        with pytest.raises(tierckpt.InvalidCheckpointId):
            fetch_checkpoint(crashed["toml"], bad)
        with pytest.raises(tierckpt.InvalidCheckpointId):
            verify_checkpoint(crashed["toml"], bad)
    cfg = dataclasses.replace(config_from_dict(crashed["conf"]), s3=None)
    with pytest.raises(tierckpt.InvalidCheckpointId):
        tierckpt.TieredWriter(cfg).reset("latest")
    assert tierckpt.TieredReader.validate_checkpoint_id(
        "run@name"
    ) and not tierckpt.TieredReader.validate_checkpoint_id("a,b")
