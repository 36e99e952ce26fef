"""The restore service of tierckpt: what ``tierckpt-restore`` runs, usable as a library.

    from restore import fetch_checkpoint, verify_checkpoint, consolidate_checkpoint, gc_checkpoints

    res = fetch_checkpoint("tiers.toml", "latest", ranks=[rank])       # S3 -> local, resumable
    rep = verify_checkpoint(cfg, "step-000300")                        # rep.ok, rep.problems
    consolidate_checkpoint(cfg, "latest", out="model.safetensors", keys=["model."])
    gc_checkpoints(cfg, dry_run=True).actions
    push_checkpoints(cfg).hops                                          # after an S3 outage
    delete_checkpoints(cfg, every=True).deleted                         # a fresh start

Every function takes a :class:`tierckpt.TierConfig`, a TOML path, or ``None`` for
``$TIERCKPT_CONFIG``, and raises tierckpt's errors (see :mod:`restore.errors` for how the CLI
maps them to messages and exit statuses). The names are imported on first use: the CLI's
``latest``, ``list``, ``verify`` and ``fetch`` never import torch (only ``consolidate`` does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierckpt.lazyexports import lazy_exports

if TYPE_CHECKING:
    from .catalog import Latest, Listing, find_latest, list_all, open_tiers
    from .consolidate import ConsolidateResult, consolidate_checkpoint
    from .errors import NotFound, UsageError, VerificationFailed
    from .export import ExportResult, export_hf
    from .fetch import FetchResult, fetch_checkpoint
    from .gc import GcAction, GcResult, gc_checkpoints
    from .manage import DeleteResult, PushResult, delete_checkpoints, push_checkpoints
    from .verify import Problem, VerifyReport, verify_checkpoint

_LAZY: dict[str, str] = {
    # public name -> the module defining it (imported on first use: consolidate imports torch)
    "Latest": ".catalog",
    "Listing": ".catalog",
    "find_latest": ".catalog",
    "list_all": ".catalog",
    "open_tiers": ".catalog",
    "ConsolidateResult": ".consolidate",
    "consolidate_checkpoint": ".consolidate",
    "NotFound": ".errors",
    "UsageError": ".errors",
    "VerificationFailed": ".errors",
    "ExportResult": ".export",
    "export_hf": ".export",
    "FetchResult": ".fetch",
    "fetch_checkpoint": ".fetch",
    "GcAction": ".gc",
    "GcResult": ".gc",
    "gc_checkpoints": ".gc",
    "DeleteResult": ".manage",
    "PushResult": ".manage",
    "delete_checkpoints": ".manage",
    "push_checkpoints": ".manage",
    "Problem": ".verify",
    "VerifyReport": ".verify",
    "verify_checkpoint": ".verify",
}

__all__ = [
    "ConsolidateResult",
    "DeleteResult",
    "ExportResult",
    "FetchResult",
    "GcAction",
    "GcResult",
    "Latest",
    "Listing",
    "NotFound",
    "Problem",
    "PushResult",
    "UsageError",
    "VerificationFailed",
    "VerifyReport",
    "consolidate_checkpoint",
    "delete_checkpoints",
    "export_hf",
    "fetch_checkpoint",
    "find_latest",
    "gc_checkpoints",
    "list_all",
    "open_tiers",
    "push_checkpoints",
    "verify_checkpoint",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
