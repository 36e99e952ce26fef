"""Lightning 2.6 and Accelerate 1.15 as real runs use them (issue #36): a job killed between a
save and its commit restarts (no crash loop); runs sharing one tiers configuration never touch
each other's checkpoints; pointer files explain themselves to ``torch.load``; an unchanged state
is not saved twice; checkpoints saved before ids were namespaced per run still load.

Real processes (single rank: the behaviour does not depend on the world size) through the
workers of tests/lightning_scenarios.py and tests/accelerate_scenarios.py; the rest in this
process with real plugin objects and real tiers. Skipped where Lightning / Accelerate are missing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tierckpt.integrations.pathmap import read_pointer
from tierckpt.testing.launch import run_world

HERE = Path(__file__).resolve().parent


def _tiers(root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    toml = root / "tiers.toml"
    toml.write_text(
        f'[host]\nbuffer_size = "16MiB"\nchunk_size = "4MiB"\n[local]\npath = "{root / "local"}"\nkeep = 0\nfsync = false\n'
    )
    return str(toml)


def _fit(args: dict, wd: Path) -> dict:
    (res,) = run_world(1, "fit", args, wd, script=HERE / "lightning_scenarios.py", timeout=300)
    return res


def _ids(tiers: str) -> list[str]:
    from tierckpt.catalog.checkpoints import list_checkpoints

    return [c.id for c in list_checkpoints(tiers)]


# -- 1. killed between a save and its commit ----------------------------------------------------------


def _steps(ids: list[str], run: str | None = None) -> list[int]:
    """The global steps of ``ids`` (``<run>@epoch=E-step=S.ckpt``), of run ``run`` if given."""
    return [int(re.search(r"step=(\d+)", i).group(1)) for i in ids if run is None or i.startswith(run + "@")]


def test_lightning_kill_before_first_commit_restarts_then_resumes_from_fallback(tmp_path):
    """The first save's commit stalls and the job is killed: no pointer names it, so
    ``ckpt_path="last"`` starts from scratch (on b0e99ab: CheckpointNotFound on every restart).
    That job commits step 2, stalls at step 4 and is killed: its step-4 pointer names a committed
    fallback, so the next one resumes from step 2 and runs to the end."""
    pytest.importorskip("lightning")
    tiers = _tiers(tmp_path)
    ck = tmp_path / "ckpt"
    base = {"tiers": tiers, "dirpath": str(ck), "steps": 8, "interval": 2}
    _fit(base | {"crash_after": 2, "stall_at": 2}, tmp_path / "a")
    assert _ids(tiers) == []
    assert not (ck / "epoch=0-step=2.ckpt").exists()  # the pointer waits for a commit that never came

    b = _fit(base | {"ckpt_path": "last", "crash_after": 4, "stall_at": 4}, tmp_path / "b")
    assert "errors" not in b, b
    assert b["resumed_from"] == 0
    assert _steps(_ids(tiers)) == [2]
    ptr = read_pointer(ck / "epoch=0-step=4.ckpt")  # written at once: a committed checkpoint to fall back to
    assert ptr is not None and ptr.fallback == _ids(tiers)[0]

    c = _fit(base | {"ckpt_path": "last"}, tmp_path / "c")
    assert "errors" not in c, c
    assert c["resumed_from"] == 2 and c["global_step"] == 8, c
    assert _steps(_ids(tiers)) == [6, 8]


def test_lightning_first_commit_after_second_save_writes_its_pointer_then_resumes(tmp_path):
    """The first save (step 2) commits only after the second (step 4) returned, and step 4 never
    commits before the kill: step 4's pointer, held back at its save (nothing committed to fall
    back to then), is written when step 2 commits, naming it as fallback; so ``last.ckpt``
    (a link to step 4's pointer) resumes from step 2 (on 826c353: the pointer waited for step
    4's commit, ``last.ckpt`` dangled and the restart began from scratch)."""
    pytest.importorskip("lightning")
    tiers = _tiers(tmp_path)
    ck = tmp_path / "ckpt"
    base = {"tiers": tiers, "dirpath": str(ck), "steps": 6, "interval": 2}
    a = _fit(base | {"crash_after": 5, "hold_first_commit": True}, tmp_path / "a")
    assert "errors" not in a, a
    assert _steps(_ids(tiers)) == [2]
    ptr = read_pointer(ck / "epoch=0-step=4.ckpt")
    assert ptr is not None and _steps([ptr.id]) == [4] and ptr.fallback == _ids(tiers)[0], ptr

    b = _fit(base | {"ckpt_path": "last"}, tmp_path / "b")
    assert "errors" not in b, b
    assert b["resumed_from"] == 2 and b["global_step"] == 6, b


# -- 2. runs sharing one configuration; 4. last.ckpt not saved twice --------------------------------


def test_lightning_two_runs_one_config_apart_and_last_not_duplicated(tmp_path):
    """Two runs (another ``dirpath``) on one tiers configuration save the same names: neither
    collides (b0e99ab: CommitConflict at run B's first save), top-k deletes only the run's own,
    and each ``ckpt_path="last"`` resumes its own run. Run A has ``save_last=True``: ``last.ckpt``
    saved right after the step's own checkpoint (the same state) names that checkpoint instead of
    being a full copy (with ``TierckptCheckpointIO``, and with the FSDP2 strategy in run C) (b0e99ab: ``last.ckpt``, ``last.ckpt+1``, ... one extra checkpoint per save)."""
    pytest.importorskip("lightning")
    from tierckpt.integrations.pathmap import run_key

    tiers = _tiers(tmp_path)
    a, b, c = tmp_path / "runs" / "a", tmp_path / "runs" / "b", tmp_path / "runs" / "c"
    base = {"tiers": tiers, "interval": 2}
    runs = [
        base | {"dirpath": str(a), "steps": 8, "save_last": True},
        base | {"dirpath": str(b), "steps": 4},
        base | {"dirpath": str(b), "steps": 8, "ckpt_path": "last"},
        base | {"dirpath": str(a), "steps": 10, "ckpt_path": "last", "save_last": True},
        base | {"dirpath": str(c), "steps": 4, "save_last": True, "strategy": "fsdp2"},  # the sharded strategy
    ]
    (res,) = run_world(1, "fits", {"runs": runs}, tmp_path / "w", script=HERE / "lightning_scenarios.py", timeout=300)
    assert "errors" not in res, res
    got = res["runs"]
    assert [r.get("error") for r in got] == [None] * 5, got
    assert [r["resumed_from"] for r in got] == [0, 0, 4, 8, 0]  # each run resumed its own last
    assert [r["global_step"] for r in got] == [8, 4, 8, 10, 4]
    ids = _ids(tiers)
    ka, kb, kc = run_key(a), run_key(b), run_key(c)
    assert not any("last" in i for i in ids), ids  # every last.ckpt named a step's own checkpoint
    assert len({ka, kb, kc}) == 3 and all(i.startswith((ka + "@", kb + "@", kc + "@")) for i in ids), ids
    assert _steps(ids, kb) == [6, 8]  # run B's top 2, run A's untouched by B's deletions
    assert _steps(ids, ka) == [8, 10]
    assert _steps(ids, kc) == [2, 4]
    last = read_pointer(a / "last.ckpt")
    assert last is not None and last.id == f"{ka}@epoch=2-step=10.ckpt", last


def test_accelerate_two_project_dirs_one_config(tmp_path):
    """Accelerate runs with another ``project_dir`` on one configuration: ``total_limit`` prunes
    only the run's own ``checkpoint_<n>`` (b0e99ab: it deleted the other run's), ``load_state()``
    loads the run's own newest (b0e99ab: the other run's), and a new run with nothing saved gets
    CheckpointNotFound instead of another run's state."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from tierckpt.errors import CheckpointNotFound
    from tierckpt.integrations import accelerate as tierckpt_accelerate
    from tierckpt.integrations.pathmap import run_key

    tiers = _tiers(tmp_path)

    def start(name: str) -> tuple:
        pc = ProjectConfiguration(str(tmp_path / name), automatic_checkpoint_naming=True, total_limit=2)
        acc = Accelerator(cpu=True, project_config=pc)
        st = tierckpt_accelerate.enable(acc, tiers)
        torch.manual_seed(len(name))
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        return acc, st, model, opt

    def step(acc, model, opt) -> None:  # noqa: ANN001
        acc.backward(model(torch.randn(3, 4)).pow(2).mean())
        opt.step()
        opt.zero_grad()

    saved = {}
    for name, saves in (("b", 1), ("a", 3)):
        acc, st, model, opt = start(name)
        for _ in range(saves):
            step(acc, model, opt)
            acc.save_state()
        saved[name] = {k: v.clone() for k, v in model.state_dict().items()}
        st.disable()
    ka, kb = run_key(tmp_path / "a" / "checkpoints"), run_key(tmp_path / "b" / "checkpoints")
    assert sorted(_ids(tiers)) == sorted([f"{ka}@checkpoint_1", f"{ka}@checkpoint_2", f"{kb}@checkpoint_0"])

    for name in ("b", "a"):
        acc, st, model, opt = start(name)
        acc.load_state()
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved[name][k]), (name, k)
        st.disable()
    acc, st, model, opt = start("c")
    with pytest.raises(CheckpointNotFound, match="no checkpoint_<n> of run"):
        acc.load_state()
    st.disable()


# -- 1./2./4. with real plugin objects in this process ----------------------------------------------


def test_lightning_pointer_explains_itself_orphans_swept_conflict_named(tmp_path):
    """A pointer file given to ``torch.load`` / ``LightningModule.load_from_checkpoint`` raises a
    TierckptError saying what it is and how to load it (b0e99ab: UnpicklingError);
    ``tierckpt.integrations.lightning.load_from_checkpoint`` loads it. A pointer whose checkpoint
    never committed is removed by the next process saving there. Two runs given one ``run`` key
    that save the same name: the second gets a CommitConflict naming the key and its directory."""
    pytest.importorskip("lightning")
    import lightning
    import lightning.pytorch as L

    from tierckpt.errors import CommitConflict, TierckptError
    from tierckpt.integrations.lightning import TierckptCheckpointIO, load_from_checkpoint
    from tierckpt.integrations.pathmap import Pointer, write_pointer

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

    tiers = _tiers(tmp_path)
    net = Net()
    ckpt = {
        "state_dict": net.state_dict(),
        "pytorch-lightning_version": lightning.__version__,
        "global_step": 3,
        "epoch": 0,
    }
    d = tmp_path / "ckpt"
    d.mkdir()
    orphan = d / "epoch=0-step=1.ckpt"
    write_pointer(orphan, Pointer("gone@epoch=0-step=1.ckpt"))  # its job died before the commit
    foreign = d / "notes.ckpt"
    foreign.write_bytes(b"not a pointer")
    io = TierckptCheckpointIO(tiers)
    io.save_checkpoint(ckpt, d / "model.ckpt")
    io.teardown()  # waits for the commit, the pointer and the sweep
    assert not orphan.exists() and foreign.exists() and (d / "model.ckpt").exists()

    for weights_only in (None, True, False):
        with pytest.raises(TierckptError, match="tierckpt pointer .*load_from_checkpoint"):
            torch.load(d / "model.ckpt", weights_only=weights_only)
    with pytest.raises(TierckptError, match="tierckpt pointer"):
        Net.load_from_checkpoint(d / "model.ckpt")
    loaded = load_from_checkpoint(Net, d / "model.ckpt", tiers)
    for k, v in net.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k

    one = TierckptCheckpointIO(tiers, run="shared")
    one.save_checkpoint(ckpt, tmp_path / "x" / "same.ckpt")
    one.teardown()
    other = TierckptCheckpointIO(tiers, run="shared")
    with pytest.raises(CommitConflict, match=r"shared@same\.ckpt.*run='shared'"):
        other.save_checkpoint(ckpt, tmp_path / "y" / "same.ckpt")
    other.teardown()
