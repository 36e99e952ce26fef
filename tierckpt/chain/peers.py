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
* ``read_metadata`` (every rank): the ranks agree on the checkpoint and share its metadata
  (:mod:`tierckpt.agreement`: views gathered to the coordinator, one verdict broadcast, the
  metadata read from the rank's own node, sent by another node, or read from a shared tier), so a
  node with an empty disk loads too.
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
from typing import Any

from ..errors import CheckpointNotFound, TierckptError
from ..tiers.base import Tier

__all__ = ["PeerGroup", "schedule"]

log = logging.getLogger("tierckpt.peers")

TAG = 7141
FAN_OUT_MAX = 1 << 20
"""Items up to this size that only a shared tier holds and several ranks read are read by one of
them and served to the others (see :func:`schedule`)."""


class PeerGroup:
    """This process's dedicated gloo group for serving files between nodes (one per default group)."""

    _cached: PeerGroup | None = None
    _cached_for: Any = None
    _saves: PeerGroup | None = None
    _saves_for: Any = None

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self._round = 0  # collectives run through :meth:`collective` (the same count on every rank)
        self._uid = f"g{_groups_made()}"  # the same on every rank: groups are made collectively, in order
        self._transport: Any = group  # see transport(); the save-side group moves bytes itself
        self._timeout_s = 600.0
        self.nodes: list[str] = []  # node name of every rank (the save-side group only)

    @classmethod
    def for_saves(cls, cfg: Any, timeout_s: float) -> PeerGroup | None:
        """The save-side group, used only by the peer hop's background thread (:mod:`tierckpt.peercopy`),
        with every rank's node name. ``cfg`` given: created if ``[peer] replicas`` is set (every rank
        calls this in ``set_up_storage_writer``, on the thread running ``dcp.save``); ``cfg=None``:
        the group created earlier, or None."""
        import torch.distributed as dist

        from ..config import node_name

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
    def get(cls, first: Tier, timeout_s: float) -> PeerGroup | None:
        """The load-side group (one per process and default group; every rank calls this at the
        same point of ``dcp.load``), or None when the job is not distributed or the first tier is
        shared. Its object collectives (the agreement) run on the default group, on the thread
        running ``dcp.load``, as DCP's own do; bytes between nodes go over :meth:`transport`,
        created only when a load first needs it."""
        import torch.distributed as dist

        if not first.node_local or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        default = dist.group.WORLD
        if cls._cached is None or cls._cached_for is not default:
            pg = cls(default, dist.get_rank(), dist.get_world_size())
            pg._transport, pg._timeout_s = None, timeout_s
            cls._cached, cls._cached_for = pg, default
        return cls._cached

    def transport(self) -> Any:
        """The group that moves file bytes between ranks (a collective the first time: every rank
        calls it at the same point): the default group when it is gloo, else a dedicated gloo group
        (timeout ``[job] commit_timeout``) created once per process and reused."""
        import torch.distributed as dist

        if self._transport is None:
            if dist.get_backend(self.group) == "gloo":
                self._transport = self.group
            else:
                self._round += 1
                self._transport = _named(
                    "creating the group that serves files between nodes for dcp.load",
                    f"{self._uid}/{self._round}",
                    self.rank,
                    self.world,
                    lambda: dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self._timeout_s)),
                )
        return self._transport

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_to(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on rank ``dst`` (in rank order; None elsewhere): O(N) bytes in all."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self.group)
        return out

    def send_bytes(self, data: bytes, dsts: list[int]) -> None:
        """Send ``data`` to each rank of ``dsts`` (each receives it with :meth:`recv_bytes`, knowing its size)."""
        import torch
        import torch.distributed as dist

        if not dsts or not data:
            return
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        works = [dist.isend(buf, dst=d, group=self.transport(), tag=TAG + 1) for d in dsts]
        for w in works:
            if w is not None:  # None only for a rank outside the group
                w.wait()

    def recv_bytes(self, src: int, size: int) -> bytes:
        """``size`` bytes sent by rank ``src`` with :meth:`send_bytes`."""
        import torch
        import torch.distributed as dist

        if size <= 0:
            return b""
        buf = torch.empty(size, dtype=torch.uint8)
        dist.recv(buf, src=src, group=self.transport(), tag=TAG + 1)
        return buf.numpy().tobytes()

    def broadcast(self, obj: Any, src: int) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def exchange(self, sends: dict[int, Any], recvs: dict[int, Any]) -> None:
        """Send ``sends[peer]`` (a uint8 CPU tensor) to each peer and receive into ``recvs[peer]``;
        all posted at once, then waited for. Raises when a transfer fails (a peer died)."""
        import torch.distributed as dist

        g = self.transport()
        posts = [
            (f"from rank {peer}", lambda b=buf, p=peer: dist.irecv(b, src=p, group=g, tag=TAG))
            for peer, buf in sorted(recvs.items())
        ]
        posts += [
            (f"to rank {peer}", lambda b=buf, p=peer: dist.isend(b, dst=p, group=g, tag=TAG))
            for peer, buf in sorted(sends.items())
        ]
        errors = settle(posts)
        if errors:
            failed = ", ".join(peer for peer, _e in errors[:20])
            err = TierckptError(
                f"serving checkpoint files between nodes failed on rank {self.rank} ({failed}: dead or hung?): "
                f"{errors[0][1]}"
            )
            # Logged too: inside dcp.load, DCP's collective that follows fails on the same dead rank
            # and its error (naming no rank) is the one raised.
            log.error("%s", err)
            raise err

    def collective(self, what: str, fn: Any) -> Any:
        """Run ``fn()`` (a collective of this group) and turn its failure (a rank that died, or that
        did not take part within the group's timeout) into a :class:`TierckptError` naming the
        ranks that never arrived (:func:`_named`)."""
        self._round += 1
        return _named(what, f"{self._uid}/{self._round}", self.rank, self.world, fn)


def settle(posts: list[tuple[str, Any]]) -> list[tuple[str, BaseException]]:
    """Post every point-to-point transfer of ``posts`` (``(peer label, post)``; ``post()`` returns
    the work, or None for a rank outside the group), then wait for them all; the ones that failed,
    with their errors. A peer that died breaks only the transfers with it; posting to a peer
    already gone fails at once and counts the same."""
    failed: list[tuple[str, BaseException]] = []
    works = []
    for peer, post in posts:
        try:
            works.append((peer, post()))
        except Exception as e:  # noqa: BLE001 - reported once all are settled
            failed.append((peer, e))
    for peer, w in works:
        try:
            if w is not None:
                w.wait()
        except Exception as e:  # noqa: BLE001 - reported once all are settled
            failed.append((peer, e))
    return failed


def _named(what: str, key: str, rank: int, world: int, fn: Any) -> Any:
    """``fn()``, every rank marking its arrival under ``key`` on the job's store first; when it
    fails, a :class:`TierckptError` naming the ranks whose mark is missing. Costs two store
    operations per rank (the mark and its deletion); the failure path reads every rank's mark."""
    from .commit import default_channel, name_ranks

    ch = default_channel(True)
    key = f"tierckpt/peers/{key}"
    try:
        ch.publish(f"{key}/in{rank}", b"1")
    except Exception as e:  # noqa: BLE001 - a store gone: the collective tells
        log.debug("cannot mark arrival on the store: %s", e)
    try:
        out = fn()
    except Exception as e:
        absent = _absent(ch, key, world)
        who = name_ranks(absent) if absent else "a rank"
        err = TierckptError(
            f"{what}: {who} did not take part (dead, hung, or not loading): {type(e).__name__}: {str(e)[:300]}"
        )
        # Logged too: inside dcp.load, DCP's own collective that follows fails on the same dead rank
        # and its error (naming no rank) is the one raised.
        log.error("rank %d: %s", rank, err)
        raise err from e
    try:
        ch.delete(f"{key}/in{rank}")
    except Exception:  # noqa: BLE001
        pass
    return out


def _absent(ch: Any, key: str, world: int, settle_s: float = 5.0) -> list[int]:
    """The ranks whose arrival mark under ``key`` is missing, once the set stopped shrinking for a
    second (at most ``settle_s``): ranks merely slower than the failure are not named."""
    import time

    deadline = time.monotonic() + settle_s
    last: list[int] | None = None
    while True:
        try:
            absent = [r for r in range(world) if ch.try_get(f"{key}/in{r}") is None]
        except Exception:  # noqa: BLE001 - a store gone
            return last or []
        if absent == last or time.monotonic() > deadline or not absent:
            return absent
        last = absent
        time.sleep(1.0)


_made = 0


def _groups_made() -> int:
    """How many groups this process made (every rank makes them in the same order)."""
    global _made
    _made += 1
    return _made


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


def schedule(
    files_of_rank: list[dict[Any, tuple[str, int]]],
    holders: dict[str, list[int]],
    shared: bool,
    root_of: list[str],
    checkpoint_id: str,
) -> list[dict]:
    """Coordinator: who serves what. ``files_of_rank[r]`` maps each item rank ``r`` reads (its
    storage index) to (data file, bytes); ``holders`` maps each data file to the ranks whose node
    holds it whole (:meth:`tierckpt.agreement.Decision.holders_by_file`). An item whose file ``r``'s
    node lacks is served by a rank whose node holds it (the least loaded, in bytes); items only a
    shared tier holds (``shared``) are left to the reader's fallback. Returns per rank
    ``{"recv": [[peer, [index...]]], "send": [[peer, [index...]]]}`` (the same index order on both
    ends). Cost: O(items + holders) on the coordinator."""
    world = len(files_of_rank)
    node_of: dict[str, int] = {}
    node = [node_of.setdefault(root, len(node_of)) for root in root_of]
    held_on: dict[str, set[int]] = {f: {node[q] for q in rs} for f, rs in holders.items()}
    load = [0] * world
    pairs: dict[tuple[int, int], list[Any]] = {}
    fan: dict[Any, list[int]] = {}  # small items only a shared tier holds -> the ranks reading them
    for r, items in enumerate(files_of_rank):
        for index, (file, nbytes) in items.items():
            if node[r] in held_on.get(file, ()):
                continue
            servers = holders.get(file, [])
            if not servers:
                if not shared:
                    raise CheckpointNotFound(
                        f"checkpoint {checkpoint_id}: rank {r} needs data file {file}, "
                        "which no node of this job holds and no shared tier has"
                    )
                if nbytes <= FAN_OUT_MAX:
                    fan.setdefault(index, []).append(r)
                continue  # read from the shared tier by the rank itself
            s = min(servers, key=lambda q: (load[q], q))
            load[s] += nbytes
            pairs.setdefault((s, r), []).append(index)
    # A small item many ranks read from the shared tier only (the step, a replicated bias: DCP keeps
    # one copy in one rank's file) is read once, by the least loaded of them, and served to the
    # others: one GET instead of one per rank.
    fanned = {index for index, readers in fan.items() if len(readers) > 1}
    reads_anyway: dict[str, set[int]] = {}  # file -> ranks reading some other item of it from the shared tier
    for index, readers in fan.items():
        for r in readers:
            f = files_of_rank[r][index][0]
            if any(i not in fanned and fi == f for i, (fi, _n) in files_of_rank[r].items() if i != index):
                reads_anyway.setdefault(f, set()).add(r)
    for index, readers in fan.items():
        if len(readers) < 2:
            continue
        file, nbytes = files_of_rank[readers[0]][index]
        anyway = reads_anyway.get(file, set())
        s = min(readers, key=lambda q: (q not in anyway, load[q], q))  # one whose read covers it costs no request
        load[s] += nbytes * (len(readers) - 1)
        for r in readers:
            if r != s:
                pairs.setdefault((s, r), []).append(index)
    out: list[dict] = [{"recv": [], "send": []} for _ in range(world)]
    for (s, r), idx in sorted(pairs.items(), key=lambda kv: kv[0]):
        out[r]["recv"].append([s, idx])
        out[s]["send"].append([r, idx])
    return out
