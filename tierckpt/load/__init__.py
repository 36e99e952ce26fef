"""Stage ``load``: the DCP ``StorageReader`` layer and the one verified read engine.

What it does: :class:`~tierckpt.load.reader.TieredReader` answers DCP's load calls: it resolves
``latest``, has the ranks agree on what to read at a per-rank cost that does not grow with the job
(:mod:`.agreement`), and reads every item through :mod:`.readback` -- per file, the fastest tier
holding a committed copy, merged parallel reads, a CRC32C check of every byte, the next tier on a
mismatch or an absence -- which ``restore/`` (verify, fetch, consolidate) uses too. While it
reads from a slower tier it can fill the local one (:mod:`.fill`). Runs on the thread calling
``dcp.load`` and a small pool of reader threads. In a distributed load every rank checks in
(:mod:`tierckpt.chain.checkin`) before the agreement and at the end of its reads, so a rank that
died is named by every other.

May import: ``chain`` (the peer group, the commit channel and the check-ins), ``capture``, ``telemetry``,
``catalog``, ``codec``, ``format``, ``tiers``, ``config`` and the base modules. Not ``save``.
May be imported by: the package root (the public API), integrations, testing and ``restore/``.
"""
