"""The scale harness: what tierckpt's coordination costs per rank, counted in real processes.

:func:`run_scale` runs one job of ``world`` ranks (``ranks_per_node`` per simulated node,
``[local] path = ".../{node}"`` plus ``[s3]``) through the phases below, each rank in fresh
processes (:mod:`tierckpt.testing.scale_worker`, gloo) counting its own S3 requests, object- and
tensor-collective traffic and store operations (:mod:`tierckpt.testing.counting`):

* ``first_save``, ``save``: two saves (steps 1 and 2), each waited for until committed on every
  tier; the second is the steady state (clients, plans and groups exist already). Same processes.
* ``restart``: new processes ``dcp.load("latest")`` with every file on the local disks.
* ``node_loss``: the last node's directory is deleted, then the same load.
* ``full_loss``: every local directory is deleted, then the same load (from S3).
* ``dcp_save``, ``dcp_load``: the same state with DCP's own ``FileSystemWriter``/``FileSystemReader``
  on one shared directory: the baseline of object-collective bytes.

Every load is compared bit for bit; a rank that fails or loads wrong data raises
:class:`AssertionError` here. :func:`summarize` turns a phase's per-rank counts into the
headline numbers (the same shape a simulator should produce, so both can share one report).
The parent side imports neither torch nor boto3.
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .counting import OBJECT_COLLECTIVES, collapse, merge
from .launch import run_world

__all__ = ["PHASES", "LOAD_PHASES", "WRITE_CLASS", "READ_CLASS", "run_scale", "summarize", "s3_class", "scale_config"]

WORKER = Path(__file__).with_name("scale_worker.py")
MiB = 1 << 20

PHASES = ("first_save", "save", "restart", "node_loss", "full_loss", "dcp_save", "dcp_load")
LOAD_PHASES = ("restart", "node_loss", "full_loss")

WRITE_CLASS = frozenset(
    {
        "PutObject",
        "CopyObject",
        "UploadPart",
        "UploadPartCopy",
        "CreateMultipartUpload",
        "CompleteMultipartUpload",
        "AbortMultipartUpload",
        "DeleteObject",
        "DeleteObjects",
        "PutObjectTagging",
        "DeleteObjectTagging",
    }
)
"""S3 operations under the documented 3,500 PUT/COPY/POST/DELETE requests per second per prefix."""
READ_CLASS = frozenset(
    {
        "GetObject",
        "HeadObject",
        "ListObjectsV2",
        "ListObjects",
        "ListMultipartUploads",
        "ListParts",
        "HeadBucket",
        "GetObjectTagging",
        "GetObjectAttributes",
    }
)
"""S3 operations under the documented 5,500 GET/HEAD requests per second per prefix (LISTs included)."""

P2P = ("isend", "irecv", "send", "recv")


def s3_class(op: str) -> str:
    """``"write"`` (PUT/COPY/POST/DELETE rate), ``"read"`` (GET/HEAD rate) or ``"other"``."""
    return "write" if op in WRITE_CLASS else "read" if op in READ_CLASS else "other"


def scale_config(base: Path, s3: dict[str, Any]) -> dict[str, Any]:
    """The job's configuration as ``config_from_dict`` takes it: a small host pool, node-local
    ``[local]`` without fsync under ``base/local/{node}``, ``[s3]`` as given."""
    return {
        "host": {"buffer_size": "16MiB", "chunk_size": "4MiB", "pinned": False},
        "local": {"path": f"{base}/local/{{node}}", "fsync": False, "flush_threads": 1},
        "s3": dict(s3),
        "job": {"commit_timeout": 300.0},
    }


def _strip(section: dict[str, Any]) -> dict[str, Any]:
    """``section`` without its None values (what a TOML file cannot hold)."""
    return {k: v for k, v in section.items() if v is not None}


def _sub(name: str) -> str:
    return name.split("[", 1)[0]


def summarize(per_rank: list[dict], world: int) -> dict[str, Any]:
    """The headline counts of one phase from each rank's counts (:func:`~.counting.collapse`d):

    ``s3_requests`` (API calls, all ranks), ``s3_attempts`` (HTTP attempts, retries included),
    ``s3_by_op``, ``s3_read``/``s3_write`` (by S3's rate classes), ``s3_per_rank_max``;
    ``obj_recv_bytes`` (pickled bytes received through object collectives, all ranks),
    ``obj_calls`` (object collectives per rank, the most of any rank), ``rounds`` (collective
    calls of any kind but point-to-point, the most of any rank: rounds on the critical path),
    ``p2p_recv_bytes``, ``tensor_recv_bytes`` (tensor collectives but point-to-point),
    ``store_ops`` (all ranks, polls that found nothing excluded), ``store_polls`` (those),
    ``groups`` (process groups created, the most of any rank).
    """
    total = merge(per_rank)
    by_op = Counter(total["s3"]["calls"])
    out: dict[str, Any] = {
        "world": world,
        "s3_requests": sum(by_op.values()),
        "s3_attempts": sum(total["s3"]["attempts"].values()),
        "s3_by_op": dict(sorted(by_op.items())),
        "s3_read": sum(n for op, n in by_op.items() if s3_class(op) == "read"),
        "s3_write": sum(n for op, n in by_op.items() if s3_class(op) == "write"),
        "s3_per_rank_max": max((sum(r["s3"]["calls"].values()) for r in per_rank), default=0),
        "obj_recv_bytes": sum(v.get("recv_bytes", 0) for v in total["obj"].values()),
        "obj_by_name": {k: dict(v) for k, v in sorted(total["obj"].items())},
        "obj_calls": max((sum(v.get("calls", 0) for v in r["obj"].values()) for r in per_rank), default=0),
        "rounds": max(
            (
                sum(v.get("calls", 0) for v in r["obj"].values())
                + sum(v.get("calls", 0) for k, v in r["tensor"].items() if _sub(k) not in P2P)
                for r in per_rank
            ),
            default=0,
        ),
        "p2p_recv_bytes": sum(v.get("recv_bytes", 0) for k, v in total["tensor"].items() if _sub(k) in P2P),
        "tensor_recv_bytes": sum(v.get("recv_bytes", 0) for k, v in total["tensor"].items() if _sub(k) not in P2P),
        "store_ops": sum(n for k, n in total["store"].items() if k != "check_miss")
        - total["store"].get("check_miss", 0),
        "store_polls": total["store"].get("check_miss", 0),
        "store_by_op": dict(sorted(total["store"].items())),
        "groups": max((r["groups"] for r in per_rank), default=0),
        "s3_sites": dict(sorted(total["s3"]["sites"].items(), key=lambda kv: -kv[1])),
        "s3_sites_rank0": dict(sorted(per_rank[0]["s3"]["sites"].items(), key=lambda kv: -kv[1])) if per_rank else {},
    }
    assert set(OBJECT_COLLECTIVES) >= {_sub(k) for k in total["obj"]}, total["obj"]
    return out


def _check(results: list[dict], what: str) -> None:
    bad = [
        (r, res) for r, res in enumerate(results) if res.get("errors") or res.get("mismatches") or "counts" not in res
    ]
    if bad:
        raise AssertionError(
            f"scale harness, {what}: "
            + "; ".join(
                f"rank {r}: {res.get('errors') or res.get('mismatches') or res.get('log', res)}" for r, res in bad
            )
        )


def _facts(results: list[dict]) -> dict[str, Any]:
    served = Counter(t for res in results for t in res.get("served", {}).values())
    return {
        "resolved": sorted({str(res.get("resolved")) for res in results}),
        "served_files": dict(served),
        "from_peers_bytes": sum(res.get("from_peers", 0) for res in results),
    }


def run_scale(
    world: int,
    s3: dict[str, Any],
    workdir: Path,
    *,
    ranks_per_node: int = 2,
    own_bytes: int = MiB,
    timeout: float = 900.0,
    phases: tuple[str, ...] = PHASES,
    after_saves: Callable[[Path], None] | None = None,
) -> dict[str, Any]:
    """Run the ``phases`` (of :data:`PHASES`, in that order; the two saves always run) for a job of
    ``world`` ranks; return ``{"world", "nodes", "ranks_per_node", "own_bytes", "source": "real",
    "phases": {phase: summary}, "per_rank": {phase: [counts of rank r]}, "detail": {phase: {sub-phase:
    counts, all ranks}}, "facts": {load phase: which checkpoint, which tiers served the files}}``.

    ``s3``: the ``[s3]`` section (bucket existing, empty prefix of its own). Blocks until every
    phase's processes have exited; raises AssertionError when a rank fails or loads wrong data.
    """
    if world % ranks_per_node:
        raise ValueError(f"world {world} is not a multiple of ranks_per_node {ranks_per_node}")
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)} (known: {', '.join(PHASES)})")
    nodes = world // ranks_per_node
    node_of = lambda r: f"n{r // ranks_per_node}"  # noqa: E731
    cfg = scale_config(workdir, _strip(s3))
    common = {"config": cfg, "own_bytes": own_bytes}
    raw: dict[str, list[dict]] = {}
    facts: dict[str, Any] = {}

    def world_run(scenario: str, args: dict, tag: str) -> list[dict]:
        res = run_world(
            world,
            scenario,
            args,
            workdir / "runs" / tag,
            script=WORKER,
            node_of=node_of,
            timeout=timeout,
            expect_ok=False,
        )
        _check(res, tag)
        return res

    saved = world_run("save", {**common, "steps": [1, 2], "phases": ["first_save", "save"]}, "save")
    for ph in ("first_save", "save", "close"):
        raw[ph] = [res["counts"] for res in saved]
    if after_saves is not None:  # e.g. a snapshot of every node's directory (workdir / "local" / "n<i>")
        after_saves(workdir)
    for ph in LOAD_PHASES:
        if ph not in phases:
            continue
        if ph == "node_loss":
            shutil.rmtree(workdir / "local" / f"n{nodes - 1}")
        elif ph == "full_loss":
            shutil.rmtree(workdir / "local")
        res = world_run("load", {**common, "step": 2, "phase": ph}, ph)
        raw[ph] = [r["counts"] for r in res]
        facts[ph] = _facts(res)
    if "dcp_save" in phases or "dcp_load" in phases:
        dcp_dir = str(workdir / "dcp")
        for ph in ("dcp_save", "dcp_load"):
            res = world_run(ph, {**common, "step": 2, "phase": ph, "path": dcp_dir}, ph)
            raw[ph] = [r["counts"] for r in res]

    done = [ph for ph in PHASES if ph in raw and (ph in phases or ph in ("first_save", "save"))]
    per_rank = {ph: [collapse(d, ph) for d in raw[ph]] for ph in done}
    detail = {
        ph: {k: merge([d[k] for d in raw[ph] if k in d]) for k in sorted({k for d in raw[ph] for k in d})} for ph in raw
    }
    return {
        "world": world,
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "own_bytes": own_bytes,
        "source": "real",
        "phases": {ph: summarize(per_rank[ph], world) for ph in done},
        "per_rank": per_rank,
        "detail": detail,
        "facts": facts,
    }
