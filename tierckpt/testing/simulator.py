"""The many-rank simulator: tierckpt's own coordination code run for thousands of simulated ranks in
one process, against in-memory tiers (:class:`~tierckpt.testing.memtier.MemoryTier`), counting
what each rank would send.

It does not model the protocol: it calls the functions the reader calls, in the order the reader
calls them between its collectives (:mod:`tierckpt.agreement` for what each rank holds, the
coordinator's decision, the metadata's source; :func:`tierckpt.readback.hold` for the local
leases; :func:`tierckpt.peers.schedule` for who serves what; :class:`tierckpt.readback.Readback`
for the verified reads). Where a real job would run a collective, the simulator passes the
objects along and counts the pickled bytes each rank receives (``gather_object``: the
coordinator receives every other rank's; ``broadcast_object_list``: every other rank receives the
coordinator's), the collective rounds, the point-to-point bytes (metadata and items served
between nodes) and, per rank, the requests its S3 calls would send.

The job: ``world`` ranks, ``per_node`` per simulated node, each rank owning one small tensor
(``own.<rank>`` in its own data file) plus one replicated tensor and a step in rank 0's file,
``checkpoints`` committed checkpoints on every node's disk and on S3. Scenarios
(:func:`simulate_load`): ``restart`` (every file on local disks), ``node_loss`` (node 1's disk
empty), ``full_loss`` (every disk empty: a load from S3).

Metadata parses are memoised by the bytes' identity (every simulated node holds the same
object): a real job parses its metadata once per rank, which costs time here, not requests.
"""

from __future__ import annotations

import pickle
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..catalog import listing as catalog
from ..chain import peers
from ..checksum import crc32c
from ..codec.view import decoding
from ..format.layout import data_key, metadata_key, padded, piece_bounds
from ..format.metadata import CheckpointManifest, ItemRecord, metadata_to_json
from ..load import agreement
from ..load.readback import Readback, Request, hold
from .memtier import MemoryTier

__all__ = ["SimJob", "simulate_load", "build_job", "build_job_from"]

CHUNK = 1 << 20
OWN_BYTES = 64  # each rank's own tensor: 16 float32


@dataclass
class SimJob:
    """The simulated job: its tiers and what each rank reads."""

    world: int
    per_node: int
    s3: MemoryTier
    nodes: list[MemoryTier]
    ids: list[str]
    metadata: dict[str, bytes] = field(default_factory=dict)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node


def _file(rank: int, token: str) -> str:
    return f"rank-{rank:05d}-{token[:8]}.data"


def _metadata(world: int, cid: str, seq: int, token: str) -> tuple[bytes, dict[str, bytes]]:
    """A real ``metadata.json`` (the format code's own serializer) and the data files it names."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    files: dict[str, bytearray] = {_file(r, token): bytearray() for r in range(world)}
    sdm: dict[str, Any] = {}
    storage: dict[Any, ItemRecord] = {}

    def add(fqn: str, rank: int, data: bytes, tensor: bool, numel: int = 0) -> None:
        f = _file(rank, token)
        buf = files[f]
        pos = len(buf)
        buf += data + bytes(padded(len(data)) - len(data))
        crcs = [crc32c(bytes(buf[s:e])) for s, e in piece_bounds(pos, padded(len(data)), CHUNK)]
        if tensor:
            size = torch.Size([numel])
            sdm[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=torch.float32), size, [ChunkStorageMetadata(torch.Size([0]), size)]
            )
            idx = MetadataIndex(fqn, torch.Size([0]), 0)
            storage[idx] = ItemRecord(f, pos, len(data), "float32", (numel,), crcs)
        else:
            sdm[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = ItemRecord(f, pos, len(data), "", (), crcs)

    for r in range(world):
        add(f"own.{r}", r, bytes([r % 251]) * OWN_BYTES, True, OWN_BYTES // 4)
    add("rep", 0, bytes(range(64)) * 2, True, 32)
    add("step", 0, pickle.dumps(seq), False)
    md = Metadata(state_dict_metadata=sdm, storage_data=storage)
    man = CheckpointManifest(
        cid,
        world,
        CHUNK,
        {f: len(b) for f, b in files.items()},
        committed=float(seq),
        step=seq,
        save_token=token,
        seq=seq,
    )
    return metadata_to_json(md, man), {f: bytes(b) for f, b in files.items()}


def build_job(world: int, per_node: int = 2, checkpoints: int = 2) -> SimJob:
    """``checkpoints`` committed checkpoints of a ``world``-rank job on every node's disk and on S3."""
    s3 = MemoryTier("s3", "s3://sim/ckpt")
    s3.may_encode = True  # as an S3 tier: its files may be stored encoded (read through codec.decoding)
    nnodes = -(-world // per_node)
    nodes = [
        MemoryTier("local", f"/sim/n{n}", node_local=True, cheap_listing=True, root=f"/sim/n{n}") for n in range(nnodes)
    ]
    job = SimJob(world, per_node, s3, nodes, [])
    for k in range(1, checkpoints + 1):
        cid, token = f"step-{k:06d}", f"{k:08x}" + "0" * 24
        raw, files = _metadata(world, cid, k, token)
        job.ids.append(cid)
        job.metadata[cid] = raw
        s3.seed(metadata_key(cid), raw)
        for n in nodes:
            n.seed(metadata_key(cid), raw)
        for f, data in files.items():
            s3.seed(data_key(cid, f), data)
            r = int(f[5:10])
            nodes[job.node_of(r)].seed(data_key(cid, f), data)
    return job


def build_job_from(local_root: Any, s3_objects: dict[str, bytes], world: int, per_node: int) -> SimJob:
    """A simulated job holding exactly the files of a real run: ``local_root/n<i>`` (each node's
    ``[local]`` directory, ``{node}`` = ``n<i>``) and the S3 objects by key. Used to pin the
    simulator's counts to a real run's (``tests/test_simulator.py``)."""
    from pathlib import Path

    root = Path(local_root)
    s3 = MemoryTier("s3", "s3://sim/ckpt")
    s3.may_encode = True  # as an S3 tier: its files may be stored encoded (read through codec.decoding)
    for key, data in s3_objects.items():
        s3.seed(key, data)
    nnodes = -(-world // per_node)
    nodes = []
    for n in range(nnodes):
        tier = MemoryTier("local", f"/sim/n{n}", node_local=True, cheap_listing=True, root=f"/sim/n{n}")
        base = root / f"n{n}"
        for path in sorted(base.rglob("*")) if base.exists() else []:
            if path.is_file():
                tier.seed(path.relative_to(base).as_posix(), path.read_bytes())
        nodes.append(tier)
    job = SimJob(world, per_node, s3, nodes, [])
    for cid, (_header, _size) in catalog.committed_headers(s3).items():
        job.ids.append(cid)
        job.metadata[cid] = s3.get(metadata_key(cid))
    s3.requests.clear()
    return job


class _Memo:
    """Memoise :func:`tierckpt.catalog.parse_checkpoint_doc` by the bytes' identity while simulating."""

    def __enter__(self) -> _Memo:
        self._orig = catalog.parse_checkpoint_doc
        cache: dict[tuple[int, str], Any] = {}

        def parse(raw: bytes, where: str, cid: str) -> Any:
            key = (id(raw), cid)
            if key not in cache:
                cache[key] = (raw, self._orig(raw, where, cid))
            return cache[key][1]

        self._orig_index = agreement.file_index
        indexes: dict[int, tuple[Any, dict]] = {}

        def file_index(files: dict) -> dict:
            if id(files) not in indexes:
                indexes[id(files)] = (files, self._orig_index(files))
            return indexes[id(files)][1]

        catalog.parse_checkpoint_doc = parse  # type: ignore[assignment]
        agreement.file_index = file_index  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        catalog.parse_checkpoint_doc = self._orig  # type: ignore[assignment]
        agreement.file_index = self._orig_index  # type: ignore[assignment]


def _size(obj: Any) -> int:
    return len(pickle.dumps(obj))


def simulate_load(job: SimJob, scenario: str = "restart", wants: Any = None) -> dict:
    """One ``dcp.load(checkpoint_id="latest")`` of ``job`` after ``scenario`` (module docstring);
    returns the counts (JSON-able). ``wants(rank)`` names the state-dict keys rank ``rank`` loads
    (default: ``own.<rank>``, ``rep``, ``step``); ``node_loss`` empties the last node's disk."""
    wants = wants or (lambda r: (f"own.{r}", "rep", "step"))
    if scenario == "node_loss":
        job.nodes[-1].clear()
    elif scenario == "full_loss":
        for n in job.nodes:
            n.clear()
    elif scenario != "restart":
        raise ValueError(f"unknown scenario {scenario!r} (restart, node_loss, full_loss)")
    world = job.world
    t0 = time.perf_counter()
    job.s3.requests.clear()
    coll_bytes: Counter[int] = Counter()  # rank -> object-collective bytes received
    p2p_bytes: Counter[int] = Counter()
    rounds = 0
    with _Memo():
        # phase 1 + 2: views, gathered to the coordinator
        views, docs = [], []
        for r in range(world):
            view, d = agreement.local_view(job.nodes[job.node_of(r)], "latest")
            docs.append(d)
            w = agreement.view_to_wire(view)
            if r:
                coll_bytes[0] += _size(w)
            views.append(agreement.view_from_wire(w))
        rounds += 1
        # phase 3: the coordinator decides (its S3 calls counted as rank 0's)
        job.s3.who = 0
        names = {cid: agreement.data_files(doc.manifest.files) for cid, (_raw, doc) in docs[0].items()}
        decision = agreement.decide(views, [job.s3], "latest", names=names)
        v = decision.verdict
        wire = agreement.verdict_to_wire(v)
        for r in range(1, world):
            coll_bytes[r] += _size(wire)
        rounds += 1
        if v.error:
            raise RuntimeError(v.error)
        cid = v.checkpoint_id
        # phase 4: metadata on every rank, then leases and the holding tiers
        holding: list[list] = []
        man = None
        for r in range(world):
            job.s3.who = r
            mine = cid in docs[r] and docs[r][cid][1].manifest.seq == v.seq
            held = decision.metadata if r == 0 else None  # the coordinator's lease read it
            src = agreement.metadata_source(v, r, mine, held is not None)
            from_s3 = src not in ("local", "peer") or bool(v.md_from)  # S3's own copy, with its index
            if src == "local":
                raw, doc = docs[r][cid]
            elif src == "peer":
                p2p_bytes[r] += v.md_size
                sent = decision.metadata[1] if v.md_from and decision.metadata else docs[v.md_rank][cid][0]
                raw = job.metadata[cid] if sent == job.metadata[cid] else sent
                doc = catalog.parse_checkpoint_doc(raw, "peer", cid)
            elif src == "lease" and held is not None:
                raw = job.metadata[cid] if held[1] == job.metadata[cid] else held[1]
                doc = catalog.parse_checkpoint_doc(raw, "s3", cid)
            else:
                _tier, raw = agreement.read_shared_metadata([job.s3], v)
                doc = catalog.parse_checkpoint_doc(job.metadata[cid] if raw == job.metadata[cid] else raw, "s3", cid)
            man = doc.manifest
            tiers: list = []
            if cid in docs[r]:
                tiers, lease_list = hold([job.nodes[job.node_of(r)]], cid, "load")
                for lease in lease_list:
                    lease.release()
            # as TieredReader.set_up_storage_reader: the index of encoded files comes with metadata read from S3
            tiers += [decoding(job.s3, cid, doc if from_s3 else None)] if "s3" in v.shared else []
            holding.append(tiers)
        assert man is not None
        doc_items = _items(docs, v, job)
        # the coordinator's schedule (DCP's plan exchange carries the routes)
        by_fqn = {idx.fqn: (idx, rec) for idx, rec in doc_items.items()}
        wanted = [{by_fqn[f][0]: (by_fqn[f][1].file, by_fqn[f][1].length) for f in wants(r)} for r in range(world)]
        routes = peers.schedule(
            wanted, decision.holders_by_file(man.files), bool(v.shared), [x.root for x in views], cid
        )
        route_bytes = sum(_size(rt) for rt in routes)
        # read_data: items from other nodes, the rest through the read engine
        for r in range(world):
            job.s3.who = r
            recv = {i for _p, idx in routes[r]["recv"] for i in idx}
            reqs = []
            for idx, (_f, n) in wanted[r].items():
                if idx in recv:
                    p2p_bytes[r] += n
                    continue
                reqs.append(Request(doc_items[idx], memoryview(bytearray(n)), idx.fqn))
            if reqs:
                Readback(cid, holding[r], man.chunk_size, threads=1).read(reqs)
        # the job's leases, released by the coordinator once every rank is done
        job.s3.who = 0
        decision.release()
    by_rank = job.s3.by_rank()
    return {
        "world": world,
        "per_node": job.per_node,
        "scenario": scenario,
        "checkpoint": cid,
        "s3_requests": sum(by_rank.values()),
        "s3_by_op": dict(job.s3.by_op()),
        "s3_max_per_rank": max(by_rank.values(), default=0),
        "collective_bytes": sum(coll_bytes.values()),
        "collective_rounds": rounds,
        "route_bytes": route_bytes,
        "p2p_bytes": sum(p2p_bytes.values()),
        "metadata_bytes": len(job.metadata[cid]),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _items(docs: list, v: agreement.Verdict, job: SimJob) -> dict:
    """The agreed checkpoint's storage records (MetadataIndex -> ItemRecord), parsed once."""
    raw = job.metadata[v.checkpoint_id]
    doc = catalog.parse_checkpoint_doc(raw, "sim", v.checkpoint_id)
    return dict(doc.to_metadata().storage_data)
