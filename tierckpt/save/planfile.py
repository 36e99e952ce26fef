"""The ``_plans/`` file: one rank's cached DCP plans as persisted on the local tier, and its format.

``_plans/g<global rank>.json`` is a header line (format, SHA-256 and length of the body) followed by
a JSON body: the plan cache key, torch version, world size, ranks, this rank's local and final
plans and, on the coordinator, every rank's plans and the metadata (DCP objects through
:mod:`tierckpt.format.dcpjson`). :func:`to_bytes` writes one from a :class:`Snapshot` (references
taken on the saving thread); :func:`from_bytes` validates one read back into
:class:`PersistedPlans`, refusing anything malformed with :class:`~tierckpt.errors.CorruptCheckpoint`.
Pure encoding: :mod:`tierckpt.save.plancache` decides when plans are written, read and reused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from ..errors import CorruptCheckpoint
from ..format.dcpjson import decode_metadata, decode_plan, digest, encode_metadata, encode_plan

__all__ = ["PLAN_DIR", "FORMAT", "PersistedPlans", "Snapshot", "plan_key", "to_bytes", "from_bytes"]

PLAN_DIR = "_plans"  # on the local tier; "_" + a name that is no shard: never listed as a checkpoint
FORMAT = "tierckpt-plans/1"


@dataclass
class PersistedPlans:
    """One process's persisted share of DCP's plan cache (see the module docstring)."""

    key: str  # DCP's cache key (the planner's class name)
    torch_version: str
    world: int
    rank: int  # group rank
    global_rank: int
    coord_global: int  # the coordinator's global rank
    local: SavePlan
    final: SavePlan
    h_local: str
    h_final: str
    # coordinator only (its own local and final plans are all_plans[rank] and global_plans[rank])
    members: list[int] | None = None  # global rank of every group rank
    all_plans: list[SavePlan] | None = None
    global_plans: list[SavePlan] | None = None
    metadata: Metadata | None = None
    hashes: list[list[str]] | None = None  # per group rank: [h_local, h_final]

    @property
    def is_coordinator(self) -> bool:
        return self.all_plans is not None


def plan_key(global_rank: int) -> str:
    return f"{PLAN_DIR}/g{global_rank:05d}.json"


def _with_hash(enc: dict) -> tuple[dict, str]:
    return enc, digest(enc)


def to_bytes(snap: Snapshot) -> bytes:
    """The file of a snapshot: a header line (format, SHA-256 and length of the body), the body."""
    body: dict[str, Any] = {
        "key": snap.key,
        "torch": torch.__version__,
        "world": snap.world,
        "rank": snap.rank,
        "global_rank": snap.global_rank,
        "coord_global": snap.coord_global,
    }
    if snap.all_plans is not None and snap.global_plans is not None and snap.metadata is not None:
        alls = [encode_plan(x) for x in snap.all_plans]
        globs = [encode_plan(x) for x in snap.global_plans]
        body |= {
            "members": snap.members,
            "all": alls,
            "global": globs,
            "metadata": encode_metadata(snap.metadata),
            "hashes": [[digest(a), digest(g)] for a, g in zip(alls, globs)],
        }
    else:
        loc, fin = encode_plan(snap.local), encode_plan(snap.final)
        body |= {"local": loc, "final": fin, "h_local": digest(loc), "h_final": digest(fin)}
    raw = json.dumps(body, separators=(",", ":")).encode()
    head = json.dumps({"format": FORMAT, "sha256": hashlib.sha256(raw).hexdigest(), "length": len(raw)}).encode()
    return head + b"\n" + raw


def from_bytes(raw: bytes, where: str) -> PersistedPlans:
    """Parse and verify a persisted plan file (the SHA-256 of its body)."""
    head, sep, body_raw = bytes(raw).partition(b"\n")
    try:
        h = json.loads(head) if sep else None
        if not isinstance(h, dict) or h.get("format") != FORMAT:
            raise CorruptCheckpoint(f"{where}: not a {FORMAT} file")
        if h.get("length") != len(body_raw) or h.get("sha256") != hashlib.sha256(body_raw).hexdigest():
            raise CorruptCheckpoint(f"{where}: failed its SHA-256 check")
        body = json.loads(body_raw)
        common: dict[str, Any] = dict(
            key=str(body["key"]),
            torch_version=str(body["torch"]),
            world=int(body["world"]),
            rank=int(body["rank"]),
            global_rank=int(body["global_rank"]),
            coord_global=int(body["coord_global"]),
        )
        if "all" in body:
            alls = [decode_plan(x) for x in body["all"]]
            globs = [decode_plan(x) for x in body["global"]]
            hashes = [[str(a), str(b)] for a, b in body["hashes"]]
            r = common["rank"]
            p = PersistedPlans(
                **common,
                local=alls[r],
                final=globs[r],
                h_local=hashes[r][0],
                h_final=hashes[r][1],
                members=[int(g) for g in body["members"]],
                all_plans=alls,
                global_plans=globs,
                metadata=decode_metadata(body["metadata"]),
                hashes=hashes,
            )
            if not (len(alls) == len(globs) == len(hashes) == len(p.members) == p.world):  # type: ignore[arg-type]
                raise CorruptCheckpoint(f"{where}: plans for {len(alls)} ranks, world size {p.world}")
        else:
            p = PersistedPlans(
                **common,
                local=decode_plan(body["local"]),
                final=decode_plan(body["final"]),
                h_local=str(body["h_local"]),
                h_final=str(body["h_final"]),
            )
    except CorruptCheckpoint:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise CorruptCheckpoint(f"{where}: malformed plan cache ({type(e).__name__}: {e})") from None
    return p


@dataclass
class Snapshot:
    """References to one save's cached DCP plans (taken on the saving thread: cheap)."""

    key: str
    world: int
    rank: int
    global_rank: int
    coord_global: int
    local: SavePlan
    final: SavePlan
    members: list[int] | None = None
    all_plans: list[SavePlan] | None = None
    global_plans: list[SavePlan] | None = None
    metadata: Metadata | None = None

    def ident(self) -> tuple:
        return (
            self.key,
            self.world,
            self.rank,
            id(self.local),
            id(self.final),
            id(self.all_plans),
            id(self.global_plans),
            id(self.metadata),
        )
