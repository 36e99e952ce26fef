"""The stored index of an encoded data file, and its place in ``metadata.json``.

A tier that stores a data file encoded (:mod:`tierckpt.codec`) records, in *its own* copy of the
checkpoint's ``metadata.json``, under the body's top-level key ``"stored"``, one
:class:`StoredFile` per data file::

    "stored": {"rank-00000-ab12cd34.data": {"codec": "zstd", "level": 1, "frame": 4194304,
               "size": <logical bytes>, "sizes": <base64 of u32 stored bytes per frame>,
               "hashes": <base64 of 16-byte xxh3_128 per frame>}}

Frame ``i`` holds logical bytes ``[i * frame, min(size, (i + 1) * frame))``; its stored bytes
follow each other in frame order (offsets are the running sum of ``sizes``). ``frame`` is at least
4 KiB and at most :data:`MAX_FRAME` (16 MiB); writers use 4 KiB to 4 MiB
(:func:`tierckpt.codec.frame_size`). It may exceed ``size`` (a small file is one short frame):
what a reader holds for a frame is the frame's logical bytes, at most ``min(frame, size)``. ``codec = "none"``
stores frames as they are (the stored object is the data file itself; the index then only
carries the hashes that let the next checkpoint copy unchanged parts). The hashes are of the
*logical* bytes: two frames with the same hash are byte-identical (128 bits; the CRC32C pieces
of the items still check every byte read back).

The first tier's ``metadata.json`` has no ``"stored"``; a hop that encodes adds it
(:func:`add_stored`) before the commit, so the tier's copy is committed together with its index.
Anything that copies metadata onto a tier holding plain files (fetch, the load's fill) removes it
first (:func:`strip_stored`, byte-identical to the first tier's copy). A ``metadata.json``
without ``"stored"`` (every checkpoint written before this existed) means plain files.

No torch here: :func:`tierckpt.layout.parse_metadata` calls :func:`parse_stored`.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

import numpy as np

from ..errors import CorruptCheckpoint

__all__ = [
    "StoredFile",
    "CODECS",
    "HASH_BYTES",
    "MAX_FRAME",
    "parse_stored",
    "add_stored",
    "strip_stored",
    "frame_hash",
]

CODECS = ("none", "zstd")
HASH_BYTES = 16
MAX_FRAME = 16 << 20
"""The largest ``frame`` an index may give (logical bytes per frame); a larger one is corrupt.
Readers decode whole frames into buffers of up to a frame, on every read thread, so the index,
read from a tier an attacker may write, must not choose that size: 4x the frames every release
wrote (``tierckpt.codec.FRAME``, 4 MiB), room for a later writer without letting one index
entry cost a reader more than a few frames of memory."""
_KEY = b'"stored":'


def frame_hash(data: memoryview | bytes | bytearray | np.ndarray) -> bytes:
    """The 128-bit hash (xxh3_128) of a frame's logical bytes, deciding whether two frames are equal."""
    import xxhash

    return xxhash.xxh3_128_digest(data)


@dataclass
class StoredFile:
    """How one data file is stored on an encoding tier (see the module docstring)."""

    codec: str
    frame: int
    size: int
    sizes: list[int]
    hashes: list[bytes]
    level: int = 0
    _offsets: list[int] = field(default_factory=list, repr=False, compare=False)

    @property
    def frames(self) -> int:
        return len(self.sizes)

    @property
    def stored(self) -> int:
        """Bytes of the stored object."""
        return self.offsets[-1]

    @property
    def offsets(self) -> list[int]:
        """Stored offset of every frame, and the total at the end (``frames + 1`` values)."""
        if len(self._offsets) != len(self.sizes) + 1:
            self._offsets = [0, *np.cumsum(self.sizes, dtype=np.int64).tolist()]
        return self._offsets

    @property
    def plain(self) -> bool:
        """Whether the stored object is the data file itself (stored offsets = logical offsets)."""
        return self.codec == "none"

    def span(self, i: int) -> tuple[int, int]:
        """Logical bytes ``[start, end)`` of frame ``i``."""
        return i * self.frame, min(self.size, (i + 1) * self.frame)

    def to_json(self) -> dict:
        return {
            "codec": self.codec,
            "level": self.level,
            "frame": self.frame,
            "size": self.size,
            "sizes": base64.b64encode(np.asarray(self.sizes, dtype="<u4").tobytes()).decode(),
            "hashes": base64.b64encode(b"".join(self.hashes)).decode(),
        }

    @classmethod
    def from_json(cls, d: object, file: str, size: int) -> StoredFile:
        """Validate one index entry (``size``: the file's logical size from the manifest)."""
        try:
            if type(d) is not dict:
                raise ValueError("not an object")
            codec, level, frame, sz = d["codec"], d.get("level", 0), d["frame"], d["size"]
            if codec not in CODECS or type(level) is not int or not -100 <= level <= 100:
                raise ValueError(f"codec {codec!r} level {level!r}")
            if type(frame) is not int or not 4096 <= frame <= MAX_FRAME:
                raise ValueError(f"frame {frame!r} (4096 to {MAX_FRAME} bytes)")
            if type(sz) is not int or sz != size:
                raise ValueError(f"frame {frame!r}, size {sz!r} (the manifest says {size})")
            raw_sizes = base64.b64decode(d["sizes"], validate=True)
            raw_hashes = base64.b64decode(d["hashes"], validate=True)
            n = -(-size // frame)
            if len(raw_sizes) != 4 * n or len(raw_hashes) != HASH_BYTES * n:
                raise ValueError(f"{len(raw_sizes) // 4} sizes / {len(raw_hashes) // HASH_BYTES} hashes for {n} frames")
            sizes = np.frombuffer(raw_sizes, dtype="<u4").astype(np.int64).tolist()
            out = cls(
                codec,
                frame,
                size,
                sizes,
                [raw_hashes[k : k + HASH_BYTES] for k in range(0, len(raw_hashes), HASH_BYTES)],
                level,
            )
            for i, s in enumerate(sizes):
                a, b = out.span(i)
                if s < 1 or (codec == "none" and s != b - a) or s > (b - a) + 1:
                    raise ValueError(f"frame {i} stored in {s} bytes")
            return out
        except CorruptCheckpoint:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpoint(
                f"metadata: stored index of {file} is malformed ({type(e).__name__}: {str(e)[:120]})"
            ) from None


def parse_stored(value: object, files: dict[str, int]) -> dict[str, StoredFile]:
    """The ``"stored"`` entry of a metadata body (None: plain files), checked against ``files``."""
    if value is None:
        return {}
    if type(value) is not dict:
        raise CorruptCheckpoint("metadata: 'stored' must be an object")
    out = {}
    for name, d in value.items():
        if name not in files:
            raise CorruptCheckpoint(f"metadata: stored index for {str(name)[:80]!r}, not a data file of the checkpoint")
        out[name] = StoredFile.from_json(d, name, files[name])
    return out


def _split(raw: bytes) -> tuple[dict, dict]:
    head, sep, body = bytes(raw).partition(b"\n")
    if not sep:
        raise CorruptCheckpoint("metadata: no header line")
    return json.loads(head), json.loads(body)


def _join(header: dict, doc: dict) -> bytes:
    from ..checksum import crc32c

    body = json.dumps(doc, separators=(",", ":")).encode()
    header = dict(header, length=len(body), crc32c=crc32c(body))
    return json.dumps(header).encode() + b"\n" + body


def add_stored(raw: bytes, stored: dict[str, StoredFile | dict]) -> bytes:
    """``raw`` (a validated ``metadata.json``) with ``stored`` as its index (replacing any), header
    length and CRC32C recomputed; order fields (seq, step, commit time) unchanged."""
    header, doc = _split(raw)
    doc.pop("stored", None)
    doc["stored"] = {name: s.to_json() if isinstance(s, StoredFile) else s for name, s in sorted(stored.items())}
    return _join(header, doc)


def strip_stored(raw: bytes) -> bytes:
    """``raw`` without its stored index: the metadata of the plain files (byte-identical to the
    first tier's copy, which never had one). ``raw`` itself when it has none."""
    if _KEY not in raw:
        return raw
    header, doc = _split(raw)
    if "stored" not in doc:
        return raw
    doc.pop("stored")
    return _join(header, doc)
