"""``export --format hf``: a committed checkpoint as a Hugging Face ``save_pretrained`` folder.

The folder holds what ``model.save_pretrained(folder)`` writes for the weights:
``model.safetensors`` when everything fits in one shard, else
``model-0000K-of-0000N.safetensors`` plus ``model.safetensors.index.json``, and any extra
files asked for (``config.json``, tokenizer files, ``generation_config.json``), so that
``AutoModelForCausalLM.from_pretrained(folder)`` loads it.

Same files as ``save_pretrained``. The tensors are split into shards by huggingface_hub's own
``split_torch_state_dict_into_shards`` (the function ``save_pretrained`` calls), fed with
shape-only ``meta`` tensors in the checkpoint's key order, with ``max_shard_size`` spelled as
transformers spells it (``"5GB"``, ``"500MB"``, or a byte count; units KB, MB, GB, TB). Inside each shard the
header lists the tensors in the order safetensors' own writer uses (by dtype, as the installed
safetensors orders dtypes, then by name), with the same compact JSON, space padding and
``{"format": "pt"}`` metadata, so a shard holding the same tensors is byte for byte the file
``save_pretrained`` writes. The index is written as transformers writes it
(``json.dumps(..., indent=2, sort_keys=True)``); its ``total_parameters`` counts the elements of
the exported tensors (``save_pretrained`` counts the model's parameters: the same number unless
the exported keys hold buffers, or tied weights are stored once by one and twice by the other).

Streaming, memory bounded. Nothing is gathered: each shard's header is laid out before any
tensor byte is read (shapes come from the checkpoint's metadata), and tensors are read whole
one batch at a time by the code ``consolidate`` uses (:func:`restore.consolidate._copy_tensors`,
through the verified multi-tier reader, every CRC32C checked) and ``pwrite``-n to their place.
Writing overlaps reading (a writer thread, up to :data:`WRITE_BEHIND` = 256 MiB of tensors queued;
a larger tensor is written by the reading thread itself). Peak memory is about ``max(64 MiB batch,
largest tensor) + 256 MiB + what the adapter and the dtype cast allocate for one tensor`` (a copy of
it each, at most).

``keys`` keeps keys starting with one of the prefixes; ``strip_prefix`` removes a leading
prefix from each name; ``dtype`` casts floating-point tensors (``bfloat16``, ``float16``,
``float32``; ``None``/``"keep"`` keeps them). ``adapter``: a callable (or its dotted path,
``package.module.function`` or ``package.module:function``) mapping a dict of training names
and tensors to Hugging Face's: it is called with one tensor at a time (``{name: tensor}``), first
with a ``meta`` tensor to plan the files, then with the real one, and must return the same
names, shapes and dtypes both times (a fused tensor split into several, a rename, a permute:
anything that works on shapes; torchtitan's ``StateDictAdapter.to_hf`` is such a callable).

Crash safety. Everything is written into ``.NAME.partial-PID`` next to the output directory,
shards first, extra files next, the index last, each file fsync-ed, then the directory is
renamed to its final name (and the parent fsync-ed). A killed export therefore leaves only the
hidden partial directory (removed by the next export to the same place once its process is
gone), never a folder under the final name. The checkpoint is leased on every tier it is read
from for the whole export (:class:`restore.source.CheckpointSource`), so retention and ``gc``
do not delete it meanwhile.
"""

from __future__ import annotations

import collections
import importlib
import json
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierckpt.config import TierConfig

from .catalog import as_config
from .consolidate import ConsolidateResult, _copy_tensors, _plan
from .errors import NotFound, UsageError
from .outfiles import SAFETENSORS_DTYPES, _bytes_of, _pwrite_all, _Tensor
from .outfiles import _Writer as _ConsolidateWriter
from .source import CheckpointSource

__all__ = [
    "DTYPES",
    "ExportExists",
    "ExportResult",
    "INDEX_NAME",
    "export_hf",
    "load_adapter",
    "parse_dtype",
]

log = logging.getLogger("tierckpt.restore")

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
FILENAME_PATTERN = "model{suffix}.safetensors"
DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers 5's save_pretrained default
DTYPES: dict[str, torch.dtype | None] = {
    "keep": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
PARTIAL = ".partial-"
WRITE_BEHIND = 256 << 20  # bytes of read tensors queued for the writer thread at most (see _HfWriter)

Adapter = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]


class ExportExists(UsageError):
    """The output directory exists and is not empty (and replacing it was not asked for)."""


@dataclass
class ExportResult:
    """What an export wrote."""

    checkpoint_id: str
    out: str
    format: str = "hf"
    shards: list[str] = field(default_factory=list)  # shard file names, in order
    tensors: int = 0  # tensors written (after the adapter)
    bytes: int = 0  # tensor bytes written
    bytes_read: int = 0  # tensor bytes read from the checkpoint
    largest_tensor: int = 0  # bytes of the largest tensor read
    files: list[str] = field(default_factory=list)  # extra files copied in
    skipped: list[str] = field(default_factory=list)  # selected non-tensor keys (not exportable)
    served: dict[str, str] = field(default_factory=dict)  # data file -> tier it was read from
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["seconds"] = round(self.seconds, 3)
        return d


def _hf_libs() -> tuple[Any, Any]:
    """``(huggingface_hub.split_torch_state_dict_into_shards, safetensors.torch)``; a clear error
    when the ``hf`` extra is not installed."""
    try:
        import safetensors.torch as st
        from huggingface_hub import split_torch_state_dict_into_shards
    except ImportError as e:
        raise UsageError(
            f"the Hugging Face export needs safetensors and huggingface_hub ({e}): pip install 'tierckpt[hf]'"
        ) from None
    return split_torch_state_dict_into_shards, st


def parse_dtype(name: str | None) -> torch.dtype | None:
    """``None``/``"keep"`` -> None (keep each tensor's dtype); ``"bfloat16"``, ``"float16"``,
    ``"float32"`` -> that dtype. Raises :class:`UsageError` naming the choices otherwise."""
    if name is None:
        return None
    if name not in DTYPES:
        raise UsageError(f"dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_adapter(adapter: str | Adapter | None) -> Adapter | None:
    """The adapter callable: ``adapter`` itself, or the object a dotted path names
    (``pkg.mod.func`` or ``pkg.mod:func``; attributes may be nested: ``pkg.mod:Class.method``).
    ``None`` or ``""``: no adapter (names and tensors kept). Raises :class:`UsageError` naming the
    path when it cannot be imported or is not callable."""
    if adapter is None or adapter == "":
        return None
    if callable(adapter):
        return adapter
    path = str(adapter)
    if ":" in path:
        mod_name, _, attr = path.partition(":")
    else:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name or not attr:
        raise UsageError(f"adapter {path!r}: use package.module.function or package.module:function")
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"adapter {path!r} cannot be loaded: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise UsageError(f"adapter {path!r} is a {type(obj).__name__}, not a callable")
    return obj


_dtype_rank_cache: dict[torch.dtype, int] = {}


def _dtype_ranks(dtypes: set[torch.dtype], st: Any) -> dict[torch.dtype, int]:
    """The position of each dtype in the order safetensors' writer sorts tensors by (asked of the
    installed safetensors: it serializes one one-element tensor per dtype, all names of equal
    length, and the header tells the order)."""
    missing = [d for d in dtypes if d not in _dtype_rank_cache]
    if missing:
        known = sorted(set(missing) | set(_dtype_rank_cache), key=str)
        probe = {f"k{i:04d}": torch.zeros(1, dtype=d) for i, d in enumerate(known)}
        raw = st.save(probe)
        (n,) = struct.unpack_from("<Q", raw, 0)
        order = [k for k in json.loads(raw[8 : 8 + n]) if k != "__metadata__"]
        for pos, k in enumerate(order):
            _dtype_rank_cache[known[int(k[1:])]] = pos
    return {d: _dtype_rank_cache[d] for d in dtypes}


@dataclass
class _Out:
    """One tensor of the export: its Hugging Face name, dtype, shape and where it goes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: str = ""
    offset: int = 0  # of its bytes in the shard's data section

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class _Shard:
    """One safetensors file: header laid out when created, tensors ``pwrite``-n as they come."""

    def __init__(self, path: Path, outs: list[_Out], ranks: dict[torch.dtype, int]) -> None:
        self.path = path
        self.remaining = len(outs)
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for o in sorted(outs, key=lambda o: (ranks[o.dtype], o.name)):
            header[o.name] = {
                "dtype": SAFETENSORS_DTYPES[o.dtype],
                "shape": list(o.shape),
                "data_offsets": [off, off + o.nbytes],
            }
            o.offset = off
            off += o.nbytes
        hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        hb += b" " * (-len(hb) % 8)
        self.base = 8 + len(hb)
        self.size = self.base + off
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        _pwrite_all(self.fd, memoryview(struct.pack("<Q", len(hb)) + hb), 0)
        os.ftruncate(self.fd, self.size)

    def write(self, o: _Out, value: torch.Tensor) -> bool:
        """Write ``value`` at ``o``'s place; True once every tensor of the shard is written (the
        file is then fsync-ed and closed)."""
        if o.nbytes:
            _pwrite_all(self.fd, _bytes_of(value.contiguous()), self.base + o.offset)
        self.remaining -= 1
        if self.remaining == 0:
            os.fsync(self.fd)
            self.close()
            return True
        return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _HfWriter(_ConsolidateWriter):
    """Receives each full tensor of the checkpoint, runs the adapter and the cast, and writes the
    results into their shards (opened on first use, closed once full).

    Write-behind: a tensor of at most :data:`WRITE_BEHIND` bytes is handed to one writer thread
    (``pwrite`` releases the GIL) while the caller reads the next batch, as long as the tensors
    queued stay within :data:`WRITE_BEHIND` bytes in all; a larger tensor is written on the
    caller's thread once the queue is empty. So reading and writing overlap, and the memory held
    stays within the batch being read plus :data:`WRITE_BEHIND`. The first error of the writer
    thread is raised by the next :meth:`write` or by :meth:`finish`.
    """

    def __init__(
        self,
        tmp: Path,
        checkpoint_id: str,
        names: dict[str, str],
        planned: dict[str, list[_Out]],
        shards: dict[str, list[_Out]],
        ranks: dict[torch.dtype, int],
        adapter: Adapter | None,
        dtype: torch.dtype | None,
    ) -> None:
        self.tmp = tmp
        self.checkpoint_id = checkpoint_id
        self.names = names  # fqn -> name after strip_prefix
        self.planned = planned  # fqn -> its outputs as planned
        self.shards = shards  # shard file -> its outputs
        self.ranks = ranks
        self.adapter = adapter
        self.dtype = dtype
        self.open: dict[str, _Shard] = {}
        self.done: set[str] = set()
        self.bytes = 0
        self.tensors = 0
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[_Tensor, torch.Tensor]] = collections.deque()
        self._queued = 0  # bytes of the tensors in the queue or being written
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    def write(self, t: _Tensor, value: torch.Tensor) -> None:
        with self._cond:
            self._raise()
            if t.nbytes > WRITE_BEHIND:
                self._cond.wait_for(lambda: self._queued == 0 or self._error is not None)
                self._raise()
            else:
                self._cond.wait_for(lambda: self._queued + t.nbytes <= WRITE_BEHIND or self._error is not None)
                self._raise()
                self._queue.append((t, value))
                self._queued += t.nbytes
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="tierckpt-export-write", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
                return
        self._write_now(t, value)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if not self._queue:
                    return
                t, value = self._queue[0]
            try:
                if self._error is None:
                    self._write_now(t, value)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                with self._cond:
                    self._error = e
            del value
            with self._cond:
                self._queue.popleft()
                self._queued -= t.nbytes
                self._cond.notify_all()

    def finish(self) -> None:
        """Wait until every queued tensor is written; raise the writer thread's error."""
        with self._cond:
            self._cond.wait_for(lambda: self._queued == 0)
            self._raise()

    def _write_now(self, t: _Tensor, value: torch.Tensor) -> None:
        outs = _convert(self.checkpoint_id, t.fqn, self.names[t.fqn], value, self.adapter, self.dtype)
        plan = self.planned[t.fqn]
        if [(n, v.dtype, tuple(v.shape)) for n, v in outs.items()] != [(o.name, o.dtype, o.shape) for o in plan]:
            raise UsageError(
                f"checkpoint {self.checkpoint_id}: the adapter returned for {t.fqn!r} "
                f"{[(n, str(v.dtype), list(v.shape)) for n, v in outs.items()]} from the tensor and "
                f"{[(o.name, str(o.dtype), list(o.shape)) for o in plan]} from its meta stand-in: "
                "it must depend on names, shapes and dtypes only"
            )
        for o in plan:
            shard = self.open.get(o.shard)
            if shard is None:
                shard = self.open[o.shard] = _Shard(self.tmp / o.shard, self.shards[o.shard], self.ranks)
            if shard.write(o, outs[o.name]):
                del self.open[o.shard]
                self.done.add(o.shard)
            self.bytes += o.nbytes
            self.tensors += 1

    def close(self) -> None:
        """Stop the writer thread (after what is queued; nothing more is written after an error)
        and close the shards still open."""
        with self._cond:
            self._stop = True
            if self._error is None and self._queue:
                self._error = UsageError(f"checkpoint {self.checkpoint_id}: export abandoned")
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        for shard in self.open.values():
            shard.close()
        self.open.clear()


def _convert(
    checkpoint_id: str,
    fqn: str,
    name: str,
    value: torch.Tensor,
    adapter: Adapter | None,
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    """``{name: value}`` through the adapter, then floating-point results cast to ``dtype``."""
    outs: dict[str, torch.Tensor] = {name: value}
    if adapter is not None:
        try:
            got = adapter(outs)
        except Exception as e:  # noqa: BLE001 - the user's callable: name the key it failed on
            raise UsageError(
                f"checkpoint {checkpoint_id}: the adapter failed on {fqn!r} ({name!r}): {type(e).__name__}: {e}"
            ) from e
        if not isinstance(got, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in got.items()
        ):
            raise UsageError(
                f"checkpoint {checkpoint_id}: the adapter returned {type(got).__name__} for {fqn!r}: "
                "it must return a dict of names to tensors"
            )
        outs = dict(got)
    if dtype is not None:
        outs = {k: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v for k, v in outs.items()}
    return outs


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _clean_partials(out: Path) -> None:
    """Remove ``.NAME.partial-PID`` directories left next to ``out`` by exports that died."""
    prefix = f".{out.name}{PARTIAL}"
    try:
        entries = list(out.parent.iterdir())
    except FileNotFoundError:
        return
    for p in entries:
        tail = p.name[len(prefix) :] if p.name.startswith(prefix) else ""
        if tail.isdigit() and int(tail) != os.getpid() and not _pid_alive(int(tail)):
            log.info("removing %s, left by an export that did not finish", p)
            shutil.rmtree(p, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _extra_files(files: list[str | os.PathLike]) -> list[Path]:
    """The files to copy in: each path given, or the regular files directly inside a directory."""
    out: list[Path] = []
    for f in files:
        p = Path(f)
        if p.is_dir():
            out.extend(sorted(c for c in p.iterdir() if c.is_file()))
        elif p.is_file():
            out.append(p)
        else:
            raise UsageError(f"extra file {p}: no such file or directory")
    return out


def is_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a finished export (a directory holding the index or the single shard)."""
    p = Path(path)
    return (p / INDEX_NAME).is_file() or (p / SINGLE_NAME).is_file()


def export_hf(
    config: TierConfig | str | os.PathLike | None,
    checkpoint_id: str = "latest",
    *,
    out: str | os.PathLike,
    keys: list[str] | None = None,
    strip_prefix: str = "",
    dtype: str | None = None,
    files: list[str | os.PathLike] | None = None,
    adapter: str | Adapter | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    progress: bool = True,
) -> ExportResult:
    """Write checkpoint ``checkpoint_id`` (or ``"latest"``) as a ``save_pretrained`` folder ``out``.

    Args:
        config: a :class:`TierConfig`, a TOML path, or ``None`` for ``$TIERCKPT_CONFIG``.
        out: the output directory; ``{checkpoint_id}`` in it is replaced by the checkpoint's id.
            It must not exist or be empty, unless ``overwrite``.
        keys: keep only keys starting with one of these prefixes (e.g. ``["model."]``).
        strip_prefix: removed from the start of every name that has it (e.g. ``"model."``).
        dtype: ``None``/``"keep"``, ``"bfloat16"``, ``"float16"`` or ``"float32"`` (floating-point
            tensors only).
        files: extra files (or directories whose files) to copy in: ``config.json``, tokenizer
            files, ``generation_config.json``.
        adapter: see the module docstring.
        max_shard_size: as ``save_pretrained`` takes it (``"5GB"``, ``"200MB"``, bytes).
        overwrite: replace an existing non-empty ``out`` (after the new folder is complete).
        progress: show a progress bar on a terminal.

    Returns an :class:`ExportResult`. Raises :class:`ExportExists` when ``out`` holds something
    and ``overwrite`` is False, :class:`NotFound` when no tensor key matches, :class:`UsageError`
    for a bad dtype, adapter, name clash or missing extra file, and tierckpt's errors for the
    checkpoint (not found, corrupt, being deleted). On any error nothing appears under ``out``.
    """
    t0 = time.perf_counter()
    split_fn, st = _hf_libs()
    cast = parse_dtype(dtype)
    fn = load_adapter(adapter)
    extra = _extra_files(list(files or []))
    cfg = as_config(config)
    with CheckpointSource(cfg, checkpoint_id, purpose="export") as src:
        cid = src.checkpoint_id
        out_path = Path(str(out).replace("{checkpoint_id}", cid))
        if out_path.exists() and not out_path.is_dir():
            raise UsageError(f"--out {out_path}: exists and is not a directory")
        if out_path.is_dir() and any(out_path.iterdir()) and not overwrite:
            raise ExportExists(
                f"--out {out_path}: exists and is not empty"
                + (" (an export already)" if is_export(out_path) else "")
                + "; replace it with --force (overwrite=True)"
            )
        md = src.metadata
        res = ExportResult(cid, str(out_path))
        chosen = [f for f in md.state_dict_metadata if not keys or any(f.startswith(k) for k in keys)]
        tensors, objects = _plan(src, chosen)
        res.skipped = [fqn for fqn, _ in objects]
        if not tensors:
            raise NotFound(
                f"checkpoint {cid}: no tensor key matches"
                + (f" --keys {' '.join(keys)}" if keys else "")
                + f" ({len(md.state_dict_metadata)} keys, e.g. {next(iter(md.state_dict_metadata), '-')!r})"
            )
        if res.skipped:
            log.warning(
                "checkpoint %s: leaving out %d non-tensor key(s) of the export: %s",
                cid,
                len(res.skipped),
                ", ".join(res.skipped[:5]) + (" ..." if len(res.skipped) > 5 else ""),
            )
        names = {t.fqn: t.fqn.removeprefix(strip_prefix) if strip_prefix else t.fqn for t in tensors}
        planned: dict[str, list[_Out]] = {}
        metas: dict[str, torch.Tensor] = {}
        owner: dict[str, str] = {}
        for t in tensors:
            stand_in = torch.empty(t.shape, dtype=t.dtype, device="meta")
            outs = _convert(cid, t.fqn, names[t.fqn], stand_in, fn, cast)
            planned[t.fqn] = []
            for n, v in outs.items():
                if n in owner:
                    raise UsageError(f"checkpoint {cid}: {t.fqn!r} and {owner[n]!r} both become {n!r}")
                if v.dtype not in SAFETENSORS_DTYPES:
                    raise UsageError(
                        f"checkpoint {cid}: {n!r} (from {t.fqn!r}) is {str(v.dtype).removeprefix('torch.')}, "
                        "which safetensors cannot store: cast it (dtype) or leave it out (keys)"
                    )
                owner[n] = t.fqn
                planned[t.fqn].append(_Out(n, v.dtype, tuple(v.shape)))
                metas[n] = v
        if "__metadata__" in owner:
            raise UsageError(f"checkpoint {cid}: a tensor named '__metadata__' cannot be stored in safetensors")
        split = split_fn(metas, filename_pattern=FILENAME_PATTERN, max_shard_size=max_shard_size)
        del metas
        by_name = {o.name: o for outs in planned.values() for o in outs}
        shards: dict[str, list[_Out]] = {}
        for shard, tensor_names in split.filename_to_tensors.items():
            shards[shard] = [by_name[n] for n in tensor_names]
            for n in tensor_names:
                by_name[n].shard = shard
        clash = sorted({p.name for p in extra} & (set(shards) | {INDEX_NAME, SINGLE_NAME}))
        if clash:
            raise UsageError(f"extra file(s) {', '.join(clash)} would replace the export's own files")
        ranks = _dtype_ranks({o.dtype for o in by_name.values()}, st)

        out_path.parent.mkdir(parents=True, exist_ok=True)
        _clean_partials(out_path)
        tmp = out_path.with_name(f".{out_path.name}{PARTIAL}{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            writer = _HfWriter(tmp, cid, names, planned, shards, ranks, fn, cast)
            scratch = ConsolidateResult(cid, str(out_path), "hf")
            try:
                _copy_tensors(src, tensors, writer, scratch, progress, label="export")
                writer.finish()
            finally:
                writer.close()
            unwritten = sorted(set(shards) - writer.done)
            if unwritten:  # cannot happen unless a tensor was skipped: refuse to publish a partial folder
                raise UsageError(f"checkpoint {cid}: shard(s) {', '.join(unwritten)} not complete")
            for p in extra:
                shutil.copyfile(p, tmp / p.name)
                with open(tmp / p.name, "rb+") as fh:
                    os.fsync(fh.fileno())
                res.files.append(p.name)
            if split.is_sharded:
                index = {
                    "metadata": {
                        "total_parameters": sum(o.nbytes // o.dtype.itemsize for o in by_name.values()),
                        **split.metadata,
                    },
                    "weight_map": split.tensor_to_filename,
                }
                with open(tmp / INDEX_NAME, "w", encoding="utf-8") as fh:
                    fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
                    fh.flush()
                    os.fsync(fh.fileno())
            _fsync_dir(tmp)
            _publish(tmp, out_path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        res.shards = list(shards)
        res.tensors = writer.tensors
        res.bytes = writer.bytes
        res.bytes_read = scratch.bytes
        res.largest_tensor = max(t.nbytes for t in tensors)
        res.served = dict(sorted(src.served.items()))
        res.seconds = time.perf_counter() - t0
        return res


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` is moved aside first and removed
    after (an empty one is simply replaced)."""
    old: Path | None = None
    if out.is_dir():
        try:
            out.rmdir()  # empty
        except OSError:
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
    os.rename(tmp, out)
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
