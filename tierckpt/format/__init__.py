"""Stage ``format``: what a checkpoint is on disk -- ids, file names, the aligned layout, item records,
``metadata.json`` and its JSON codecs, the stored index of encoded files.

What it does: the one definition of every byte a tier holds for a checkpoint, and the only parser
of it (:mod:`.layout`); DCP objects to and from JSON (:mod:`.dcpjson`, with the torch-free checked
values in :mod:`.jsonvalues`); bounded decoding of untrusted JSON (:mod:`.safejson`); the per-tier
index of encoded data files inside ``metadata.json`` (:mod:`.stored`). Pure functions and records:
no tier access, no threads, no collectives.

May import: :mod:`tierckpt.errors`, :mod:`tierckpt.checksum` and the standard library, numpy and
torch (``dcpjson`` only; ``layout`` imports it lazily so the restore CLI's listing stays torch-free).
May be imported by: ``codec``, ``catalog``, ``telemetry``, ``capture``, ``chain``, ``save``,
``load``, integrations, testing and ``restore/``. Not by ``tiers`` or ``config`` (the byte layer
never parses a checkpoint).
"""
