"""A tierckpt pointer file: what the integrations write where a framework expects its checkpoint.

A pointer names a checkpoint in the tiers (``id``), the one it replaced, a committed checkpoint of
its run to fall back to, the configuration and the step. Its first bytes are a small pickle
that ``torch.load`` runs (with or without ``weights_only``): it raises a message saying the file
is a pointer and how to load it; then JSON. :func:`read_pointer` reads every version (the first
ones were JSON only); :func:`write_pointer` replaces a pointer atomically. Run keys
(:func:`run_key`, :func:`check_run`) keep runs that share a configuration apart. Who calls:
:class:`~tierckpt.integrations.pathmap.PathMap` (the saving rank and any resolving rank) and
tests; paths go through fsspec, as the frameworks' own do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TierckptError
from ..format.layout import check_checkpoint_id

log = logging.getLogger("tierckpt")

LAST_NAME = re.compile(r"^last(-v\d+)?\.ckpt$")
"""Lightning's ``save_last`` names (``ModelCheckpoint.CHECKPOINT_NAME_LAST``, version, ``.ckpt``)."""

__all__ = [
    "NotAPointer",
    "Pointer",
    "check_run",
    "read_pointer",
    "run_key",
    "sweep_orphans",
    "tierckpt_pointer_is_not_a_checkpoint",
    "write_pointer",
]

_MAGIC = "tierckpt-pointer"
_MAX_POINTER = 64 * 1024
_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-=+,]{0,99}$")
_PICKLE_END = b"tR.\n"  # after the pickle head: TUPLE, REDUCE, STOP (then a newline)


def tierckpt_pointer_is_not_a_checkpoint(message: str) -> None:
    """Called by ``torch.load(..., weights_only=False)`` on a pointer file (its first lines are
    a pickle calling this): raise ``message`` (what the file is, how to load it). Under
    ``weights_only=True``, torch's error names this function instead."""
    raise TierckptError(message)


# torch.load's default (weights_only=True) then calls it too, raising the message, where tierckpt is imported.
torch.serialization.add_safe_globals([tierckpt_pointer_is_not_a_checkpoint])


def _not_a_checkpoint_message(cid: str) -> str:
    return (
        f"this file is a tierckpt pointer (checkpoint {cid}), not a checkpoint; the checkpoint is in the "
        "tiers. Load it through tierckpt: trainer.fit/validate/test(model, ckpt_path=<this path>) with "
        "TierckptCheckpointIO (or a Tierckpt strategy), or "
        "tierckpt.integrations.lightning.load_from_checkpoint(ModelClass, <this path>, <tiers.toml>)"
    )


def check_run(run: str) -> str:
    """``run`` if usable as a run key (1-100 of letters, digits and ``._-=+,``, starting with a
    letter or digit; no ``@``), else raise :class:`~tierckpt.errors.TierckptError`."""
    if not isinstance(run, str) or not _RUN_RE.match(run):
        raise TierckptError(
            f"invalid tierckpt run key {run!r}: use 1-100 characters of letters, digits and ._-=+, "
            "starting with a letter or digit"
        )
    return run


def run_key(directory: str | os.PathLike) -> str:
    """The run key of checkpoints saved into ``directory`` (a path or URL): its last two
    components, sanitised, and 8 hex digits of a hash of its absolute form. The same directory
    gives the same key in every process that spells it alike (absolute paths: the same mount)."""
    d = os.fspath(directory)
    norm = d.rstrip("/") if "://" in d else os.path.abspath(os.path.expanduser(d or "."))
    parts = [p for p in norm.split("://", 1)[-1].split("/") if p][-2:]
    slug = re.sub(r"[^A-Za-z0-9._\-=+,]", "_", "-".join(parts))
    slug = re.sub(r"^[^A-Za-z0-9]+", "", slug)[:48].rstrip("._-=+,") or "run"
    return f"{slug}-{hashlib.sha256(norm.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says: the checkpoint, the one it replaced, a committed checkpoint of
    the run to fall back to (``None``: it was written once ``id`` committed), configuration, step."""

    id: str
    replaces: str | None = None
    config: str = ""
    step: int | None = None
    fallback: str | None = None

    def encode(self) -> bytes:
        # A pickle first (opcodes that torch.load runs even with weights_only: see tierckpt_pointer_is_not_a_checkpoint), then JSON.
        msg = _not_a_checkpoint_message(self.id).encode()
        head = (
            f"c{__name__}\ntierckpt_pointer_is_not_a_checkpoint\n(X".encode()
            + struct.pack("<I", len(msg))
            + msg
            + _PICKLE_END
        )
        doc = {
            "format": _MAGIC,
            "version": 1,
            "id": self.id,
            "replaces": self.replaces,
            "fallback": self.fallback,
            "config": self.config,
            "step": self.step,
        }
        return head + json.dumps(doc, indent=1).encode() + b"\n"


def _fs(path: str | os.PathLike) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(os.fspath(path))


def _split_path(path: str | os.PathLike) -> tuple[str, str]:
    """(directory, last component) of a path or URL."""
    p = os.fspath(path).rstrip("/")
    d, _, name = p.rpartition("/")
    return (d if d or not p.startswith("/") else "/"), name


def read_pointer(path: str | os.PathLike) -> Pointer | None:
    """The pointer at ``path`` (links followed); ``None`` when nothing is there. Raises
    :class:`NotAPointer` when a file is there that is not a pointer (a framework's own checkpoint).
    Reads pointers of every tierckpt version (the first ones were JSON only)."""
    fs, p = _fs(path)
    try:
        if not fs.isfile(p):
            if fs.exists(p):
                raise NotAPointer(f"{path} is a directory, not a tierckpt pointer")
            return None
        with fs.open(p, "rb") as f:
            raw = f.read(_MAX_POINTER + 1)
    except FileNotFoundError:
        return None
    if raw.startswith(b"c") and _PICKLE_END in raw:
        raw = raw.split(_PICKLE_END, 1)[1]
    try:
        d = json.loads(raw) if len(raw) <= _MAX_POINTER else None
    except ValueError:
        d = None
    if not isinstance(d, dict) or d.get("format") != _MAGIC:
        raise NotAPointer(f"{path} is not a tierckpt pointer")
    try:
        return Pointer(
            id=check_checkpoint_id(d["id"]),
            replaces=d.get("replaces"),
            config=str(d.get("config") or ""),
            step=d.get("step"),
            fallback=d.get("fallback"),
        )
    except (KeyError, TierckptError) as e:
        raise TierckptError(f"{path}: a malformed tierckpt pointer ({e})") from None


def write_pointer(path: str | os.PathLike, pointer: Pointer) -> None:
    """Write ``pointer`` at ``path`` atomically (a temporary file renamed over it; parents made)."""
    fs, p = _fs(path)
    parent = p.rsplit("/", 1)[0] if "/" in p else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if fs.isdir(p):
        raise TierckptError(
            f"cannot write the tierckpt pointer {path}: a directory is there (a checkpoint "
            "saved without tierckpt?); remove it or save under another name"
        )
    tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(pointer.encode())
    fs.mv(tmp, p)


class NotAPointer(TierckptError):
    """A path holds something other than a tierckpt pointer."""


def _fingerprint(state: Any) -> Any:
    """What identifies a state dict's content without reading its tensors: its structure and
    non-tensor values, and per tensor (a DTensor: its local shard) its storage, view and in-place
    version counter (an optimizer step bumps it), with the values of tensors of up to 16 elements
    (made afresh per save, their memory may be reused). Leaves that are not hashable make it
    unequal to any other."""
    if isinstance(state, torch.Tensor):
        v = getattr(state, "_local_tensor", state)
        small = v.detach().cpu().tolist() if v.numel() <= 16 and not v.is_meta else None
        return ("T", v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype, v._version, small)
    if isinstance(state, dict):
        return ("D", tuple((k, _fingerprint(v)) for k, v in state.items()))
    if isinstance(state, (list, tuple)):
        return (type(state).__name__, tuple(_fingerprint(v) for v in state))
    try:
        hash(state)
    except TypeError:
        return ("U", object())  # an unhashable leaf: never the same (a full save, to be safe)
    return ("V", type(state).__name__, state)


def sweep_orphans(directory: str, ours: Callable[[], set[str]], live: Callable[[str], bool]) -> list[str]:
    """Remove the pointers in ``directory`` whose checkpoint is committed nowhere (their job died
    before the commit): not a ``last`` link's target, not a path in ``ours()`` (this process's
    own, absolute), not one whose id ``live(id)`` keeps. Returns the names removed (each logged)."""
    fs, d = _fs(directory)
    names = [e for e in fs.ls(d, detail=False)] if fs.isdir(d) else []
    linked = set()
    for e in names:
        if LAST_NAME.match(e.rsplit("/", 1)[-1]) and os.path.islink(e):
            linked.add(os.path.normpath(os.path.join(os.path.dirname(e), os.readlink(e))))
    removed = []
    for e in names:
        base = e.rsplit("/", 1)[-1]
        if ".tmp-" in base or os.path.normpath(e) in linked or os.path.islink(e) or os.path.abspath(e) in ours():
            continue
        try:
            ptr = read_pointer(e)
        except TierckptError:
            continue
        if ptr is None or live(ptr.id):
            continue
        try:
            fs.rm(e)
        except FileNotFoundError:
            continue
        removed.append(base)
        log.warning("removed the tierckpt pointer %s: its checkpoint %s was never committed", e, ptr.id)
    return removed
