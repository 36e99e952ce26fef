"""The chaos harness (``tools/chaos.py``) in CI: a handful of trials per case, and the bugs it found.

Each case runs a few seeded trials (``CHAOS_SEED`` overrides the seed) against moto; a case passes
when every failure it reports is explained by an entry of ``chaos.KNOWN_BUGS`` (empty now). The
two bugs the harness found are reproduced deterministically below, as regression tests.

The cases of ``tools/chaos_loss.py`` (no committed checkpoint is ever lost: file-time changes,
the unpromoted backlog, gc racing loads, the kill loop, deletions racing saves) run here too, a
few trials each.

Larger runs: ``CHAOS_TRIALS=50 python -m pytest tests/test_chaos.py -k large`` (every case with
that many trials; ``-k "large and (filetimes or backlog or gcload or killloop)"`` for the new
ones), or the tool itself: ``python tools/chaos.py --trials 100 --cases crash``.
"""

from __future__ import annotations

import json
import os
import warnings

import chaos  # tools/chaos.py (conftest puts tools/ on sys.path)
import pytest
import torch.distributed.checkpoint as dcp

from tierckpt import CommitConflict, TieredWriter
from tierckpt.config import config_from_dict

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

SEED = int(os.environ.get("CHAOS_SEED", "20240611"))
LARGE = int(os.environ.get("CHAOS_TRIALS", "0"))


@pytest.fixture(scope="module")
def env(moto_endpoint, tmp_path_factory):
    e = chaos.Env("moto", work=tmp_path_factory.mktemp("chaos"), endpoint=moto_endpoint)
    try:
        yield e
    finally:
        e.close()


def check(res: chaos.CaseResult, min_trials: int) -> None:
    assert not res.skipped, res.skipped
    assert res.trials >= min_trials, res
    unexplained = [p for p in res.problems if "[known bug:" not in p]
    assert res.unexplained == 0 and not unexplained, "\n".join(unexplained)


# -- the cases, CI-sized --------------------------------------------------------------------------


def test_crash(env):
    # 3 trials (about 6 s each): a SIGKILL at a random time, then kills inside a chunk write
    # (flush) and around the S3 commit (promotion); each followed by checks and a resume
    check(chaos.case_crash(env, 3, SEED, plan=("random", "local.write", "s3.commit")), 3)


def test_faults(env):
    check(chaos.case_faults(env, 4, SEED), 4)


def test_corrupt(env):
    res = chaos.case_corrupt(env, 16, SEED)
    check(res, 16)
    assert res.lost == 0


def test_concurrency(env):
    # one-engine is the known bug "error-to-other-writer" (test_known_bug_error_to_other_writer)
    scen = ("two-engines", "two-engines+s3", "two-nodes-one-s3", "two-processes")
    res = chaos.case_concurrency(env, 4, SEED, scenarios=scen)
    check(res, 4)
    assert res.lost == 0


def test_resources(env):
    check(chaos.case_resources(env, 1, SEED, n=16, loads=8, warmup=6, load_warmup=4), 1)


def test_s3faults(env):
    res = chaos.case_s3faults(env, 6, SEED)
    check(res, 6)
    assert res.lost == 0


# -- no committed checkpoint is ever lost (tools/chaos_loss.py), CI-sized ---------------------------


def test_filetimes(env):
    # touched, back-dated and restored files: latest, list and gc keep=1 follow the commit order
    res = chaos.CASE_FUNCS["filetimes"](env, 3, SEED)
    check(res, 3)
    assert res.lost == 0


def test_backlog(env):
    # killed after a local commit, before an S3 upload, or run without [s3]; then resumed
    res = chaos.CASE_FUNCS["backlog"](env, 3, SEED, plan=("local.commit", "s3.upload", "no-s3"))
    check(res, 3)
    assert res.lost == 0


def test_gcload(env):
    res = chaos.CASE_FUNCS["gcload"](env, 4, SEED)
    check(res, 4)
    assert res.lost == 0


def test_killloop(env):
    # 5 kills, each restarted from latest + 1: 3 with the local tier only, 2 with S3 as well
    res = chaos.CASE_FUNCS["killloop"](env, 5, SEED)
    check(res, 5)
    assert res.lost == 0


def test_earlykill(env):
    # 2 trials: a save-every-step loop SIGKILLed 1-3 s after it started resumes from a
    # committed checkpoint within a few steps of its durable saves (issue #32, item 8)
    res = chaos.CASE_FUNCS["earlykill"](env, 2, SEED)
    check(res, 2)
    assert res.lost == 0


def test_deleterace(env):
    # one trial of each set-up: a promotion, a save whose lease lapses, a re-save of the same id,
    # each racing a deleter in another process stopped between its metadata check and its deletion
    res = chaos.CASE_FUNCS["deleterace"](env, 3, SEED)
    check(res, 3)
    assert res.lost == 0


@pytest.mark.parametrize("case", ["damagedsource", "missingsource"])
def test_copy_source(env, case):
    # issue 32 items 1-2: the S3 object that copy_unchanged copies unchanged frames from gets bytes
    # flipped, or is deleted, truncated or emptied, between promotions ([local] keep = 1): every
    # later save commits on S3 and loads bit-exact from S3 alone
    res = chaos.CASE_FUNCS[case](env, 3, SEED)
    check(res, 3)
    assert res.lost == 0 and res.notes.get("hung") == 0


def test_hungs3term(env):
    # 1 trial (~10 s each; 20 in tools/chaos.py): SIGTERM right after the first save while S3
    # never answers; the local copy stays
    res = chaos.case_hungs3term(env, 1, SEED)
    check(res, 1)
    assert res.lost == 0


def test_sigstorm(env):
    # one trial per handler order (before/after the writer, with/without tierckpt.drain()):
    # SIGTERM every 30 ms, the job stops after its handler counted 1-30 of them and exits 0
    res = chaos.case_sigstorm(env, 4, SEED)
    check(res, 4)
    assert res.lost == 0


def test_new_cases_are_registered():
    for name in ("filetimes", "backlog", "gcload", "killloop", "deleterace"):
        assert name in chaos.CASES and name in chaos.CASE_FUNCS
    assert {"loss-loader", "loss-digests", "race-deleter"} <= set(chaos.CHILDREN)
    assert {"hungs3term", "sigstorm"} <= set(chaos.CASES)
    assert {"sigterm-first", "sigterm-storm"} <= set(chaos.CHILDREN)
    assert "earlykill" in chaos.CASES and "earlykill-saver" in chaos.CHILDREN


def test_resource_checks_tell_a_leak_from_noise():
    MiB = chaos.MiB
    slack = {"rss": 16 * MiB, "threads": 1, "fds": 2}

    def run(samples):
        res = chaos.CaseResult("resources")
        chaos._growth(res, "#0", "saves", samples, 10, slack, {})
        return res.failures

    band = [{"rss": (290 + (i * 7) % 13) * MiB, "threads": 9, "fds": 5} for i in range(30)]  # +-6 MiB of noise
    assert run(band) == 0
    assert run([dict(x, rss=x["rss"] + i * MiB) for i, x in enumerate(band)]) == 1  # 1 MiB per checkpoint
    assert run([dict(x, fds=5 + i // 4) for i, x in enumerate(band)]) == 1  # a descriptor every 4 checkpoints
    assert run([dict(x, threads=9 + (i > 20) * 2) for i, x in enumerate(band)]) == 1


# -- the driver ------------------------------------------------------------------------------------


def test_cli_table_json_and_exit_status(tmp_path, monkeypatch, capsys):
    out = tmp_path / "chaos.json"
    assert chaos.main(["--trials", "2", "--cases", "corrupt", "--s3", "none", "--seed", "7", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "case" in text and "failures" in text and "lost" in text and "corrupt" in text
    doc = json.loads(out.read_text())
    assert doc["seed"] == 7 and doc["results"][0]["case"] == "corrupt" and doc["results"][0]["ok"]

    def broken(env, trials, seed):
        r = chaos.CaseResult("corrupt", trials=trials)
        r.lose(0, "simulated silent corruption")
        return r

    monkeypatch.setitem(chaos.CASE_FUNCS, "corrupt", broken)
    assert chaos.main(["--trials", "1", "--cases", "corrupt", "--s3", "none", "--seed", "7"]) == 1
    assert "simulated silent corruption" in capsys.readouterr().out


# -- the bugs the harness found, reproduced deterministically ---------------------------------------


def test_known_bug_resume_without_checkpoint(env):
    """A trainer killed before its first commit must resume by starting fresh."""
    d = env.fresh("known-resume")
    cfg_path = d / "tiers.toml"
    cfg_path.write_text(chaos.toml_text(env.config(d, s3=False)))
    log = d / "run.jsonl"
    p = env.spawn("trainer", {"argv": chaos.trainer_argv(cfg_path, log, 0, "--resume")}, d / "run.out")
    rc = chaos.wait_proc(p, 300)
    events = [e.get("event") for e in chaos.read_events(log)]
    assert rc == 0 and "fresh" in events and "done" in events, chaos.tail(d / "run.out")


def test_known_bug_error_to_other_writer(env):
    """Two writers with one configuration (one engine) save the same id: the one whose state is
    committed must see success, the other its CommitConflict."""
    d = env.fresh("known-writers")
    cfg = config_from_dict(env.config(d, s3=False, local_keep=0, fsync=False))
    a, b = chaos.make_state(1), chaos.make_state(2)
    wa, wb = TieredWriter(cfg), TieredWriter(cfg)
    try:
        assert wa.engine is wb.engine
        dcp.save(a, checkpoint_id="step-000007", storage_writer=wa, no_dist=True)
        early = None
        try:  # if a committed already, b's save is refused up front (DCP wraps the CommitConflict)
            dcp.save(b, checkpoint_id="step-000007", storage_writer=wb, no_dist=True)
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            if "CommitConflict" not in str(e) and "already committed" not in str(e):
                raise
            early = CommitConflict(str(e))
        errors = {}
        for name, w in (("a", wa), ("b", wb)):
            try:
                w.wait()
                errors[name] = None
            except Exception as e:  # noqa: BLE001
                errors[name] = e
        if early is not None:
            assert errors["b"] is None, errors["b"]
            errors["b"] = early
        got, _ = chaos.load_state(cfg, a, "step-000007")
        winner = "a" if not chaos.diff(a, got) else "b" if not chaos.diff(b, got) else None
        assert winner is not None, "the committed checkpoint is neither writer's state"
        loser = "b" if winner == "a" else "a"
        assert errors[winner] is None, f"writer {winner} committed but its wait() raised {errors[winner]!r}"
        assert isinstance(errors[loser], CommitConflict), f"writer {loser} lost but its wait() gave {errors[loser]!r}"
    finally:
        chaos.close_writer(wa)


# -- larger runs, on demand ----------------------------------------------------------------------


@pytest.mark.skipif(not LARGE, reason="set CHAOS_TRIALS=N to run every case with N trials")
@pytest.mark.parametrize("case", chaos.CASES)
def test_large(env, case):
    res = chaos.CASE_FUNCS[case](env, LARGE, SEED)
    print(chaos.format_table([res]))
    check(res, LARGE)
