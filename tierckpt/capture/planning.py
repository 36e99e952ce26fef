"""Save planning on one rank: the file layout, the capture plan and the write results.

Everything here that is per item is built once per *plan shape* (the items of a SavePlan and
the shapes and dtypes of the tensors they resolve to) and cached, so that a save whose plan did
not change does only the unavoidable per-item work on the training thread.

Who calls what, and where it runs:

* :class:`LayoutCache` ``find``/``build`` and :class:`SaveInputs` — ``TieredWriter.write_data``,
  on the thread that runs ``dcp.save`` (every rank). Per item that thread only resolves the item
  (DCP's ``planner.resolve_data``) and reads the tensor's shape, dtype, contiguity and version
  counter; a cached :class:`RankLayout` supplies offsets, lengths, the chunk and checksum plans
  and the ``WriteResult`` list.
* :meth:`SaveInputs.capture_plan` — ``RankSave.plan`` on the capture thread: builds the sources,
  the pieces of every chunk and the checksum slots from the cached plan (index form) and this
  save's tensors.
* :func:`expand_results` — the coordinator, on a background thread after ``finish``: turns each
  rank's compact :class:`RankResult` into the per-item ``WriteResult``/``ItemRecord`` list that the
  commit merges into ``metadata.json``.

File layout of a rank: its tensor items first, in plan order, each at a multiple of
:data:`~tierckpt.layout.ALIGN`; then its serialized (BYTE_IO) items, whose sizes may change from
save to save without invalidating the tensor layout.
"""

from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CaptureError
from ..format.layout import ALIGN, padded, rank_file
from ..format.metadata import DTYPES, ItemRecord
from .copier import Piece, Source

__all__ = ["RankLayout", "LayoutCache", "SaveInputs", "RankResult", "expand_results", "layout_cache"]

_BYTE_IO = WriteItemType.BYTE_IO


_T = TypeVar("_T")


def _given(x: _T | None) -> _T:
    """``x``, which the layout guarantees is set (a None here is a bug in this module)."""
    assert x is not None
    return x


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _pieces(pos: int, length: int, c: int) -> int:
    """How many CRC pieces ``[pos, pos+length)`` has when cut at the chunk grid (``length`` padded)."""
    return 0 if length <= 0 else (pos + length - 1) // c - pos // c + 1


@dataclass(frozen=True, eq=False)
class RankLayout:
    """Where every tensor item of one plan goes in the rank's file, and everything derived from it.

    Immutable once built: several saves (and overlapping ``async_save`` calls) share it.
    ``items_ref`` is the plan item list it was built or last matched for (identity fast path:
    DCP's plan caching hands the same cached plan object to every save).
    """

    chunk_size: int
    items_ref: list[WriteItem]
    indexes: list[MetadataIndex]
    hints: list[int | None]
    types: list[WriteItemType]
    fqns: list[str]
    tidx: list[int]  # plan positions of the tensor items
    bidx: list[int]  # plan positions of the serialized (BYTE_IO) items
    shapes: list[torch.Size]  # per tensor item
    dtypes: list[torch.dtype]
    lens: list[int]
    pos: list[int]
    tensor_end: int  # the tensor region [0, tensor_end) of the file; serialized items follow
    results: list[WriteResult]  # plan order, storage_data None (a save replaces the first)
    counts: list[int]  # CRC pieces per plan item (0 for serialized items: set per save)
    chunk_specs: list[list[tuple[int, int, int, int]]]  # per chunk: (tensor k, src_off, slot_off, n)
    crc_specs: list[list[tuple[int, int, int, int]]]  # per chunk: (plan item, piece j, slot_off, n)
    blob: bytes  # the coordinator's copy of the layout (see RankResult)
    props_stale: bool  # the plan's tensor dtypes differ from the tensors' (a cached plan outlived a dtype change)


def _plan_dtypes(items: list[WriteItem], tidx: list[int]) -> list[torch.dtype | None]:
    out: list[torch.dtype | None] = []
    for i in tidx:
        td = items[i].tensor_data
        out.append(td.properties.dtype if td is not None else None)
    return out


def build_layout(items: list[WriteItem], tensors: list[torch.Tensor], tidx: list[int], chunk_size: int) -> RankLayout:
    """Lay out the tensor items of ``items`` (``tensors`` are their resolved values, in ``tidx`` order)."""
    c = chunk_size
    n_items = len(items)
    bidx = [i for i, it in enumerate(items) if it.type == _BYTE_IO]
    shapes = [t.shape for t in tensors]
    dtypes = [t.dtype for t in tensors]
    lens = [t.numel() * t.element_size() for t in tensors]
    pos: list[int] = []
    at = 0
    for n in lens:
        pos.append(at)
        at += n + (-n) % ALIGN
    tensor_end = at
    nchunks = (tensor_end + c - 1) // c
    chunk_specs: list[list[tuple[int, int, int, int]]] = [[] for _ in range(nchunks)]
    crc_specs: list[list[tuple[int, int, int, int]]] = [[] for _ in range(nchunks)]
    counts = [0] * n_items
    size_of = [0] * n_items
    for k, (i, p, n) in enumerate(zip(tidx, pos, lens)):
        size_of[i] = n
        off = 0
        while off < n:  # the item's bytes, cut at the chunk grid
            a = p + off
            ck = a // c
            m = min(n - off, (ck + 1) * c - a)
            chunk_specs[ck].append((k, off, a - ck * c, m))
            off += m
        end = p + padded(n)  # its checksum pieces: bytes and padding, cut at the grid
        j = 0
        a = p
        while a < end:
            ck = a // c
            b = min(end, (ck + 1) * c)
            crc_specs[ck].append((i, j, a - ck * c, b - a))
            a = b
            j += 1
        counts[i] = j
    results = [WriteResult(index=it.index, size_in_bytes=size_of[i], storage_data=None) for i, it in enumerate(items)]
    blob = pickle.dumps(
        (tidx, pos, lens, [_dtype_name(d) for d in dtypes], [tuple(s) for s in shapes], bidx),
        protocol=pickle.HIGHEST_PROTOCOL,
    )
    indexes = [it.index for it in items]
    return RankLayout(
        chunk_size=c,
        items_ref=items,
        indexes=indexes,
        hints=[x.index for x in indexes],
        types=[it.type for it in items],
        fqns=[x.fqn for x in indexes],
        tidx=tidx,
        bidx=bidx,
        shapes=shapes,
        dtypes=dtypes,
        lens=lens,
        pos=pos,
        tensor_end=tensor_end,
        results=results,
        counts=counts,
        chunk_specs=chunk_specs,
        crc_specs=crc_specs,
        blob=blob,
        props_stale=_plan_dtypes(items, tidx) != dtypes,
    )


class LayoutCache:
    """The last few layouts of this process for one chunk size (thread-safe).

    :meth:`find` returns the layout of a plan with the same items (same object, or equal indexes,
    index hints and item types); the caller still checks the tensors' shapes and dtypes against
    it (:meth:`SaveInputs.prepare`), so a layout is never reused for tensors it was not made for.
    """

    def __init__(self, chunk_size: int, keep: int = 4) -> None:
        self.chunk_size = chunk_size
        self.keep = keep
        self._lays: list[RankLayout] = []
        self._lock = threading.Lock()
        self.builds = 0  # layouts built from scratch (tests and the bench read it)

    def find(self, items: list[WriteItem]) -> RankLayout | None:
        with self._lock:
            lays = list(self._lays)
        for lay in lays:
            if lay.items_ref is items:
                return lay
        n = len(items)
        cands = [lay for lay in lays if len(lay.indexes) == n]
        if not cands:
            return None
        indexes = [it.index for it in items]
        for lay in cands:
            if (
                lay.indexes == indexes
                and [x.index for x in indexes] == lay.hints
                and [it.type for it in items] == lay.types
            ):
                # An equal plan in a new object (no DCP plan caching): bind the layout to it.
                rebound = replace(lay, items_ref=items, props_stale=_plan_dtypes(items, lay.tidx) != lay.dtypes)
                self._put(rebound, replacing=lay)
                return rebound
        return None

    def build(self, items: list[WriteItem], tensors: list[torch.Tensor], tidx: list[int]) -> RankLayout:
        lay = build_layout(items, tensors, tidx, self.chunk_size)
        self.builds += 1
        self._put(lay)
        return lay

    def _put(self, lay: RankLayout, replacing: RankLayout | None = None) -> None:
        with self._lock:
            self._lays = [x for x in self._lays if x is not replacing and x.items_ref is not lay.items_ref]
            self._lays.insert(0, lay)
            del self._lays[self.keep :]


_caches: dict[int, LayoutCache] = {}
_caches_lock = threading.Lock()


def layout_cache(chunk_size: int) -> LayoutCache:
    """The process-wide :class:`LayoutCache` for ``chunk_size``."""
    with _caches_lock:
        cache = _caches.get(chunk_size)
        if cache is None:
            cache = _caches[chunk_size] = LayoutCache(chunk_size)
        return cache


@dataclass(eq=False)
class RankResult:
    """Rank -> coordinator: the storage data of a rank's *first* ``WriteResult`` (the others carry
    ``None``, as cheap to gather as DCP's own). ``blob`` is the layout's tensor part
    (:attr:`RankLayout.blob`, the same bytes object for every save of a plan shape); the
    serialized items' positions and lengths are this save's."""

    blob: bytes
    byte_pos: list[int]
    byte_len: list[int]
    size: int
    props_stale: bool


@dataclass(eq=False)
class SaveInputs:
    """One save's data on one rank, gathered on the training thread by :meth:`prepare`."""

    layout: RankLayout
    tensors: list[torch.Tensor]  # per tensor item (contiguous: private copies of non-contiguous ones)
    guards: list[torch.Tensor | None] | None  # version-guarded tensors (None: ``tensors`` themselves)
    versions: list[int]
    byte_data: list[bytes]
    byte_pos: list[int]
    size: int

    @staticmethod
    def prepare(items: list[WriteItem], datas: list[Any], cache: LayoutCache) -> SaveInputs:
        """Resolve a save's layout for ``items`` whose resolved values are ``datas`` (plan order).

        Reuses a cached layout when the plan and the tensors' shapes and dtypes match it, else
        builds (and caches) a new one.
        """
        lay = cache.find(items)
        tidx = lay.tidx if lay is not None else [i for i, it in enumerate(items) if it.type != _BYTE_IO]
        tensors = [datas[i] for i in tidx]
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            tensors = [t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in tensors]
        if lay is None or [t.shape for t in tensors] != lay.shapes or [t.dtype for t in tensors] != lay.dtypes:
            lay = cache.build(items, tensors, tidx)
        contiguous = [t.is_contiguous() for t in tensors]
        guards: list[torch.Tensor | None] | None = None
        if all(contiguous):
            versions = [t._version for t in tensors]
        else:  # a non-contiguous tensor is copied now: a private snapshot that nothing can tear
            guards = [t if ok else None for t, ok in zip(tensors, contiguous)]
            versions = [g._version if g is not None else 0 for g in guards]
            tensors = [t if ok else t.contiguous() for t, ok in zip(tensors, contiguous)]
        byte_data: list[bytes] = []
        byte_pos: list[int] = []
        at = lay.tensor_end
        for i in lay.bidx:
            d = datas[i]
            raw = bytes(d.getbuffer() if hasattr(d, "getbuffer") else d)
            byte_data.append(raw)
            byte_pos.append(at)
            at += padded(len(raw))
        return SaveInputs(lay, tensors, guards, versions, byte_data, byte_pos, at)

    @property
    def n_items(self) -> int:
        return len(self.layout.types)

    def results(self) -> list[WriteResult]:
        """The ``WriteResult`` list for DCP: the layout's, with this save's :class:`RankResult` first."""
        lay = self.layout
        out = list(lay.results)
        if out:
            first = out[0]
            out[0] = WriteResult(
                index=first.index,
                size_in_bytes=first.size_in_bytes,
                storage_data=RankResult(
                    lay.blob, self.byte_pos, [len(b) for b in self.byte_data], self.size, lay.props_stale
                ),
            )
        return out

    def ready_sources(self) -> list[Source]:
        """One source per CUDA device among the tensors: enough for ``Copier.record_ready`` (the
        training thread records one 'state as of this save' event per device)."""
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return []
        seen: dict[int, Source] = {}
        for t in self.tensors:
            if t.is_cuda and t.device.index not in seen:
                seen[t.device.index] = Source(item=-1, fqn="", pos=0, length=0, tensor=t)
        return list(seen.values())

    def capture_plan(
        self,
    ) -> tuple[list[Source], list[list[Piece]], list[list[tuple[int, int, int, int]]], list[list[int]]]:
        """Capture thread: (sources, pieces per chunk, CRC pieces per chunk, CRC slots per item)."""
        lay = self.layout
        c = lay.chunk_size
        guards = self.guards if self.guards is not None else self.tensors
        srcs: list[Source | None] = [None] * len(self.tensors)
        sources: list[Source] = []
        fqns, tidx = lay.fqns, lay.tidx
        for k, (t, g, v, p, n) in enumerate(zip(self.tensors, guards, self.versions, lay.pos, lay.lens)):
            if n:
                s = srcs[k] = Source(item=tidx[k], fqn=fqns[tidx[k]], pos=p, length=n, tensor=t, guard=g, version=v)
                sources.append(s)
        chunks = [[Piece(_given(srcs[k]), off, slot, n) for k, off, slot, n in spec] for spec in lay.chunk_specs]
        crc_pieces = list(lay.crc_specs)  # shared inner lists: never mutated, replaced where the tail adds
        counts = list(lay.counts)
        nchunks = (self.size + c - 1) // c
        if nchunks > len(chunks):
            chunks += [[] for _ in range(nchunks - len(chunks))]
            crc_pieces += [[] for _ in range(nchunks - len(crc_pieces))]
        touched: set[int] = set()
        for i, raw, p in zip(lay.bidx, self.byte_data, self.byte_pos):
            n = len(raw)
            if n:
                s = Source(item=i, fqn=fqns[i], pos=p, length=n, data=memoryview(raw))
                sources.append(s)
                off = 0
                while off < n:
                    a = p + off
                    ck = a // c
                    m = min(n - off, (ck + 1) * c - a)
                    chunks[ck].append(Piece(s, off, a - ck * c, m))
                    off += m
            end = p + padded(n)
            j = 0
            a = p
            while a < end:
                ck = a // c
                b = min(end, (ck + 1) * c)
                if ck not in touched:
                    crc_pieces[ck] = list(crc_pieces[ck])
                    touched.add(ck)
                crc_pieces[ck].append((i, j, a - ck * c, b - a))
                a = b
                j += 1
            counts[i] = j
        crcs = [[0] * n for n in counts]
        return sources, chunks, crc_pieces, crcs


# -- coordinator --------------------------------------------------------------------------

_decoded: dict[bytes, tuple] = {}
_decoded_lock = threading.Lock()


def _decode(blob: bytes) -> tuple:
    with _decoded_lock:
        hit = _decoded.get(blob)
    if hit is not None:
        return hit
    tidx, pos, lens, dtypes, shapes, bidx = pickle.loads(blob)  # noqa: S301 - gathered from this job's ranks by DCP (pickle already)
    for d in dtypes:
        if d not in DTYPES:
            raise CaptureError(f"a rank reported an unsupported dtype {d!r}")
    out = (tidx, pos, lens, dtypes, [tuple(s) for s in shapes], bidx)
    with _decoded_lock:
        if len(_decoded) >= 64:
            _decoded.clear()
        _decoded[blob] = out
    return out


def expand_results(
    checkpoint_id: str, token: str, results: list[list[WriteResult]]
) -> tuple[list[list[WriteResult]], dict[str, torch.dtype]]:
    """Coordinator, background: every rank's per-item ``WriteResult`` with its :class:`ItemRecord`.

    Returns the expanded results and, for ranks whose cached plan had stale tensor dtypes, the
    dtype each of their keys really has (to correct DCP's metadata with :func:`patch_dtypes`).
    """
    out: list[list[WriteResult]] = []
    fixes: dict[str, torch.dtype] = {}
    for r, res in enumerate(results):
        if not res:
            out.append([])
            continue
        rr = res[0].storage_data
        if not isinstance(rr, RankResult):
            raise CaptureError(
                f"checkpoint {checkpoint_id}: rank {r} did not save through a TieredWriter "
                f"(its write results carry {type(rr).__name__})"
            )
        tidx, pos, lens, dtypes, shapes, bidx = _decode(rr.blob)
        if len(tidx) + len(bidx) != len(res) or len(bidx) != len(rr.byte_pos):
            raise CaptureError(
                f"checkpoint {checkpoint_id}: rank {r} reported a layout for "
                f"{len(tidx) + len(bidx)} items and {len(res)} write results"
            )
        file = rank_file(r, token)
        recs: list[ItemRecord | None] = [None] * len(res)
        for i, p, n, d, s in zip(tidx, pos, lens, dtypes, shapes):
            recs[i] = ItemRecord(file=file, pos=p, length=n, dtype=d, shape=s)
        for i, p, n in zip(bidx, rr.byte_pos, rr.byte_len):
            recs[i] = ItemRecord(file=file, pos=p, length=n)
        done = [_given(rec) for rec in recs]  # every item got its record above (the counts were checked)
        out.append(
            [WriteResult(index=wr.index, size_in_bytes=rec.length, storage_data=rec) for wr, rec in zip(res, done)]
        )
        if rr.props_stale:
            for i, d in zip(tidx, dtypes):
                fixes[res[i].index.fqn] = DTYPES[d]
    return out, fixes


def patch_dtypes(md: Metadata, fixes: dict[str, torch.dtype]) -> Metadata:
    """``md`` with the tensor dtypes in ``fixes`` (keys whose saved dtype differs from the plan's)."""
    if not fixes:
        return md
    sdm = dict(md.state_dict_metadata)
    for fqn, dtype in fixes.items():
        m = sdm.get(fqn)
        if isinstance(m, TensorStorageMetadata) and m.properties.dtype != dtype:
            sdm[fqn] = replace(m, properties=replace(m.properties, dtype=dtype))
    return replace(md, state_dict_metadata=sdm)
