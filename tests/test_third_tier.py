"""Adding a tier takes one module, one registry entry and one contract-suite subclass.

``tests/archive_tier.py`` defines ``[archive]`` (a second directory standing in for another
storage class) and registers it after ``[local]``. Here: the tier contract and the chain
(commit protocol + copy) contract pass on it, and a job configured with ``[local]`` and
``[archive]`` replicates every checkpoint there, so that losing the local directory loses
nothing.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import archive_tier
import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_chain import ChainContract
from test_tier_contract import TierContract

from tierckpt import TieredReader, TieredWriter, load_config
from tierckpt.catalog.listing import committed_in_order
from tierckpt.tiers import make_tiers
from tierckpt.tiers.base import Tier


@pytest.fixture
def archive(tmp_path: Path) -> Iterator[Tier]:
    t = archive_tier.ArchiveTier(tmp_path / "archive", fsync=False)
    yield t
    t.close()


class TestArchiveTier(TierContract):
    @pytest.fixture
    def tier(self, archive: Tier) -> Tier:
        return archive

    def leftover_partials(self, tier: Tier) -> list[str]:
        return [str(p) for p in Path(tier.url).rglob("*") if p.name.endswith(".partial") or p.name.startswith(".tmp-")]


class TestArchiveChain(ChainContract):
    @pytest.fixture
    def tier(self, archive: Tier) -> Tier:
        return archive


def test_local_then_archive_chain(tmp_path: Path) -> None:
    conf = tmp_path / "tiers.toml"
    conf.write_text(
        f'[local]\npath = "{tmp_path}/local"\nkeep = 1\nfsync = false\n[archive]\npath = "{tmp_path}/archive"\n'
    )
    cfg = load_config(conf)
    assert [t.name for t in make_tiers(cfg)] == ["local", "archive"]
    w = TieredWriter(cfg)
    states = {}
    for step in (1, 2, 3):
        sd = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(step)), "step": step}
        states[step] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
        dcp.save(sd, checkpoint_id=f"step-{step}", storage_writer=w)
        w.wait()
    local, arch = make_tiers(cfg)
    assert [c.checkpoint_id for c in committed_in_order(arch)] == ["step-1", "step-2", "step-3"]
    assert [c.checkpoint_id for c in committed_in_order(local)] == ["step-3"]  # [local] keep = 1
    shutil.rmtree(tmp_path / "local")  # the fast tier is lost: the archive serves
    out = {"w": torch.zeros(64, 64), "step": 0}
    dcp.load(out, checkpoint_id="latest", storage_reader=TieredReader(cfg))
    assert torch.equal(out["w"], states[3]["w"]) and out["step"] == 3
