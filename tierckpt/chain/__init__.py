"""Stage ``chain``: one checkpoint's life after capture -- flush, commit, and every hop down the tiers.

What it does: the per-process :class:`~tierckpt.chain.engine.Engine` (threads, error routing: a
background error surfaces on the next wait and in the log) runs each rank's job through the one
commit protocol (:mod:`.commit`: every rank durable, the coordinator merges, metadata last), then
through one :class:`~tierckpt.chain.replicate.Replicator` per hop (``local -> peer node(s) ->
object store(s)``; :mod:`.peercopy` for the peer hop over :mod:`.peers`, :mod:`.encodedhop` for
hops into tiers that store encoded files), and applies retention (:mod:`.retention`). :mod:`.checkin` names a rank missing before DCP's
collectives of a save or a load (used by ``save`` and ``load``). Background
threads only; none issues a collective on the training process group (they talk over the store).

May import: ``capture``, ``telemetry``, ``catalog``, ``codec``, ``format``, ``tiers``, ``config``
and the base modules (:mod:`tierckpt.errors`, :mod:`tierckpt.checksum`, :mod:`tierckpt.background`).
May be imported by: ``save``, ``load`` (the peer group serving files during a load), the package
root, integrations, testing and ``restore/``.
"""
