"""The README's "Use" loop, run as written (issue 33, items 6 and 8): a first start, a resume that
restores the optimizer's state, the warning for a load that would not, one ``CheckpointNotFound``
for ``latest`` on a first start, and what a finished ``async_save`` future means."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _readme_loop() -> str:
    text = (REPO / "README.md").read_text()
    use = text[text.index("## Use\n") :]
    return re.search(r"```python\n(.*?)```", use, re.S).group(1)  # type: ignore[union-attr]


def _run(cwd: Path, code: str) -> subprocess.CompletedProcess:
    (cwd / "tiers.toml").write_text(f'[local]\npath = "{cwd}/ckpt"\n')
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    env.pop("TIERCKPT_CONFIG", None)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


PROBE = '\nprint("START", start, "ADAM_STEP", float(optimizer.state_dict()["state"][0]["step"]))\n'


def test_the_readme_loop_starts_then_resumes_with_the_optimizer(tmp_path: Path) -> None:
    first = _run(tmp_path, _readme_loop() + PROBE)
    assert first.returncode == 0, first.stderr
    assert "START 0 ADAM_STEP 50.0" in first.stdout
    # the second run resumes from step-000040 (41 optimizer steps in) and runs steps 41..49
    second = _run(tmp_path, _readme_loop() + PROBE)
    assert second.returncode == 0, second.stderr
    assert "START 41 ADAM_STEP 50.0" in second.stdout, second.stdout  # 9 without Adam's state
    assert "NOT loaded" not in second.stderr


def test_a_fresh_optimizer_state_dict_loads_nothing_and_says_so(tmp_path: Path) -> None:
    assert _run(tmp_path, _readme_loop()).returncode == 0
    wrong = (
        _readme_loop()
        .replace(
            "model_sd, optim_sd = get_state_dict(model, optimizer)",
            "model_sd, optim_sd = model.state_dict(), optimizer.state_dict()",
        )
        .replace('set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])', "pass")
    )
    out = _run(tmp_path, wrong)
    assert out.returncode == 0, out.stderr
    warned = [ln for ln in out.stderr.splitlines() if "NOT loaded" in ln]
    assert len(warned) == 1 and warned[0].startswith("tierckpt WARNING checkpoint step-000040 holds 6 optimizer")


def test_latest_on_a_first_start_is_none_and_one_error(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import torch, torch.distributed.checkpoint as dcp, tierckpt
        from tierckpt import TieredReader, load_config
        cfg = load_config("tiers.toml")
        print("LATEST", tierckpt.latest(cfg))
        dcp.load({"w": torch.zeros(2)}, checkpoint_id="latest", storage_reader=TieredReader(cfg))
        """
    )
    out = _run(tmp_path, code)
    assert out.returncode == 1 and "LATEST None" in out.stdout
    assert out.stderr.count("Traceback") == 1, out.stderr
    assert out.stderr.count("no committed checkpoint on any tier") == 1, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("tierckpt.errors.CheckpointNotFound: ")


def test_a_finished_async_save_future_in_thread_mode_is_accepted_not_committed(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import torch, torch.distributed.checkpoint as dcp, tierckpt
        from tierckpt import TieredWriter, load_config
        cfg = load_config("tiers.toml")
        w = TieredWriter(cfg)
        fs = [dcp.async_save({"w": torch.full((1000,), float(i))}, checkpoint_id=f"step-{i}", storage_writer=w)
              for i in range(3)]
        for f in fs:
            f.result()
        w.wait(tiers="local")
        print("AFTER_WAIT_LOCAL", [c.id for c in tierckpt.list_checkpoints(cfg)])
        """
    )
    out = _run(tmp_path, code)
    assert out.returncode == 0, out.stderr
    assert "AFTER_WAIT_LOCAL ['step-0', 'step-1', 'step-2']" in out.stdout


ASYNC_MODES = """
import sys, torch, torch.distributed.checkpoint as dcp, tierckpt
from tierckpt import TieredWriter, TieredReader, load_config
from tierckpt.config import config_from_dict
cfg = config_from_dict({{"local": {{"path": "ckpt"}}, "job": {{"async_future": "{mode}"}}}})
w = TieredWriter(cfg)
t = torch.zeros(1 << 20)
fs = []
for i in range(3):
    t.fill_(float(i))
    f = dcp.async_save({{"t": t}}, checkpoint_id=f"step-{{i}}", storage_writer=w)
    f.result()
    fs.append([c.id for c in tierckpt.list_checkpoints(cfg)])
    {after}
print("LISTED", fs)
try:
    w.wait()
    print("WAIT OK")
except Exception as e:
    print("WAIT FAILED", type(e).__name__)
out = {{"t": torch.empty(1 << 20)}}
for i in range(3):
    try:
        dcp.load(out, checkpoint_id=f"step-{{i}}", storage_reader=TieredReader(cfg))
        print("LOADED", i, float(out["t"][0]), float(out["t"][-1]))
    except BaseException as e:
        print("NOT LOADED", i)
"""


def test_async_future_committed_local_lists_each_checkpoint_at_result(tmp_path: Path) -> None:
    out = _run(
        tmp_path, ASYNC_MODES.format(mode="committed_local", after="t.fill_(-1.0)  # the future said: committed")
    )
    assert out.returncode == 0, out.stderr
    assert "LISTED [['step-0'], ['step-0', 'step-1'], ['step-0', 'step-1', 'step-2']]" in out.stdout, out.stdout
    assert "WAIT OK" in out.stdout
    for i in range(3):
        assert f"LOADED {i} {float(i)} {float(i)}" in out.stdout, out.stdout


def test_async_future_captured_lets_the_state_change_at_result(tmp_path: Path) -> None:
    # "captured": once f.result() returned the state is in host memory: changing it in place
    # (no wait_captured, no attached optimizer) leaves the checkpoint as it was saved
    out = _run(tmp_path, ASYNC_MODES.format(mode="captured", after="t.fill_(-1.0)"))
    assert out.returncode == 0, out.stderr
    assert "WAIT OK" in out.stdout, out.stdout
    for i in range(3):
        assert f"LOADED {i} {float(i)} {float(i)}" in out.stdout, out.stdout


def test_async_future_is_validated(tmp_path: Path) -> None:
    from tierckpt.config import config_from_dict
    from tierckpt.errors import ConfigError

    try:
        config_from_dict({"local": {"path": str(tmp_path)}, "job": {"async_future": "committed"}})
    except ConfigError as e:
        assert "async_future" in str(e) and "committed_local" in str(e)
    else:
        raise AssertionError("accepted a bad [job] async_future")
