"""Files served between nodes while a job loads: a rank whose node lacks a data file gets its items
from a rank on a node that holds it.

With a node-local first tier (``[local] path = ".../{node}"``) each node holds the data files of
its own ranks only, while DCP deduplicates items that several ranks hold (the ``step``, replicated
parameters, optimizer ``param_groups``) into one rank's file, and a restarted job (same nodes,
another world size, a replacement node) reads items from files its node never wrote. The readers
of all ranks therefore agree on what to load and who serves what, inside ``dcp.load`` itself:

* :meth:`PeerGroup.get` creates, once per process and on the thread running ``dcp.load`` (every
  rank does it at the same point), a dedicated gloo process group: never the training group,
  and only this module and only that thread use it.
* ``read_metadata`` (every rank): each rank describes what its node holds (:func:`node_view`);
  the views are gathered, every rank picks the same checkpoint (:func:`choose`: the newest whose
  every data file some node or a shared tier holds) and the rank holding its metadata broadcasts
  it, so a node with an empty disk loads too.
* ``prepare_global_plan`` (coordinator): :func:`schedule` assigns each item a rank cannot read
  from its own node to a rank whose node holds the file, spreading the bytes over the holders.
* ``read_data`` (every rank): :func:`exchange` posts the receives, reads and verifies what it
  serves (through :class:`tierckpt.readback.Readback`), sends it, and waits; every received item
  is checked against its CRC32C again before it is used.

Point-to-point messages only (one per serving/receiving pair); the group's timeout is
``[job] commit_timeout``, so a peer that died fails the load with an error instead of a hang.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

from .catalog import committed_in_order, read_checkpoint_metadata
from .errors import CheckpointNotFound, CorruptCheckpoint, TierckptError
from .layout import is_data_file, metadata_key
from .tiers.base import Tier

__all__ = ["PeerGroup", "node_view", "choose", "Choice", "schedule"]

log = logging.getLogger("tierckpt.peers")

CANDIDATES = 3
"""How many of its newest committed checkpoints each node reports for ``latest``."""
TAG = 7141


class PeerGroup:
    """This process's dedicated gloo group for serving files between nodes (one per default group)."""

    _cached: "PeerGroup | None" = None
    _cached_for: Any = None
    _saves: "PeerGroup | None" = None
    _saves_for: Any = None

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.nodes: list[str] = []  # node name of every rank (the save-side group only)

    @classmethod
    def for_saves(cls, cfg: Any, timeout_s: float) -> "PeerGroup | None":
        """The save-side group, used only by the peer hop's background thread (:mod:`tierckpt.peercopy`),
        with every rank's node name. ``cfg`` given: created if ``[peer] replicas`` is set (every rank
        calls this in ``set_up_storage_writer``, on the thread running ``dcp.save``); ``cfg=None``:
        the group created earlier, or None."""
        import torch.distributed as dist

        from .config import node_name

        if cfg is None or not (dist.is_available() and dist.is_initialized()):
            return cls._saves if cls._saves_for is (dist.group.WORLD if dist.is_initialized() else None) else None
        if not cfg.peer.replicas or dist.get_world_size() < 2:
            return None
        default = dist.group.WORLD
        if cls._saves is None or cls._saves_for is not default:
            before = _threads()
            g = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            _lower_priority(_threads() - before, cfg.job.background_nice)  # gloo's own send/receive threads
            pg = cls(g, dist.get_rank(), dist.get_world_size())
            pg.nodes = pg.gather(node_name())
            cls._saves, cls._saves_for = pg, default
        return cls._saves

    @classmethod
    def get(cls, first: Tier, timeout_s: float) -> "PeerGroup | None":
        """The group, created on first use (collectively: every rank calls this at the same point
        of ``dcp.load``); None when the job is not distributed or the first tier is shared."""
        import torch.distributed as dist

        if not first.node_local or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        default = dist.group.WORLD
        if cls._cached is None or cls._cached_for is not default:
            g = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            cls._cached, cls._cached_for = cls(g, dist.get_rank(), dist.get_world_size()), default
        return cls._cached

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any, src: int) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def exchange(self, sends: "dict[int, Any]", recvs: "dict[int, Any]") -> None:
        """Send ``sends[peer]`` (a uint8 CPU tensor) to each peer and receive into ``recvs[peer]``;
        all posted at once, then waited for. Raises when a transfer fails (a peer died)."""
        import torch.distributed as dist

        works = [dist.irecv(buf, src=peer, group=self.group, tag=TAG) for peer, buf in sorted(recvs.items())]
        works += [dist.isend(buf, dst=peer, group=self.group, tag=TAG) for peer, buf in sorted(sends.items())]
        errors = []
        for w in works:
            try:
                w.wait()
            except Exception as e:  # noqa: BLE001 - reported once all are settled
                errors.append(e)
        if errors:
            raise TierckptError(f"serving checkpoint files between nodes failed: {errors[0]}")


def _threads() -> set[int]:
    """Native ids of this process's threads (Linux; empty elsewhere)."""
    import os

    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _lower_priority(tids: set[int], nice: int) -> None:
    """Add ``nice`` to the niceness of threads ``tids``: the save group's transfers are background
    work, and gloo moves the bytes in threads of its own, which would otherwise run at the
    training thread's priority."""
    import os

    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except OSError as e:  # gone meanwhile, or not allowed
            log.debug("cannot lower the priority of thread %d: %s", tid, e)


def node_view(first: Tier, others: "list[Tier]", checkpoint_id: str) -> dict:
    """What this rank can read, for :func:`choose`: the newest committed checkpoints on its node's
    tier (``checkpoint_id`` only, unless it is ``latest``) with their data files and the files
    their metadata needs, and which of them a shared tier (S3) holds committed."""
    have: dict[str, dict] = {}
    try:
        done = committed_in_order(first)
    except TierckptError as e:
        log.warning("cannot list %s: %s", first.url, e)
        done = []
    if checkpoint_id != "latest":
        done = [c for c in done if c.checkpoint_id == checkpoint_id]
    for c in reversed(done[-CANDIDATES:] if checkpoint_id == "latest" else done):
        try:
            _md, man = read_checkpoint_metadata(first, c.checkpoint_id)
        except (CheckpointNotFound, CorruptCheckpoint) as e:
            log.error("skipping %s on %s: %s", c.checkpoint_id, first.url, e)
            continue
        files = {n: o.size for n, o in c.objects.items() if is_data_file(n)}
        have[c.checkpoint_id] = {"seq": man.seq, "files": files, "needs": {f: s for f, s in man.files.items() if s}}
    shared: dict[str, int] = {}
    for tier in others:
        if tier.node_local:
            continue
        try:
            listed = committed_in_order(tier)
        except TierckptError as e:
            log.warning("cannot list %s: %s", tier.url, e)
            continue
        for c in listed:
            if checkpoint_id in ("latest", c.checkpoint_id) and c.header is not None:
                shared[c.checkpoint_id] = c.header.seq
    return {"root": first.root_id(), "have": have, "shared": shared}


@dataclass
class Choice:
    """What every rank agreed to load: the id, the rank whose node holds its metadata (-1: read it
    from a shared tier), which ranks' nodes hold each data file, and whether a shared tier holds it."""

    checkpoint_id: str
    md_rank: int
    holders: dict[str, list[int]]
    shared: bool


def choose(views: list[dict], checkpoint_id: str) -> Choice:
    """The checkpoint to load, the same on every rank (a pure function of the gathered views): the
    newest (by commit seq) whose data files are all held by some node, or committed on a shared tier."""
    seqs: dict[str, int] = {}
    for v in views:
        for cid, h in v["have"].items():
            seqs[cid] = max(seqs.get(cid, 0), h["seq"])
        for cid, seq in v["shared"].items():
            seqs[cid] = max(seqs.get(cid, 0), seq)
    if checkpoint_id != "latest":
        seqs = {c: s for c, s in seqs.items() if c == checkpoint_id}
    why: list[str] = []
    for cid in sorted(seqs, key=lambda c: (seqs[c], c), reverse=True):
        holders: dict[str, list[int]] = {}
        needs: dict[str, int] = {}
        md_rank = -1
        for r, v in enumerate(views):
            h = v["have"].get(cid)
            if h is None:
                continue
            if md_rank < 0:
                md_rank = r
            needs.update(h["needs"])
            for f, size in h["files"].items():
                if h["needs"].get(f) == size:
                    holders.setdefault(f, []).append(r)
        shared = any(cid in v["shared"] for v in views)
        missing = sorted(f for f in needs if f not in holders)
        if shared or (md_rank >= 0 and not missing):
            return Choice(cid, md_rank, holders, shared)
        why.append(f"{cid}: data file {missing[0]} is on no node of this job ({len(missing)} missing) and on no shared tier")
    nodes = sorted({v["root"] for v in views})
    raise CheckpointNotFound(f"checkpoint {checkpoint_id}: no committed checkpoint this job can read in full "
                             f"(nodes: {', '.join(nodes)}){': ' + '; '.join(why[:3]) if why else ''}")


def schedule(files_of_rank: list[dict[Any, tuple[str, int]]], choice: Choice, root_of: list[str]) -> list[dict]:
    """Coordinator: who serves what. ``files_of_rank[r]`` maps each item rank ``r`` reads (its
    storage index) to (data file, bytes). An item whose file ``r``'s node lacks is served by a rank
    whose node holds it (the least loaded, in bytes); items only a shared tier holds are left to
    the reader's fallback. Returns per rank ``{"recv": [[peer, [index...]]], "send": [[peer, [index...]]]}``
    (the same index order on both ends)."""
    world = len(files_of_rank)
    node_has = [set(f for f, rs in choice.holders.items() if any(root_of[q] == root_of[r] for q in rs)) for r in range(world)]
    load = [0] * world
    pairs: dict[tuple[int, int], list[Any]] = {}
    for r, items in enumerate(files_of_rank):
        for index, (file, nbytes) in items.items():
            if file in node_has[r]:
                continue
            servers = choice.holders.get(file, [])
            if not servers:
                if choice.shared:
                    continue
                raise CheckpointNotFound(f"checkpoint {choice.checkpoint_id}: rank {r} needs data file {file}, "
                                         "which no node of this job holds and no shared tier has")
            s = min(servers, key=lambda q: (load[q], q))
            load[s] += nbytes
            pairs.setdefault((s, r), []).append(index)
    out: list[dict] = [{"recv": [], "send": []} for _ in range(world)]
    for (s, r), idx in sorted(pairs.items(), key=lambda kv: kv[0]):
        out[r]["recv"].append([s, idx])
        out[s]["send"].append([r, idx])
    return out


def metadata_from(first: Tier, group: PeerGroup, choice: Choice) -> bytes | None:
    """The raw metadata of the chosen checkpoint on every rank: broadcast by the lowest rank whose
    node holds it; None when no node does (then every rank reads it from the shared tier)."""
    if choice.md_rank < 0:
        return None
    raw = first.get(metadata_key(choice.checkpoint_id)) if group.rank == choice.md_rank else None
    return group.broadcast(raw, choice.md_rank)
