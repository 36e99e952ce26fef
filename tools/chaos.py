"""Chaos harness for tierckpt: kills, faults, corruption, races, leaks and a flaky S3, over many trials.

    python tools/chaos.py --trials N [--cases crash,faults,corrupt,concurrency,resources,s3faults,
                                              damagedsource,missingsource,earlykill,exportkill,filetimes,backlog,
                                              gcload,killloop,deleterace,hungs3term,sigstorm]
                          [--s3 moto|seaweedfs|none] [--json out.json] [--seed S] [--keep]

Prints one row per case (case | trials | failures | lost | seconds | notes) and exits non-zero on
any failure. ``lost`` counts committed checkpoints that could not be loaded bit-exact and loads
that returned wrong bytes without an error; it must be 0. ``failures`` counts every broken
invariant (``lost`` ones included). Every case is a function ``case_<name>(env, trials, seed)``
returning a :class:`CaseResult`, usable from tests (``tests/test_chaos.py``).

Cases:

crash
    A small GPT-style trainer (``tools/train_gpt.py``, a checkpoint every 2 steps through host
    pool -> local tier -> S3) dies by SIGKILL, either at a random time (after a random step plus a
    random delay) or at a named point inside the tiers (``tools/chaos_tiers.py``: the k-th chunk
    write, data-file close, local or S3 metadata put, S3 upload, retention delete, or right after
    ``dcp.save`` returned with the capture pending). Afterwards: every committed checkpoint on each
    tier loads bit-exact and equals the reference digest of its step (from an uninterrupted run
    with DCP's own writer); ``latest`` loads and is the newest of them; every uncommitted checkpoint
    is refused (CheckpointNotFound); a ``--resume`` run (sometimes after deleting the local tier: a
    lost node) restarts from the right state and ends bit-identical to the reference run.
faults
    ENOSPC / EROFS injected into a local write, open, close or metadata put during a save:
    ``writer.wait()`` raises a TierckptError naming the checkpoint and the cause; the previous
    checkpoints still load bit-exact; the failed one is refused; the next save (same or new id)
    commits and loads bit-exact.
corrupt
    One random byte of one random data or metadata file, on either tier, is flipped: the load
    fails with a tierckpt error, or succeeds bit-exact (from the other tier's intact copy); a
    load that returns other bytes is ``lost``. With both tiers holding an intact copy of
    everything the load must succeed.
concurrency
    Two writers save the same checkpoint id at the same moment (two threads on one engine, two
    engines sharing a local path and/or an S3 prefix, two processes): exactly one commits per
    tier, the other fails with a tierckpt error, and the committed copy is exactly one writer's
    state (the one that reported success), never a mix.
resources
    30 checkpoints in a row through a small host pool (in a fresh process): RSS, threads and open
    file descriptors stay flat after warm-up.
s3faults
    Promotions through a proxy failing 10% of S3 requests (5% 500/503 answers, 5% dropped
    connections): each promotion completes or fails with a tierckpt error; every checkpoint
    committed on S3 loads bit-exact from S3 alone; every reported success is committed on S3.
hungs3term
    ``[s3]`` at a loopback port that accepts connections and never answers, ``drain_timeout = 8``:
    SIGTERM 0-0.5 s after the first ``dcp.save`` returned. The job ends by the signal within the
    drain timeout (else *hung*) and step-000001 is ``latest`` on the local tier, bit-exact (else
    lost): the first commit never waits on S3 (``tools/chaoslib/sigterm.py``).
sigstorm
    SIGTERM every 30 ms at a job saving every step with ``wait_captured()``, whose own "stop after
    this step" handler is installed before the writer (tierckpt chains to it) or after it, calling
    ``tierckpt.drain()`` or not: it stops after 1-30 signals, ``wait()``s and exits 0 (else
    *hung* after 60 s of storm); its last checkpoint is ``latest`` and bit-exact.
earlykill
    A loop saving ~14 MiB every step (``dcp.save`` + ``wait_captured()``, one local tier) is
    SIGKILLed 1-3 s after it created its writer: ``latest`` must exist and load bit-exact the state
    of its step (else ``lost``), and trail the saves whose data files were durable by at most a few
    steps (commits keep up with the disk; ``tools/chaoslib/earlykill.py``).
exportkill
    ``tierckpt-restore export --format hf`` SIGKILLed at a random moment of its run: the output
    folder is absent or complete (every file byte-equal to a reference export), the next run
    completes, no partial folder is left (``tools/chaoslib/exportkill.py``; needs ``.[hf]``).
filetimes, backlog, gcload, killloop, deleterace
    No committed checkpoint is ever lost: file-time changes, a restart with an unpromoted
    backlog, gc racing loads, a trainer SIGKILLed and restarted from latest + 1 in a loop, and
    a deleter in another process racing saves, promotions and re-saves of the same id, paused
    between its metadata check and its data deletion (``tools/chaos_loss.py``, registered below
    with :func:`register_cases`).

damagedsource, missingsource
    ``[s3] compression = "zstd"``, ``copy_unchanged = true``, ``[local] keep = 1``: the S3 object
    that later checkpoints copy their unchanged frames from gets bytes flipped in its frames
    (``damagedsource``), or is deleted, truncated or emptied (``missingsource``), between two
    promotions. Every later save succeeds and loads bit-exact from S3 alone; the damaged
    checkpoint is refused clearly, never loaded with other bytes; a trial that outlives
    ``TRIAL_TIMEOUT`` is counted ``hung`` (``tools/chaoslib/copysafety.py``).

Trainer runs are forked from a preloaded zygote process (torch imported once), so a crash trial
costs about two short training runs plus a handful of loads.

This file is the command line and the case registry; the cases live in ``tools/chaoslib/`` (one
module per case or pair of cases, ``core`` and ``env`` for what they share) and in
``tools/chaos_loss.py``. Every name the cases and tests use is re-exported here (``chaos.Env``,
``chaos.case_crash``, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

# re-exported: the cases, tests/test_chaos.py and the zygote (``chaos._zygote_main``) use them as ``chaos.X``
from chaoslib.concurrency import CONC_SCENARIOS, _concurrent_save_child, case_concurrency  # noqa: E402,F401
from chaoslib.copysafety import case_damagedsource, case_missingsource  # noqa: E402,F401
from chaoslib.core import (  # noqa: E402,F401
    BUCKET,
    KNOWN_BUGS,
    CaseResult,
    MiB,
    format_table,
    is_clear,
    is_not_found,
    load_state,
    make_state,
    mutate,
    only,
    placeholder,
    short,
    toml_text,
)
from chaoslib.crash import (  # noqa: E402,F401
    KILL_POINTS,
    STAGE_OF,
    TRAIN,
    Reference,
    case_crash,
    check_tiers,
    choose_kill,
    load_app,
    read_events,
    reference,
    trainer_argv,
)
from chaoslib.earlykill import CHILDREN as _EARLYKILL_CHILDREN  # noqa: E402
from chaoslib.earlykill import case_earlykill  # noqa: E402,F401
from chaoslib.env import CHILDREN, Child, Env, Zygote, _child_main, _zygote_main, tail, wait_proc  # noqa: E402,F401
from chaoslib.exportkill import case_exportkill  # noqa: E402,F401
from chaoslib.faults import (  # noqa: E402,F401
    FAULT_OPS,
    case_corrupt,
    case_faults,
    close_writer,
    expect_loads,
    expect_refused,
    leftovers,
    save_wait,
)
from chaoslib.resources import _growth, _resources_child, case_resources, case_s3faults  # noqa: E402,F401
from chaoslib.sigterm import CHILDREN as SIGTERM_CHILDREN  # noqa: E402
from chaoslib.sigterm import case_hungs3term, case_sigstorm  # noqa: E402,F401

from tierckpt.testing import clone_state, errors_in, find_error, raw  # noqa: E402,F401
from tierckpt.testing import compare as diff  # noqa: E402,F401

CASES = (
    "crash",
    "faults",
    "corrupt",
    "concurrency",
    "resources",
    "s3faults",
    "damagedsource",
    "missingsource",
    "hungs3term",
    "sigstorm",
    "earlykill",
    "exportkill",
)


# == driver ========================================================================================

CASE_FUNCS: dict[str, Callable[..., CaseResult]] = {
    "crash": case_crash,
    "faults": case_faults,
    "corrupt": case_corrupt,
    "concurrency": case_concurrency,
    "resources": case_resources,
    "s3faults": case_s3faults,
    "damagedsource": case_damagedsource,
    "missingsource": case_missingsource,
    "hungs3term": case_hungs3term,
    "sigstorm": case_sigstorm,
    "earlykill": case_earlykill,
    "exportkill": case_exportkill,
}
# zygote child kinds (``_child_main`` dispatches to them; other modules add theirs)
CHILDREN.update(
    {
        "resources": _resources_child,
        "concurrent-save": _concurrent_save_child,
        **SIGTERM_CHILDREN,
        **_EARLYKILL_CHILDREN,
    }
)


def register_cases(
    funcs: dict[str, Callable[..., CaseResult]], children: dict[str, Callable[[dict], int]] | None = None
) -> None:
    """Add cases kept in other modules to :data:`CASES`/:data:`CASE_FUNCS` (and their zygote children)."""
    global CASES
    CASE_FUNCS.update(funcs)
    CASES = CASES + tuple(n for n in funcs if n not in CASES)
    CHILDREN.update(children or {})


def run_cases(
    env: Env, cases: list[str], trials: int, seed: int, progress: Callable[[CaseResult], None] | None = None
) -> list[CaseResult]:
    out = []
    for name in cases:
        t0 = time.perf_counter()
        try:
            r = CASE_FUNCS[name](env, trials, seed)
        except BaseException as e:  # noqa: BLE001 - a broken case is a failure, not a crash of the harness
            r = CaseResult(name)
            r.fail("setup", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            r.seconds = time.perf_counter() - t0
        out.append(r)
        if progress is not None:
            progress(r)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5, help="trials per case")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    ap.add_argument("--s3", choices=["moto", "seaweedfs", "none"], default="moto")
    ap.add_argument("--json", default="", help="write the results (with every problem) here")
    ap.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASE_FUNCS]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    torch.set_num_threads(1)
    print(f"[chaos] seed {seed}, {args.trials} trials per case, cases {','.join(cases)}, S3: {args.s3}", flush=True)
    t0 = time.perf_counter()

    def progress(r: CaseResult) -> None:
        print(
            f"[chaos] {r.case}: {r.trials} trials, {r.failures} failures, {r.lost} lost in {r.seconds:.1f} s",
            flush=True,
        )

    with Env(args.s3, keep=args.keep) as env:
        if args.keep:
            print(f"[chaos] working in {env.work}", flush=True)
        results = run_cases(env, cases, args.trials, seed, progress)
    total = time.perf_counter() - t0
    print()
    print(format_table(results))
    print(f"\n{total:.1f} s in all; rerun with --seed {seed}")
    problems = [p for r in results for p in r.problems]
    if problems:
        print(f"\n{len(problems)} problem(s):")
        for p in problems[:50]:
            print("  " + p)
        if len(problems) > 50:
            print(f"  ... and {len(problems) - 50} more (see --json)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "seed": seed,
                    "trials": args.trials,
                    "s3": args.s3,
                    "seconds": total,
                    "results": [r.to_json() for r in results],
                },
                indent=2,
            )
        )
    return 0 if all(r.ok for r in results) else 1


# More cases live in their own modules and register themselves; run as a script, this module is
# also ``chaos`` for them (one set of classes and tables, not a second copy).
sys.modules.setdefault("chaos", sys.modules[__name__])
import chaos_loss  # noqa: E402,F401 - filetimes, backlog, gcload, killloop

if __name__ == "__main__":
    sys.exit(main())
