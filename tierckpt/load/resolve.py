"""Which checkpoint a load reads, and its metadata: the reader's ``read_metadata`` half.

``"latest"`` is the newest committed checkpoint over all tiers, in commit order, whose metadata is
valid and whose data a tier can serve (:func:`tierckpt.catalog.listing.find_latest`). In a
distributed job with a node-local first tier the answer is the job's, not one node's: the ranks
agree on it (:mod:`tierckpt.load.agreement`: each rank's view to the coordinator, its verdict to
every rank, over the reader's own peer group -- never the training process group) and share the
metadata of the agreed checkpoint, read once where it is held. Inside ``dcp.load`` every rank checks
in (:mod:`tierckpt.chain.checkin`) right before the agreement, and again at the end of
``read_data`` (:meth:`MetadataResolution._done_reading`, which then releases the job's leases), so
a rank that died is named by every other. :class:`MetadataResolution` is a base of
:class:`~tierckpt.load.reader.TieredReader`; it runs on the thread calling ``dcp.load``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .. import loading
from ..catalog.listing import find_latest, parse_checkpoint_doc, read_checkpoint_metadata
from ..chain import peers
from ..chain.checkin import Group, check_in, dcp_group
from ..chain.commit import default_channel
from ..config import TierConfig
from ..errors import CheckpointNotFound, CorruptCheckpoint, note_metadata_error
from ..tiers.base import Tier
from . import agreement

__all__ = ["MetadataResolution"]

log = logging.getLogger("tierckpt")


class MetadataResolution:
    """``resolve`` and ``read_metadata`` of the reader, and the agreement they share.

    The reader sets, before the first call: ``cfg``, ``tiers``, ``checkpoint_id`` and the state
    below (reset per load by ``TieredReader.reset``).
    """

    cfg: TierConfig
    tiers: list[Tier]
    checkpoint_id: str
    resolved_id: str | None
    metadata: Metadata | None
    _manifest: Any
    _raw_md: bytes | None
    _peers: peers.PeerGroup | None
    _docs: dict[str, tuple]
    _shared_doc: tuple[str, Any] | None
    _verdict: agreement.Verdict | None
    _decision: agreement.Decision | None
    _roots: list[str]
    _failed: BaseException | None
    _latest: str | None

    def resolve(self) -> str:
        """The concrete id to load: ``latest`` is the newest committed checkpoint over all tiers,
        in commit order, whose metadata is valid and whose data a tier can serve (anything newer
        that fails is logged and skipped; see :func:`tierckpt.catalog.find_latest`).

        In a distributed job with a node-local first tier the answer is the job's, not this
        node's (:func:`tierckpt.agreement.decide`): then this is a collective of the reader's own
        group, called by every rank, and raises the same :class:`CheckpointNotFound` on every rank."""
        group = self._peer_group()
        if group is not None:
            return self._agree(group).checkpoint_id
        if self.checkpoint_id != "latest":
            return self.checkpoint_id
        if self._latest is not None:  # resolved by reset() for this load
            return self._latest
        return find_latest(self.tiers).checkpoint_id

    def _peer_group(self) -> peers.PeerGroup | None:
        if self._peers is None and self.tiers:
            self._peers = peers.PeerGroup.get(self.tiers[0], self.cfg.job.commit_timeout)
        return self._peers

    def _agree(self, group: peers.PeerGroup) -> agreement.Verdict:
        """Every rank: agree on the checkpoint (once per load; :mod:`tierckpt.agreement`): this
        rank's view to the coordinator, the coordinator's verdict to every rank. Raises the same
        :class:`CheckpointNotFound` on every rank when nothing can be loaded."""
        if self._verdict is None:
            try:
                view, self._docs = agreement.local_view(self.tiers[0], self.checkpoint_id)
            except Exception as e:  # noqa: BLE001 - still take part in the exchange; the error travels
                view = agreement.NodeView(self.tiers[0].root_id(), error=f"{type(e).__name__}: {e}")
            # Right before the agreement's first collective: a rank that never entered dcp.load (or
            # died before here) is named by every other rank, not only by those whose gather broke.
            self._check_in(
                group, f"load:{self.checkpoint_id}", f"checkpoint {self.checkpoint_id}: loading", "its dcp.load"
            )
            wires = group.collective(
                "agreeing on the checkpoint to load (gathering what each node holds)",
                lambda: group.gather_to(agreement.view_to_wire(view)),
            )
            wire = None
            if wires is not None:
                views = [agreement.view_from_wire(w) for w in wires]
                self._roots = [v.root for v in views]
                shared = [t for t in self.tiers[1:] if not t.node_local]
                names = {cid: agreement.data_files(doc.manifest.files) for cid, (_raw, doc) in self._docs.items()}
                self._decision = agreement.decide(views, shared, self.checkpoint_id, names=names)
                wire = agreement.verdict_to_wire(self._decision.verdict)
            self._verdict = agreement.verdict_from_wire(
                group.collective(
                    "agreeing on the checkpoint to load (the coordinator's verdict)", lambda: group.broadcast(wire, 0)
                )
            )
        if self._verdict.error:
            raise CheckpointNotFound(self._verdict.error)
        return self._verdict

    def _check_in(self, group: peers.PeerGroup, cid: str, what: str, before: str) -> bool:
        """Every rank of a distributed load, inside ``dcp.load``: a check-in of the agreement's
        group (the default group, coordinator rank 0) under ``cid``, in the ``load/`` namespace
        (:mod:`tierckpt.chain.checkin`): wait up to ``[job] commit_timeout`` for every rank, else
        log an error naming those missing and go on (never raises: a late rank still loads).
        Skipped (False) outside ``dcp.load`` (no DCP wrapper on the stack: ``resolve()`` called
        on its own)."""
        if dcp_group() is None:
            return False
        check_in(cid, Group("load/default", group.world, group.rank, 0), self.cfg.job.commit_timeout, what, before)
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Every rank (``dcp.load``). With a node-local first tier in a distributed job, the ranks
        agree here on the checkpoint and share its metadata (see :mod:`tierckpt.agreement`): this
        is then a collective of the reader's own group, so every rank must load together."""
        if kwargs.get("rank") is not None and self._failed is not None:
            # DCP's second try ("rank local metadata") after our first failed: the same answer,
            # without another collective that some ranks would not join
            raise self._failed
        loading.begin(self)  # until read_data is done: the host pool's first touch waits
        try:
            group = self._peer_group()
            if group is not None:
                return self._read_metadata_with_peers(group)
            cid = self.resolve()
            return self._finish_metadata(cid, self._read_local_metadata(cid))
        except BaseException as e:
            self._failed = e
            note_metadata_error(e)  # dcp.load keeps only its text: find_error maps it back
            loading.end(self)
            raise

    def _read_metadata_with_peers(self, group: peers.PeerGroup) -> Metadata:
        v = self._agree(group)
        cid = v.checkpoint_id
        mine = cid in self._docs and self._docs[cid][1].manifest.seq == v.seq
        held = self._decision.metadata if self._decision is not None else None  # the coordinator's lease read it
        if v.md_send:
            group.transport()  # every rank, at the same point
        if group.rank == v.md_rank and v.md_send:
            if v.md_from:
                assert held is not None and held[0] == v.md_from, "the coordinator sends the copy its lease read"
                group.send_bytes(held[1], agreement.expand(v.md_send))
            elif mine:
                group.send_bytes(self._docs[cid][0], agreement.expand(v.md_send))
        source = agreement.metadata_source(v, group.rank, mine, held is not None)
        if source == "local":
            raw, doc = self._docs[cid]
        else:
            from_tier = ""
            if source == "peer":
                raw, where = group.recv_bytes(v.md_rank, v.md_size), f"metadata of {cid} from rank {v.md_rank}"
                if v.md_from:  # the shared tier's own copy, read by the coordinator
                    from_tier, where = v.md_from, f"{where} (read from {v.md_from})"
            elif source == "lease" and held is not None:
                from_tier, raw = held
                where = f"metadata of {cid} on {from_tier}"
            else:
                from_tier, raw = agreement.read_shared_metadata(self.tiers, v)
                where = f"metadata of {cid} on {from_tier}"
            doc = parse_checkpoint_doc(raw, where, cid)
            if from_tier:
                self._shared_doc = (from_tier, doc)  # its index of encoded files: not read again
            if doc.manifest.seq != v.seq:
                raise CorruptCheckpoint(f"{where}: commit seq {doc.manifest.seq}, the job agreed on {v.seq}")
        self._raw_md = raw
        return self._finish_metadata(cid, (doc.to_metadata(), doc.manifest))

    def _finish_metadata(self, cid: str, got: tuple) -> Metadata:
        md, man = got
        md.storage_meta = StorageMeta(checkpoint_id=cid, save_id=man.save_token, load_id=None, modules=[])
        for rec in (md.storage_data or {}).values():
            rec.chunk_size = man.chunk_size  # type: ignore[attr-defined]
        self.resolved_id = cid
        self.metadata = md
        self._manifest = man
        return md

    def _read_local_metadata(self, cid: str) -> tuple:
        errors = []
        for tier in self.tiers:
            try:
                md, man = read_checkpoint_metadata(tier, cid)
            except CheckpointNotFound:
                continue
            except CorruptCheckpoint as e:
                errors.append(str(e))
                log.error("%s; trying the next tier", e)
                continue
            return md, man
        if errors:
            raise CorruptCheckpoint(f"checkpoint {cid}: no tier holds valid metadata: " + "; ".join(errors))
        raise CheckpointNotFound(
            f"checkpoint {cid} is not committed on any tier: " + ", ".join(t.url for t in self.tiers)
        )

    def _done_reading(self) -> None:
        """End of ``read_data``, every rank of a distributed load, whether its reads succeeded or
        not: the "done reading" check-in (:mod:`tierckpt.chain.checkin`),
        before DCP's gather of the reads, so a rank that died while reading or serving files to
        other nodes is named by every other rank within ``[job] commit_timeout`` (an error logged on
        every rank; never raised: a rank only late still loads, a dead one makes DCP's gather that
        follows fail). Once it ran, every rank is done reading or named: the
        coordinator gives up the job's leases without counting the ranks done
        (:meth:`_reads_done`, the fallback where the check-in is skipped)."""
        v = self._verdict
        if v is None or not v.load or self._peers is None:
            return
        if self._check_in(
            self._peers, f"read:{v.load}", f"checkpoint {v.checkpoint_id}: reading", "the end of its reads"
        ):
            return  # a missing rank was logged by check_in; DCP's gather that follows raises
        self._reads_done()

    def _reads_done(self) -> None:
        """End of ``read_data``, every rank: when the coordinator holds the job's leases on shared
        tiers, count this rank done on the store; the coordinator waits (up to ``[job]
        commit_timeout``: DCP's own collective after ``read_data`` waits for every rank anyway)
        until every rank is, then :meth:`release` gives the leases up."""
        v = self._verdict
        if v is None or not v.leased or self._peers is None:
            return
        ch = default_channel(True)
        key = agreement.done_key(v)
        try:
            ch.add(key, 1)
            if self._decision is None:
                return
            deadline = time.monotonic() + self.cfg.job.commit_timeout
            delay = 0.002
            while (n := ch.add(key, 0)) < self._peers.world:
                if time.monotonic() > deadline:
                    log.error(
                        "checkpoint %s: %d of %d ranks finished reading within %.0f s; releasing the job's "
                        "leases on %s",
                        v.checkpoint_id,
                        n,
                        self._peers.world,
                        self.cfg.job.commit_timeout,
                        ", ".join(v.leased),
                    )
                    return
                time.sleep(delay)
                delay = min(delay * 1.5, 0.05)
            ch.delete(key)
        except Exception as e:  # noqa: BLE001 - a store gone: the leases expire on their own
            log.warning("checkpoint %s: cannot count the ranks done reading: %s", v.checkpoint_id, e)
