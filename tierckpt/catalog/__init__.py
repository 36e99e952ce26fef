"""Stage ``catalog``: what the tiers hold, in commit order, and who is using it.

What it does: lists checkpoints per tier and orders them by what their commit wrote, never by a
clock on a file (:mod:`.listing`: ``latest``, committed headers, servability); the public catalog
over the whole chain (:mod:`.checkpoints`: ``tierckpt.latest``, ``tierckpt.list_checkpoints``);
other nodes' node-local tiers as this process sees them (:mod:`.nodes`); leases and tombstones,
so that no deletion pulls a checkpoint from under a reader or a writer (:mod:`.lease`). Reads and
small writes (leases) on tiers; no threads besides the lease renewer, no collectives.

May import: ``format``, ``tiers``, ``config``, and the base modules (:mod:`tierckpt.errors`, ...).
May be imported by: ``telemetry``, ``capture``, ``chain``, ``save``, ``load``, integrations,
testing and ``restore/``. Not by ``codec``, ``format``, ``tiers`` or ``config``.

``tierckpt.catalog`` was a module before it became this package: its names (those of
:mod:`.listing`) are still served from here, imported on first use so that importing the package
stays cheap (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazyexports import lazy_exports

if TYPE_CHECKING:
    from .listing import (
        CheckpointInfo,
        Latest,
        commit_header,
        committed_headers,
        committed_in_order,
        find_latest,
        is_committed,
        list_checkpoints,
        max_seq,
        order_of,
        parse_checkpoint_doc,
        read_checkpoint_doc,
        read_checkpoint_metadata,
        read_checkpoint_raw,
        resolve_latest,
        servable,
    )

__all__ = [
    "CheckpointInfo",
    "Latest",
    "list_checkpoints",
    "committed_in_order",
    "resolve_latest",
    "find_latest",
    "is_committed",
    "read_checkpoint_metadata",
    "read_checkpoint_doc",
    "read_checkpoint_raw",
    "parse_checkpoint_doc",
    "committed_headers",
    "commit_header",
    "max_seq",
    "servable",
    "order_of",
]

__getattr__, __dir__ = lazy_exports(__name__, {name: ".listing" for name in __all__})
