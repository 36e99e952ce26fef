"""The peer hop: each rank's committed data file copied to ``[peer] replicas`` other nodes.

One more hop of the chain (:class:`PeerHop`, a :class:`~tierckpt.replicate.Replicator`), run first
after the local commit, in the background, in commit order, on every rank:

* **Placement** (:func:`placement`): nodes sorted by name; the rank with local index ``j`` on node
  ``i`` sends its file to the rank with local index ``j`` (modulo that node's size) on nodes
  ``i+1 … i+replicas`` (modulo the number of nodes). A copy never lives on its source's node, and
  a restarted job (same node names) finds the copies again; the reader needs no map at all
  (:mod:`tierckpt.peers` asks every node what it holds).
* **Transport**: point-to-point messages on the save-side gloo group (:meth:`PeerGroup.for_saves`,
  created by every rank in ``set_up_storage_writer``, used only by this thread): the file goes in
  pieces of whole chunks, read from the local tier, each piece checked against the CRC32C pieces
  of the committed metadata on arrival and written at its offset into a sink of the receiver's
  local tier (``.partial`` then rename: a copy is visible whole or not at all).
* **Commit**: the same protocol as every hop (:func:`tierckpt.commit.run_commit`): every rank
  reports its sends and receives, and the metadata writer of each node writes ``ID/peers.json``
  (which node holds which file) once every copy landed and was verified.

Copies live in the checkpoint's directory of the receiving node's ``[local]`` tier, so they follow
``[local] keep`` and go with their checkpoint. A failure (a partner died, a piece damaged) fails
this hop for this checkpoint only: logged, raised by the next ``wait()``, training goes on.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ..capture.ranksave import RankSave
from ..catalog import lease as leases
from ..checksum import crc32c
from ..errors import ChecksumMismatch, TierckptError
from ..format.layout import PEERS, data_key, padded, piece_bounds, rank_of_file
from ..format.metadata import metadata_from_json
from ..tiers.base import Tier
from .commit import Round, run_commit
from .peers import PeerGroup, settle
from .replicate import HopOwner, Replicator

__all__ = ["PeerHop", "placement"]

log = logging.getLogger("tierckpt.peers")

PIECE_BYTES = 16 << 20


def placement(nodes: list[str], replicas: int) -> list[list[int]]:
    """For every rank, the ranks its file is copied to, from the node name of every rank
    (``nodes[r]``): nodes sorted by name, local index ``j`` on node ``i`` sends to local index ``j``
    (modulo that node's size) on nodes ``i+1 … i+replicas``, never its own node. O(world)."""
    names = sorted(set(nodes))
    ranks_of: dict[str, list[int]] = {n: [] for n in names}
    local_index = []
    for r, n in enumerate(nodes):
        local_index.append(len(ranks_of[n]))
        ranks_of[n].append(r)
    at = {n: i for i, n in enumerate(names)}
    k = min(replicas, len(names) - 1)
    out = []
    for r, n in enumerate(nodes):
        dests = [ranks_of[names[(at[n] + step) % len(names)]] for step in range(1, k + 1)]
        out.append([d[local_index[r] % len(d)] for d in dests])
    return out


class PeerHop(Replicator):
    """Copies each rank's committed data file to its partners (see the module docstring).

    ``src`` returns the first (node-local) tier: the file is read there and the copies from other
    ranks are written there too."""

    def __init__(self, owner: HopOwner, src: Callable[[], Tier], replicas: int) -> None:
        self.replicas = replicas
        self._warned = False
        super().__init__(owner, src, src, 0, "peer")

    def _startup_pass(self) -> None:
        """No backlog: a copy that never landed is made again only by a later checkpoint."""
        self.settled = True
        self.started.set()

    def _backlog_step(self, job: RankSave) -> None:
        return

    def _replicate(self, job: RankSave) -> None:
        group = PeerGroup.for_saves(None, 0)
        if group is None:  # one process, or set_up_storage_writer never ran distributed: nothing to copy to
            if job.assign.distributed and not self._warned:
                self._warned = True
                log.warning(
                    "[peer] replicas = %d, but no peer group exists in this process (was the save made "
                    "through TieredWriter in a distributed job?): no peer copies",
                    self.replicas,
                )
            return
        a = job.assign
        assert job.metadata_json is not None
        md, man = metadata_from_json(job.metadata_json, f"checkpoint {a.checkpoint_id}")
        place = placement(group.nodes, self.replicas)
        file_of = {rank_of_file(f): f for f, size in man.files.items() if size}
        targets = place[a.rank]
        incoming = {q: file_of[q] for q, ts in enumerate(place) if a.rank in ts and q in file_of}
        recs: dict[str, list] = defaultdict(list)
        for rec in (md.storage_data or {}).values():
            recs[rec.file].append(rec)
        names = sorted(set(group.nodes))
        holders = {
            f: [group.nodes[t] for t in place[r]] for r, f in file_of.items() if r is not None and r < len(place)
        }
        record = json.dumps(
            {"replicas": self.replicas, "nodes": names, "copies": dict(sorted(holders.items()))}, sort_keys=True
        ).encode()
        rnd = Round(
            self.owner.channel(job),
            a.token,
            self.hop,
            a.rank,
            a.world,
            self.owner.cfg.job.commit_timeout,
            f"checkpoint {a.checkpoint_id} (peer copies)",
        )

        def work() -> dict:
            self._exchange(
                group,
                job,
                targets if job.size else [],
                {q: (f, man.files[f]) for q, f in incoming.items()},
                recs,
                man.chunk_size,
            )
            return {"size": job.size}

        run_commit(
            rnd,
            self.src,
            f"{a.checkpoint_id}/{PEERS}",
            work=work,
            writer=a.meta_writer_rank,
            metadata=record,
            same_ok=True,
        )

    def _exchange(
        self,
        group: PeerGroup,
        job: RankSave,
        targets: list[int],
        incoming: dict[int, tuple[str, int]],
        recs: dict[str, list],
        chunk_size: int,
    ) -> None:
        """Send this rank's file to ``targets`` and receive ``incoming`` (rank -> (file, size)), piece
        by piece: every piece index posts its sends and receives at once and waits for them."""
        import torch.distributed as dist

        tier, cid = self.src, job.id
        piece = max(1, PIECE_BYTES // chunk_size) * chunk_size
        mine = data_key(cid, job.assign.file)
        sizes = {q: size for q, (_f, size) in incoming.items()}
        send_buf = _aligned(piece) if targets else None
        recv_bufs = {q: _aligned(piece) for q in incoming}
        lease = (
            leases.acquire(
                tier,
                cid,
                kind="save",
                purpose=f"peer copies for rank {job.assign.rank}",
                require_committed=False,
                check_tombs=False,
            )
            if incoming
            else None
        )
        sinks: dict[int, Any] = {}
        try:
            for q, (f, size) in incoming.items():
                sinks[q] = tier.open_sink(data_key(cid, f), size)
            rounds = max([-(-job.size // piece)] * bool(targets) + [-(-s // piece) for s in sizes.values()] + [0])
            for i in range(rounds):
                off = i * piece
                posts: list[tuple[str, Any]] = []  # (peer, post the transfer): posted by _settle
                for q in incoming:
                    if off < sizes[q]:
                        buf = recv_bufs[q][: min(piece, sizes[q] - off)]
                        posts.append((f"from rank {q}", lambda b=buf, q=q: dist.irecv(b, src=q, group=group.group)))
                if targets and off < job.size:
                    assert send_buf is not None
                    n = min(piece, job.size - off)
                    tier.read_into(mine, off, memoryview(send_buf[:n].numpy()))
                    posts += [
                        (f"to rank {t}", lambda t=t, n=n: dist.isend(send_buf[:n], dst=t, group=group.group))
                        for t in targets
                    ]
                _settle(posts, f"checkpoint {cid}: peer copies of rank {job.assign.rank}")
                for q, (f, _size) in incoming.items():
                    if off < sizes[q]:
                        view = recv_bufs[q][: min(piece, sizes[q] - off)].numpy()
                        bad = _check_piece(recs[f], off, view, chunk_size)
                        if bad:
                            raise ChecksumMismatch(
                                f"checkpoint {cid}: the copy of {f} from rank {q} is damaged ({bad})"
                            )
                        sinks[q].write_at(off, memoryview(view))
            for s in sinks.values():
                s.close()
        except BaseException as e:
            for s in sinks.values():
                s.abort()
            if isinstance(e, TierckptError):
                raise
            raise TierckptError(
                f"checkpoint {cid}: peer copies of rank {job.assign.rank} failed: {type(e).__name__}: {e}"
            ) from e
        finally:
            if lease is not None:
                lease.release()


def _settle(posts: list[tuple[str, Any]], what: str) -> None:
    """The transfers of one piece (:func:`tierckpt.chain.peers.settle`); raise naming the peers
    whose transfer failed."""
    failed = settle(posts)
    if failed:
        raise TierckptError(
            f"{what}: the transfer {', '.join(p for p, _e in failed[:20])} failed (dead or hung?): "
            f"{type(failed[0][1]).__name__}: {str(failed[0][1])[:300]}"
        )


def _aligned(n: int) -> torch.Tensor:
    """A page-aligned uint8 CPU tensor of ``n`` bytes (anonymous mmap): the local tier reads into it
    and writes from it with direct I/O, without a bounce copy or the page cache."""
    import mmap

    import numpy as np

    return torch.from_numpy(np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8))


def _check_piece(recs: list, off: int, view: Any, chunk_size: int) -> str | None:
    """Why bytes ``[off, off+len(view))`` of a data file do not match the CRC32C pieces of its items
    (None when every piece inside the range matches)."""
    end = off + len(view)
    for rec in recs:
        for (s, e), crc in zip(piece_bounds(rec.pos, padded(rec.length), chunk_size), rec.crcs):
            if off <= s and e <= end and crc32c(view[s - off : e - off]) != crc:
                return f"the item at offset {rec.pos}, CRC piece [{s}, {e})"
    return None
