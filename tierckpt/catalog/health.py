"""Whether a committed checkpoint is fit to resume from: bad marks, NaN/Inf counts, corruption.

A checkpoint is *unhealthy* when

* it is **marked bad**: ``ID/bad.json`` (:data:`BAD`, a small JSON object: reason, who, when)
  lies beside its metadata on some tier. :func:`mark_bad` (``tierckpt-restore mark ID bad
  --reason ...``, or a resume check that raised: :func:`tierckpt.resume.resume`) writes it on every
  tier that holds the checkpoint committed; it goes with the checkpoint when that is deleted;
* its metadata records **NaN/Inf** values (``items[].nonfinite``, written by the capture under
  ``[job] nonfinite = "warn"``: :mod:`tierckpt.capture.verify`);
* it is **corrupt on every tier**: no tier's metadata passes its CRC32C and checks (the catalog's
  ``latest`` already skips such a checkpoint; a damaged *data* file is found when it is loaded,
  and :func:`tierckpt.resume.resume` then marks it bad and falls back).

``tierckpt.latest(cfg, healthy=True)`` skips unhealthy checkpoints, ``list_checkpoints`` and
``tierckpt-restore list`` show the mark, and retention never keeps a marked checkpoint as the
newest (:func:`tierckpt.chain.retention.plan_retention`). This module does not import torch.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import time
from typing import Any

from ..errors import CheckpointNotFound, CorruptCheckpoint, TierckptError
from ..format.layout import check_checkpoint_id, metadata_key
from ..format.metadata import CheckpointDoc

__all__ = ["BAD", "bad_key", "mark_bad", "read_mark", "unhealthy", "nonfinite_items"]

log = logging.getLogger("tierckpt.catalog")

BAD = "bad.json"
"""The bad mark's name inside a checkpoint (beside ``metadata.json``)."""
MAX_REASON = 1000


def bad_key(checkpoint_id: str) -> str:
    """The tier key of ``checkpoint_id``'s bad mark."""
    return f"{check_checkpoint_id(checkpoint_id)}/{BAD}"


def mark_bad(tiers: list[Any], checkpoint_id: str, reason: str, *, by: str | None = None) -> list[str]:
    """Mark ``checkpoint_id`` bad on every tier of ``tiers`` that holds it committed; return those
    tiers' names. Raises :class:`CheckpointNotFound` when no tier holds it committed (a tier that
    cannot be reached is logged and skipped unless it was the only chance). Idempotent: a later
    mark replaces the reason."""
    body = json.dumps(
        {
            "checkpoint_id": checkpoint_id,
            "reason": str(reason)[:MAX_REASON],
            "by": by or f"{_user()}@{socket.gethostname()}:{os.getpid()}",
            "marked": time.time(),
        }
    ).encode()
    done: list[str] = []
    errors: list[Exception] = []
    for tier in tiers:
        try:
            if not tier.exists(metadata_key(checkpoint_id)):
                continue
            tier.put(bad_key(checkpoint_id), body)
            done.append(tier.name)
        except (TierckptError, OSError) as e:
            log.warning("cannot mark %s bad on %s: %s", checkpoint_id, tier.url, e)
            errors.append(e)
    if not done:
        if errors:
            raise errors[0]
        raise CheckpointNotFound(
            f"cannot mark {checkpoint_id} bad: no tier holds it committed ({', '.join(t.url for t in tiers)})"
        )
    log.warning("marked checkpoint %s bad on %s: %s", checkpoint_id, ", ".join(done), reason)
    return done


def read_mark(tier: Any, checkpoint_id: str) -> dict | None:
    """``checkpoint_id``'s bad mark on ``tier`` (``{"reason", "by", "marked"}``), None when it has
    none. A mark that does not parse still marks the checkpoint bad (reason says so)."""
    key = bad_key(checkpoint_id)
    try:
        raw = tier.get(key, 0, min(tier.size(key), 64 * 1024))
    except CheckpointNotFound:
        return None
    try:
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("not an object")
        return {"reason": str(d.get("reason", ""))[:MAX_REASON], "by": str(d.get("by", "")), "marked": d.get("marked")}
    except ValueError:
        return {"reason": f"unreadable bad mark on {tier.name}", "by": "", "marked": None}


def nonfinite_items(doc: CheckpointDoc) -> dict[str, int]:
    """The items of a checkpoint whose capture counted NaN/Inf values, by key: ``{fqn: count}``."""
    out: dict[str, int] = {}
    for idx, rec in doc.items:
        if rec.nonfinite:
            out[idx.fqn] = out.get(idx.fqn, 0) + rec.nonfinite
    return out


def unhealthy(tiers: list[Any], checkpoint_id: str, doc: CheckpointDoc | None = None) -> str | None:
    """Why ``checkpoint_id`` is unfit to resume from (see the module docstring), or None.
    ``doc``: its parsed metadata when the caller has it (else it is read from the first tier
    whose copy parses)."""
    from .listing import read_checkpoint_doc

    for tier in tiers:
        try:
            mark = read_mark(tier, checkpoint_id)
        except (TierckptError, OSError) as e:
            log.warning("cannot look for a bad mark of %s on %s: %s", checkpoint_id, tier.url, e)
            continue
        if mark is not None:
            return f"marked bad ({mark['reason'] or 'no reason given'}; by {mark['by'] or 'unknown'})"
    if doc is None:
        errs: list[str] = []
        for tier in tiers:
            try:
                doc = read_checkpoint_doc(tier, checkpoint_id)
                break
            except CheckpointNotFound:
                continue
            except (CorruptCheckpoint, TierckptError, OSError) as e:
                errs.append(str(e))
        if doc is None:
            return f"corrupt on every tier ({errs[0]})" if errs else "committed on no tier"
    bad = nonfinite_items(doc)
    if bad:
        shown = ", ".join(f"{k} ({v})" for k, v in list(bad.items())[:4])
        return f"NaN/Inf recorded at capture in {len(bad)} tensor(s): {shown}"
    return None


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
