"""Stage ``save``: the DCP ``StorageWriter`` layer -- plans in, futures out.

What it does: :class:`~tierckpt.save.writer.TieredWriter` turns DCP's save calls into one rank's
job for the engine (:mod:`tierckpt.chain.engine`); around it, the plan channel that fills in what
DCP's plan caching leaves out (:mod:`.planchannel`), the check-in that names a rank missing from a
save's planning (:mod:`tierckpt.chain.checkin`), the plan cache persisted across restarts
(:mod:`.plancache`), ``dcp.async_save`` tickets (:mod:`.asyncsave`), holding a save's capture
until ``dcp.save`` is done with the CPU (:mod:`.hold`), and draining saves on SIGTERM
(:mod:`.preempt`). Runs on the thread calling ``dcp.save``, on every rank; the collectives are
DCP's own.

May import: every stage below it -- ``chain``, ``capture``, ``telemetry``, ``catalog``, ``codec``,
``format``, ``tiers``, ``config`` -- and the base modules. Not ``load`` (its peer).
May be imported by: the package root (the public API), integrations, testing, ``restore/``.

``tierckpt.save`` was a module (one rank's part of a checkpoint) before it became this package:
its names now live in :mod:`tierckpt.capture.ranksave` and are still served from here for one
release, with a :class:`DeprecationWarning`.
"""

from __future__ import annotations

from ..moved import deprecated_names

__getattr__ = deprecated_names(
    __name__, {name: "tierckpt.capture.ranksave" for name in ("RankAssign", "SaveStats", "RankSave", "build_metadata")}
)
