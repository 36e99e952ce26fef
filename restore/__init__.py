"""The restore service of tierckpt: what ``tierckpt-restore`` runs, usable as a library.

    from restore import fetch_checkpoint, verify_checkpoint, consolidate_checkpoint, gc_checkpoints

    res = fetch_checkpoint("tiers.toml", "latest", ranks=[rank])       # S3 -> local, resumable
    rep = verify_checkpoint(cfg, "step-000300")                        # rep.ok, rep.problems
    consolidate_checkpoint(cfg, "latest", out="model.safetensors", keys=["model."])
    gc_checkpoints(cfg, dry_run=True).actions

Every function takes a :class:`tierckpt.TierConfig`, a TOML path, or ``None`` for
``$TIERCKPT_CONFIG``, and raises tierckpt's errors (see :mod:`restore.errors` for how the CLI
maps them to messages and exit statuses).
"""

from .catalog import Latest, Listing, find_latest, list_all, open_tiers
from .consolidate import ConsolidateResult, consolidate_checkpoint
from .errors import NotFound, UsageError, VerificationFailed
from .fetch import FetchResult, fetch_checkpoint
from .gc import GcAction, GcResult, gc_checkpoints
from .verify import Problem, VerifyReport, verify_checkpoint

__all__ = [
    "ConsolidateResult",
    "FetchResult",
    "GcAction",
    "GcResult",
    "Latest",
    "Listing",
    "NotFound",
    "Problem",
    "UsageError",
    "VerificationFailed",
    "VerifyReport",
    "consolidate_checkpoint",
    "fetch_checkpoint",
    "find_latest",
    "gc_checkpoints",
    "list_all",
    "open_tiers",
    "verify_checkpoint",
]
