"""Chaos cases for "no committed checkpoint is ever lost", registered in ``tools/chaos.py``:

    python tools/chaos.py --trials 50 --cases filetimes,backlog,gcload,killloop,deleterace

``filetimes`` (file times changed under committed checkpoints), ``backlog`` (a restart with
checkpoints committed locally but never promoted), ``gcload`` (gc and keep=1 retention racing
loads in another process) and ``killloop`` (the issue's repro: SIGKILL and restart from latest + 1,
over and over), and ``deleterace`` (a deleter in another process racing saves, promotions and
re-saves of the same id: a commit and a deletion of one id never both succeed). Each is ``case_<name>(env, trials, seed) -> CaseResult`` on chaos.py's helpers;
its docstring says what it checks. A committed checkpoint that cannot be loaded bit-exact, or a
load that returns wrong bytes, is ``lost``.

The cases live in ``tools/chaoslib/`` (``filetimes``, ``backlog``, ``gcload``, ``killloop``; their
helpers in ``loss``); this module registers them (imported at the end of chaos.py).
"""

from __future__ import annotations

import chaos
from chaoslib.backlog import case_backlog
from chaoslib.deleterace import _deleter_child, case_deleterace
from chaoslib.filetimes import case_filetimes
from chaoslib.gcload import _loader_child, case_gcload
from chaoslib.killloop import _digests_child, case_killloop

CASE_FUNCS = {
    "filetimes": case_filetimes,
    "backlog": case_backlog,
    "gcload": case_gcload,
    "killloop": case_killloop,
    "deleterace": case_deleterace,
}
chaos.register_cases(
    CASE_FUNCS, {"loss-loader": _loader_child, "loss-digests": _digests_child, "race-deleter": _deleter_child}
)
