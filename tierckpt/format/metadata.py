"""``metadata.json``: the commit marker of a checkpoint -- item records, the manifest, the commit
header, and DCP ``Metadata`` to and from JSON.

``metadata.json`` is a header line (format, length, CRC32C of the body: :class:`CommitHeader`)
followed by the JSON body, so any corruption of it is detected. The body holds DCP's Metadata
plus, for every item, an :class:`ItemRecord` (its file, offset, length, dtype, shape and CRC32C
pieces, :func:`tierckpt.format.layout.piece_bounds`), the :class:`CheckpointManifest` (files,
sizes, commit order) and, on a tier that stores encoded files, their index
(:mod:`tierckpt.format.stored`).

Metadata is JSON, never pickle: :func:`metadata_to_json` / :func:`metadata_from_json` rebuild
DCP's ``Metadata`` and validate everything a hostile file could abuse (keys, sizes, dtypes); the
conversions of DCP's own objects come from :mod:`tierckpt.format.dcpjson` (shared with the plan
cache).

This module does not import torch: :func:`parse_metadata` validates a whole ``metadata.json``
into a :class:`CheckpointDoc` (manifest, checked entries, item records) with the torch-free
helpers of :mod:`tierckpt.format.jsonvalues`; only :meth:`CheckpointDoc.to_metadata` (and so
:func:`metadata_from_json`) and :func:`metadata_to_json` import torch, when called. The restore
CLI's ``latest``, ``list``, ``verify`` and ``fetch`` therefore never load torch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ..checksum import crc32c
from ..errors import CorruptCheckpoint, InvalidCheckpointId
from . import safejson
from .jsonvalues import (
    DTYPE_SIZES,
    METADATA_VALUES,
    CheckedEntry,
    _brief,
    _cut,
    _int,
    _ints,
    _list,
    _obj,
    _req,
    _str,
    _time,
    check_entry,
)
from .layout import (
    ALIGN,
    FORMAT,
    MAX_HEADER_BYTES,
    MAX_METADATA_BYTES,
    check_checkpoint_id,
    is_data_file,
    padded,
    piece_bounds,
)
from .stored import StoredFile, parse_stored

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "CommitHeader",
    "read_header",
    "HEADER_MAX",
    "ItemRecord",
    "CheckpointManifest",
    "item_intact",
    "metadata_to_json",
    "metadata_from_json",
    "parse_metadata",
    "CheckpointDoc",
    "ItemIndex",
    "iter_items",
    "DTYPE_SIZES",
]


def item_intact(rec: ItemRecord, data, pad, chunk_size: int) -> bool:
    """Whether ``data`` (an item's bytes) followed by ``pad`` (its padding) match its CRC pieces.

    ``data`` and ``pad`` are byte buffers (memoryview, bytearray, numpy ``uint8``).
    """
    import numpy as np

    d = np.frombuffer(data, dtype=np.uint8) if len(data) else np.zeros(0, np.uint8)
    p = np.frombuffer(pad, dtype=np.uint8) if len(pad) else np.zeros(0, np.uint8)
    n = len(d)
    for (s, e), crc in zip(piece_bounds(rec.pos, padded(rec.length), chunk_size), rec.crcs):
        a, b = s - rec.pos, e - rec.pos
        if b <= n:
            got = crc32c(d[a:b])
        elif a >= n:
            got = crc32c(p[a - n : b - n])
        else:
            got = crc32c(p[: b - n], crc32c(d[a:n]))
        if got != crc:
            return False
    return True


class ItemIndex(NamedTuple):
    """An item's key in a parsed checkpoint, without torch: the fields of DCP's ``MetadataIndex``
    (``fqn``, ``offset`` or None, ``index`` hint or None); :meth:`CheckpointDoc.to_metadata` turns
    it into one."""

    fqn: str
    offset: tuple[int, ...] | None
    index: int | None  # type: ignore[assignment]  # DCP's MetadataIndex field name (shadows tuple.index)


@dataclass
class ItemRecord:
    """Where one saved item (a tensor chunk or a serialized object) lives, and its checksums.

    ``dtype``/``shape`` are empty for non-tensor (BYTE_IO) items. ``crcs`` has one CRC32C per
    piece (see :func:`piece_bounds`); it is filled in after the bytes were flushed.
    ``nonfinite``: the NaN/Inf elements the capture counted in it (``[job] nonfinite``; ``None``:
    not scanned, as in every checkpoint written before the scan existed).
    """

    file: str
    pos: int
    length: int
    dtype: str = ""
    shape: tuple[int, ...] = ()
    crcs: list[int] = field(default_factory=list)
    nonfinite: int | None = None

    @property
    def is_tensor(self) -> bool:
        return bool(self.dtype)


@dataclass
class CheckpointManifest:
    """What ``metadata.json`` holds besides DCP's Metadata."""

    checkpoint_id: str
    world_size: int
    chunk_size: int
    files: dict[str, int]  # file name -> size in bytes
    created: float = field(default_factory=time.time)
    committed: float = 0.0
    step: int | None = None
    save_token: str = ""
    seq: int = 0  # commit sequence: 1 + the highest seq the job had seen when it committed (the order)
    stored: dict[str, StoredFile] = field(default_factory=dict)  # this tier's encoded files (tierckpt.codec)

    def stored_size(self, file: str) -> int:
        """Bytes of ``file``'s object on the tier this manifest was read from."""
        s = self.stored.get(file)
        return self.files[file] if s is None else s.stored


def _index_key(idx: Any) -> list:
    return [idx.fqn, list(idx.offset) if idx.offset is not None else None, idx.index]


def metadata_to_json(md: Metadata, manifest: CheckpointManifest) -> bytes:
    """Serialize DCP ``Metadata`` (whose ``storage_data`` maps MetadataIndex -> ItemRecord)."""
    import torch

    from .dcpjson import entry_to_json

    sdm = {fqn: entry_to_json(fqn, m) for fqn, m in md.state_dict_metadata.items()}
    items = []
    for idx, rec in (md.storage_data or {}).items():
        item = {
            "index": _index_key(idx),
            "file": rec.file,
            "pos": rec.pos,
            "length": rec.length,
            "dtype": rec.dtype,
            "shape": list(rec.shape),
            "crcs": rec.crcs,
        }
        if getattr(rec, "nonfinite", None) is not None:
            item["nonfinite"] = rec.nonfinite
        items.append(item)
    sm = md.storage_meta
    doc = {
        "format": FORMAT,
        "checkpoint_id": manifest.checkpoint_id,
        "step": manifest.step,
        "created": manifest.created,
        "committed": manifest.committed,
        "world_size": manifest.world_size,
        "chunk_size": manifest.chunk_size,
        "save_token": manifest.save_token,
        "seq": manifest.seq,
        "files": manifest.files,
        "torch_version": torch.__version__,
        "dcp": {
            "version": getattr(md, "version", None),
            "state_dict_metadata": sdm,
            "planner_data": METADATA_VALUES.encode(md.planner_data, "planner_data"),
            "storage_meta": None
            if sm is None
            else {
                "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
                "save_id": sm.save_id,
                "load_id": sm.load_id,
                "modules": list(sm.modules or []),
            },
        },
        "items": items,
    }
    body = json.dumps(doc, separators=(",", ":")).encode()
    header = json.dumps(
        {
            "format": FORMAT,
            "length": len(body),
            "crc32c": crc32c(body),
            "seq": manifest.seq,
            "step": manifest.step,
            "committed": manifest.committed,
        }
    ).encode()
    return header + b"\n" + body


HEADER_MAX = 1024  # bytes of metadata.json that always hold its header line


@dataclass(frozen=True)
class CommitHeader:
    """The order-relevant fields of a ``metadata.json`` header line (read without the body).

    The body repeats them under its CRC32C; :func:`metadata_from_json` checks that both agree, so
    a header that lies makes the checkpoint unloadable, never silently misordered on load.
    """

    seq: int
    step: int | None
    committed: float

    def order_key(self) -> tuple:
        """How checkpoints are ordered everywhere: commit sequence, then commit time, then step."""
        return (self.seq, self.committed, -1 if self.step is None else self.step)


def read_header(prefix: bytes) -> CommitHeader | None:
    """The :class:`CommitHeader` in the first line of ``prefix`` (the first bytes of a
    ``metadata.json``), or None if it is not a valid tierckpt header."""
    line, sep, _ = bytes(prefix[:HEADER_MAX]).partition(b"\n")
    if not sep:
        return None
    try:
        h = safejson.loads(line)
    except ValueError:
        return None
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        return None
    seq, step, committed = h.get("seq", 0), h.get("step"), h.get("committed", 0.0)
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        return None
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        return None
    if isinstance(committed, bool) or not isinstance(committed, (int, float)) or committed != committed:
        return None
    return CommitHeader(seq=seq, step=step, committed=float(committed))


def _n_pieces(pos: int, length: int, chunk_size: int) -> int:
    """``len(piece_bounds(pos, length, chunk_size))``, computed without building the list."""
    return 0 if length <= 0 else (pos + length - 1) // chunk_size - pos // chunk_size + 1


@dataclass
class CheckpointDoc:
    """A ``metadata.json`` parsed and validated without torch (:func:`parse_metadata`).

    ``entries`` holds every state dict key's checked entry, ``items`` every saved item's
    (:class:`ItemIndex`, :class:`ItemRecord`) in file order of the document; ``planner_data`` is
    decoded, ``storage_meta`` the checked fields of DCP's ``StorageMeta`` (or None). Restore tools
    that only need where the bytes are and their checksums (``verify``, ``fetch``) use it as it is;
    :meth:`to_metadata` builds DCP's ``Metadata`` (importing torch).
    """

    manifest: CheckpointManifest
    entries: dict[str, CheckedEntry]
    items: list[tuple[ItemIndex, ItemRecord]]
    planner_data: Any = None
    storage_meta: dict[str, Any] | None = None
    version: str | None = None

    def to_metadata(self) -> Metadata:
        """DCP ``Metadata`` whose ``storage_data`` maps ``MetadataIndex`` to :class:`ItemRecord`
        (the same record objects as :attr:`items`)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta

        from .dcpjson import entry_from_checked, new_metadata

        sdm = {fqn: entry_from_checked(e) for fqn, e in self.entries.items()}
        storage = {
            MetadataIndex(i.fqn, None if i.offset is None else list(i.offset), i.index): rec for i, rec in self.items
        }
        sm = None if self.storage_meta is None else StorageMeta(**self.storage_meta)
        return new_metadata(sdm, self.planner_data, sm, self.version, storage_data=storage)

    def files_items(self) -> dict[str, list[tuple[ItemIndex, ItemRecord]]]:
        """The items of each data file, in file order."""
        out: dict[str, list[tuple[ItemIndex, ItemRecord]]] = {}
        for idx, rec in self.items:
            out.setdefault(rec.file, []).append((idx, rec))
        for items in out.values():
            items.sort(key=lambda x: x[1].pos)
        return out


def metadata_from_json(raw: bytes, where: str) -> tuple[Metadata, CheckpointManifest]:
    """Parse and validate ``metadata.json`` (``where`` names it in errors) into DCP ``Metadata``
    (whose ``storage_data`` maps ``MetadataIndex`` to :class:`ItemRecord`) and the manifest.

    :func:`parse_metadata` then :meth:`CheckpointDoc.to_metadata`: the same checks, the same errors.
    """
    doc = parse_metadata(raw, where)
    return doc.to_metadata(), doc.manifest


def parse_metadata(raw: bytes, where: str) -> CheckpointDoc:
    """Parse and validate ``metadata.json`` (``where`` names it in errors), without torch.

    Rejects unknown formats, file names outside the checkpoint, items past the end of their file,
    and tensor lengths that do not match dtype and shape.

    Any bytes whatsoever either parse or raise :class:`CorruptCheckpoint` naming ``where`` (never
    ``RecursionError``, ``TypeError``, ...): the JSON is decoded by :func:`tierckpt.safejson.loads`
    (bounded nesting, no NaN/Infinity, no duplicate keys, no huge integers) and every field is
    type- and range-checked. Time and memory are linear in ``len(raw)`` (at most
    :data:`MAX_METADATA_BYTES`); messages quote no more than a few dozen characters of the input.
    """
    if len(raw) > MAX_METADATA_BYTES:
        raise CorruptCheckpoint(f"{where}: metadata is larger than {MAX_METADATA_BYTES} bytes")
    head, sep, body = bytes(raw).partition(b"\n")
    try:
        header = safejson.loads(head) if sep and len(head) <= MAX_HEADER_BYTES else None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError("no tierckpt header line")
        if header.get("length") != len(body) or header.get("crc32c") != crc32c(body):
            raise CorruptCheckpoint(f"{where}: metadata failed its CRC32C/length check (corrupted or truncated)")
        try:
            doc = safejson.loads(body)
        except ValueError as e:  # the header checked out: a tierckpt file whose body is hostile
            raise CorruptCheckpoint(f"{where}: malformed metadata JSON ({e})") from None
        if isinstance(doc, dict) and any(k in header and header[k] != doc.get(k) for k in ("seq", "step", "committed")):
            raise CorruptCheckpoint(f"{where}: the metadata header does not match its body (seq/step/commit time)")
    except CorruptCheckpoint:
        raise
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpoint(f"{where}: not valid tierckpt metadata ({e}); is this a tierckpt checkpoint?") from None
    try:
        return _parse(doc, where)
    except CorruptCheckpoint as e:
        msg = str(e)
        raise CorruptCheckpoint(msg if msg.startswith(where) else f"{where}: {msg}") from None
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - any other failure on hostile input is corruption too
        raise CorruptCheckpoint(f"{where}: malformed metadata ({type(e).__name__}: {_cut(str(e))})") from None


def _parse(doc: Any, where: str) -> CheckpointDoc:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{where}: not a {FORMAT} metadata file")
    try:
        cid = check_checkpoint_id(_str(_req(doc, "checkpoint_id", "the document"), "checkpoint_id", 200))
    except InvalidCheckpointId as e:  # stored metadata naming an impossible id: the file is corrupt
        raise CorruptCheckpoint(f"metadata: {e}") from None
    chunk_size = _int(_req(doc, "chunk_size", "the document"), "chunk_size", 4096)
    files_raw = _obj(_req(doc, "files", "the document"), "'files'")
    files: dict[str, int] = {}
    for name, size in files_raw.items():
        if not is_data_file(name):
            raise CorruptCheckpoint(f"metadata: data file name {_brief(name)} is not allowed")
        files[name] = _int(size, f"size of {name}")
    step = doc.get("step")
    manifest = CheckpointManifest(
        checkpoint_id=cid,
        world_size=_int(_req(doc, "world_size", "the document"), "world_size", 1, 1 << 24),
        chunk_size=chunk_size,
        files=files,
        created=_time(_req(doc, "created", "the document"), "created"),
        committed=_time(_req(doc, "committed", "the document"), "committed"),
        step=None if step is None else _int(step, "step"),
        save_token=_str(doc.get("save_token", ""), "save_token", 256),
        seq=_int(doc.get("seq", 0), "seq"),
        stored=parse_stored(doc.get("stored"), files),
    )
    d = _obj(_req(doc, "dcp", "the document"), "'dcp'")
    sdm: dict[str, CheckedEntry] = {}
    for fqn, m in _obj(_req(d, "state_dict_metadata", "'dcp'"), "'state_dict_metadata'").items():
        try:
            sdm[fqn] = check_entry(m)
        except CorruptCheckpoint as e:
            raise CorruptCheckpoint(f"{e} (entry {_brief(fqn)})") from None
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpoint(
                f"metadata: malformed entry {_brief(fqn)} ({type(e).__name__}: {_cut(str(e), 80)})"
            ) from None
    storage: list[tuple[ItemIndex, ItemRecord]] = []
    for n, it in enumerate(_list(_req(doc, "items", "the document"), "'items'")):
        try:
            idx, rec = _item(it, sdm, files, chunk_size)
        except CorruptCheckpoint as e:
            raise CorruptCheckpoint(f"{e} (item {n})") from None
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpoint(f"metadata: malformed item {n} ({type(e).__name__}: {_cut(str(e), 80)})") from None
        storage.append((idx, rec))
    sm = d.get("storage_meta")
    storage_meta = None
    if sm is not None:
        _obj(sm, "'storage_meta'")
        storage_meta = dict(
            checkpoint_id=_str(sm.get("checkpoint_id"), "storage_meta checkpoint_id", 4096, none=True),
            save_id=_str(sm.get("save_id"), "storage_meta save_id", 256, none=True),
            load_id=_str(sm.get("load_id"), "storage_meta load_id", 256, none=True),
            modules=[
                _str(x, "storage_meta module", 4096) for x in _list(sm.get("modules", []), "storage_meta modules")
            ],
        )
    return CheckpointDoc(
        manifest,
        sdm,
        storage,
        METADATA_VALUES.decode(d.get("planner_data")),
        storage_meta,
        _str(d.get("version"), "dcp version", 64, none=True),
    )


def _item(
    it: Any, sdm: dict[str, CheckedEntry], files: dict[str, int], chunk_size: int
) -> tuple[ItemIndex, ItemRecord]:
    """One element of ``items`` -> (index, record), checked against the entries and files (hot)."""
    if type(it) is not dict:
        raise CorruptCheckpoint(f"metadata: an item must be an object, got {_brief(it)}")
    index = it["index"]
    if type(index) is not list or len(index) != 3:
        raise CorruptCheckpoint(f"metadata: an item's index must be [key, offset, index], got {_brief(index)}")
    fqn, off, idx_n = index
    if type(fqn) is not str or fqn not in sdm:
        raise CorruptCheckpoint(f"metadata: item for unknown key {_brief(fqn)}")
    file = it["file"]
    if type(file) is not str or file not in files:
        raise CorruptCheckpoint(
            f"metadata: item {_brief(fqn)} names file {_brief(file)} that is not part of the checkpoint"
        )
    pos, length = _int(it["pos"], "pos"), _int(it["length"], "length")
    if pos % ALIGN or pos + padded(length) > files[file]:
        raise CorruptCheckpoint(
            f"metadata: item {_brief(fqn)} [{pos}, {pos + length}) is misaligned or runs past the end of {file} ({files[file]} bytes)"
        )
    dtype = it.get("dtype", "")
    if type(dtype) is not str:
        raise CorruptCheckpoint(f"metadata: item {_brief(fqn)} has dtype {_brief(dtype)}")
    shape = tuple(_ints(it.get("shape", []), "shape"))
    if dtype:
        if dtype not in DTYPE_SIZES:
            raise CorruptCheckpoint(f"metadata: item {_brief(fqn)} has unsupported dtype {_brief(dtype)}")
        numel = 1
        for n in shape:
            numel *= n
        if numel * DTYPE_SIZES[dtype] != length:
            raise CorruptCheckpoint(f"metadata: item {_brief(fqn)} length {length} does not match {dtype}{list(shape)}")
    crcs = it["crcs"]
    if type(crcs) is not list or len(crcs) != _n_pieces(pos, padded(length), chunk_size):
        raise CorruptCheckpoint(f"metadata: item {_brief(fqn)} has a wrong number of checksums")
    _ints(crcs, "crc", len(crcs), 0xFFFFFFFF)
    nf = it.get("nonfinite")
    rec = ItemRecord(
        file=file,
        pos=pos,
        length=length,
        dtype=dtype,
        shape=shape,
        crcs=crcs,
        nonfinite=None if nf is None else _int(nf, "nonfinite"),
    )
    idx = ItemIndex(
        fqn, None if off is None else tuple(_ints(off, "offset")), None if idx_n is None else _int(idx_n, "index")
    )
    return idx, rec


def iter_items(md: Metadata) -> Iterator[tuple[Any, ItemRecord]]:
    """Every (index, record) pair of a parsed checkpoint."""
    yield from (md.storage_data or {}).items()


def __getattr__(name: str) -> Any:
    # DTYPES maps dtype names to torch dtypes: importing it (the reader does) imports torch, not this module.
    if name == "DTYPES":
        from .dcpjson import DTYPES

        return DTYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
