"""Test helpers shared by ``tests/`` and ``tools/``: state builders, bit-exact comparisons, error
lookups and the multi-rank launcher (real processes joined by gloo).

Nothing here is imported by ``tierckpt`` itself; importing this package costs nothing until a
name is used (each name is loaded from its module on first access). No module imports pytest.

Public surface::

    from tierckpt.testing import bits, placeholder, clone_state     # state builders (state.py)
    from tierckpt.testing import raw, compare                       # bit-exact comparison (bitexact.py)
    from tierckpt.testing import errors_in, find_error, err_text    # errors inside DCP's wrappers (errors.py)
    from tierckpt.testing import free_port, launch_ranks, run_world, serve  # multi-rank launcher (launch.py)
    from tierckpt.testing import FaultyTier                          # a fault-injecting tier (faults.py)

Imported by module (not re-exported): ``tierckpt.testing.counting`` (per-process counters of S3
requests, collective bytes and store operations) and ``tierckpt.testing.scale`` (the many-rank
harness that runs a job through save, restart and losses with those counters; its ranks are
``scale_worker.py``).

No module is named
like a function it exports (``compare`` lives in ``bitexact``): importing a submodule sets an
attribute of this package, which would shadow the function.

Stage ``testing`` (top): May import every stage. May be imported by nothing in ``tierckpt``
(tests and tools only).
"""

from __future__ import annotations

from ..lazyexports import lazy_exports

_WHERE = {
    "bits": ".state",
    "placeholder": ".state",
    "clone_state": ".state",
    "raw": ".bitexact",
    "compare": ".bitexact",
    "errors_in": ".errors",
    "find_error": ".errors",
    "err_text": ".errors",
    "free_port": ".launch",
    "rank_env": ".launch",
    "launch_ranks": ".launch",
    "run_world": ".launch",
    "serve": ".launch",
    "can_hide_paths": ".launch",
    "hide_paths": ".launch",
    "FaultyTier": ".faults",
}

__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(__name__, _WHERE)  # each name loaded from its module on first use
