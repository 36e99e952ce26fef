"""``tierckpt-restore`` on a replacement node: ``latest`` and ``fetch`` from other nodes' peer
copies (``[peer] replicas``), with and without S3, and the CLI commands a launcher runs never
importing torch.

Two simulated nodes of one rank each (``TIERCKPT_NODE`` n0/n1, ``[local] path = ".../{node}"``)
save through ``TieredWriter`` in real gloo processes (``tests/peer_scenarios.py``) with one peer
copy of every file; then node n1's directory is deleted and the CLI runs "on n1" in a subprocess.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_peers import one_per_node, run

REPO = Path(__file__).resolve().parent.parent


def node_config(base: Path, s3: dict | None = None) -> Path:
    """The TOML every node uses (``{node}`` in the local path)."""
    lines = [
        "[host]",
        'buffer_size = "8MiB"',
        'chunk_size = "1MiB"',
        "[local]",
        f'path = "{base}/{{node}}"',
        "fsync = false",
        "[peer]",
        "replicas = 1",
    ]
    if s3:
        lines += ["[s3]"] + [f"{k} = {json.dumps(v)}" for k, v in s3.items() if v is not None and v != ""]
    path = base.parent / ("with-s3.toml" if s3 else "nodes.toml")
    path.write_text("\n".join(lines) + "\n")
    return path


def cli_on(node: str, config: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m restore ARGS`` as a launcher on ``node`` runs it."""
    env = dict(os.environ, TIERCKPT_NODE=node, PYTHONPATH=str(REPO))
    env.pop("TIERCKPT_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "restore", "--config", str(config), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def load_on(node: str, config: Path) -> None:
    """Load ``latest`` in one process on ``node`` from its local tier only; return the state."""
    import torch.distributed.checkpoint as dcp
    from peer_scenarios import full_state

    from tierckpt import TieredReader, load_config
    from tierckpt.testing import compare

    cfg = load_config(config)
    cfg = dataclasses.replace(cfg, s3=None, peer=dataclasses.replace(cfg.peer, replicas=0))
    want = full_state(1, 2)
    got = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in want.items()}
    old = os.environ.get("TIERCKPT_NODE")
    os.environ["TIERCKPT_NODE"] = node
    try:
        reader = TieredReader(cfg)
        dcp.load(got, checkpoint_id="latest", storage_reader=reader, no_dist=True)
    finally:
        if old is None:
            os.environ.pop("TIERCKPT_NODE", None)
        else:
            os.environ["TIERCKPT_NODE"] = old
    assert compare(want, got) == []  # bit for bit (random bit patterns: NaNs included)
    assert set(reader.served.values()) == {"local"}, reader.served


@pytest.fixture(scope="module")
def replicated_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("fetchpeers") / "ckpt"
    run(base, 2, "save_steps", {"steps": [1]}, "save", one_per_node, replicas=1)
    return base


def test_lost_node_fetches_its_files_from_the_peer_copies(replicated_master: Path, tmp_path: Path) -> None:
    """No S3: n1's directory is gone; on n1, ``latest`` finds step-1 on n0 and ``fetch latest``
    restores every file from n0's copies, verified; the node then loads from its own disk. The
    commands never import torch."""
    base = tmp_path / "ckpt"
    shutil.copytree(replicated_master, base)
    shutil.rmtree(base / "n1")
    conf = node_config(base)

    p = cli_on("n1", conf, "latest", "--json")
    assert p.returncode == 0, p.stderr
    latest = json.loads(p.stdout)
    assert latest["checkpoint_id"] == "step-1" and latest["tiers"] == ["node n0"], latest

    p = cli_on("n1", conf, "fetch", "latest", "--json", "-q")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["checkpoint_id"] == "step-1" and res["committed"] and len(res["files"]) == 2, res
    assert set(res["sources"].values()) == {"node n0"}, res
    assert (base / "n1" / "step-1" / "metadata.json").read_bytes() == (
        base / "n0" / "step-1" / "metadata.json"
    ).read_bytes()
    load_on("n1", conf)

    # What a launcher runs on every restart, in one process: torch is never imported.
    probe = (
        "import sys\nfrom restore.cli import main\n"
        f"codes = [main(['--config', {str(conf)!r}, *a]) for a in "
        "(['latest'], ['list'], ['verify', 'latest', '-q'], ['fetch', 'latest', '-q'])]\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\nprint('codes', codes)\n"
    )
    env = dict(os.environ, TIERCKPT_NODE="n1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "codes [0, 0, 0, 0]" in p.stdout, p.stdout


def test_fetch_prefers_the_peer_copy_over_s3(tmp_path: Path, moto_endpoint: str, s3cfg) -> None:
    """With S3 behind the nodes, the lost node's files come from n0's copies (from S3 with
    ``--no-peers``); a range of a copy that fails its CRC32C comes from S3, and the result says so."""
    s3 = dataclasses.asdict(s3cfg(moto_endpoint))
    s3["part_size"] = "5MiB"
    base = tmp_path / "ckpt"
    run(base, 2, "save_steps", {"steps": [1]}, "save", one_per_node, replicas=1, s3=s3)
    shutil.rmtree(base / "n1")
    copy = next(p for p in (base / "n0").rglob("rank-00001-*.data") if p.parent.name == "step-1")
    data = bytearray(copy.read_bytes())
    data[10] ^= 0x20  # n0's copy of rank 1's file (n1's own, lost) is damaged
    copy.write_bytes(bytes(data))
    conf = node_config(base, s3)

    p = cli_on("n1", conf, "fetch", "latest", "--json", "-q", "--no-peers")  # S3 only when asked
    assert p.returncode == 0, p.stderr
    assert set(json.loads(p.stdout)["sources"].values()) == {"s3"}, p.stdout
    shutil.rmtree(base / "n1")

    p = cli_on("n1", conf, "fetch", "latest", "--json", "-q")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    own = next(f for f in res["files"] if f.startswith("rank-00000"))
    assert res["sources"] == {own: "node n0", copy.name: "s3"}, res
    p = cli_on("n1", conf, "verify", "step-1", "--tier", "local", "-q")
    assert p.returncode == 0, p.stdout + p.stderr
    load_on("n1", conf)
