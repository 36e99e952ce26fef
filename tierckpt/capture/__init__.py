"""Stage ``capture``: one rank's save below the DCP layer -- its plan, its record, and the copy of
its state from the device, through a budgeted host pool, to the first durable tier.

What it does: :mod:`.planning` lays out the rank's data file once per plan shape (aligned offsets
known up front, the pieces to copy); :mod:`.ranksave` is the rank's job record that every later
stage carries (what the coordinator assigned it, its futures -- captured, flushed, committed,
replicated -- and its figures); :mod:`.pool` is the host memory budget (every buffer charged to
it), :mod:`.copier` the device-to-host copy engine, and :mod:`.stream` the flush: each chunk, as
it lands, checksummed and written at its offset into the first tier. The training thread waits
only for capture; the rest runs on background threads.

Why here, under ``chain`` rather than inside ``save``: the engine (``chain``) drives capture and
every hop carries the job record, so both sit below the chain; ``save`` is the DCP layer on top.

May import: ``telemetry`` (the phase log), ``catalog`` (the save's lease), ``codec``, ``format``,
``tiers``, ``config`` and the base modules.
May be imported by: ``chain``, ``save``, ``load``, the package root, integrations, testing.
"""
