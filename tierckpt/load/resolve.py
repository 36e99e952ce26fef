"""Which checkpoint a load reads, and its metadata: the reader's ``read_metadata`` half.

``"latest"`` is the newest committed checkpoint over all tiers, in commit order, whose metadata is
valid and whose data a tier can serve (:func:`tierckpt.catalog.listing.find_latest`). In a
distributed job with a node-local first tier the answer is the job's, not one node's: the ranks
agree on it (:mod:`tierckpt.load.agreement`: each rank's view to the coordinator, its verdict to
every rank, over the reader's own peer group -- never the training process group) and share the
metadata of the agreed checkpoint, read once where it is held. :class:`MetadataResolution` is a
base of :class:`~tierckpt.load.reader.TieredReader`; it runs on the thread calling ``dcp.load``.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .. import loading
from ..catalog.listing import find_latest, parse_checkpoint_doc, read_checkpoint_metadata
from ..chain import peers
from ..config import TierConfig
from ..errors import CheckpointNotFound, CorruptCheckpoint
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
