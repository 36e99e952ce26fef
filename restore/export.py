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

To S3 (``out = "s3://bucket/prefix"``): staged locally and uploaded shard by shard through the S3
tier, the marker (index, or the single shard) last; see :mod:`restore.s3export`.

Crash safety. Everything is written into ``.NAME.partial-PID`` next to the output directory,
shards first, extra files next, the index last, each file fsync-ed, then the directory is
renamed to its final name (and the parent fsync-ed). A killed export therefore leaves only the
hidden partial directory (removed by the next export to the same place once its process is
gone), never a folder under the final name. The checkpoint is leased on every tier it is read
from for the whole export (:class:`restore.source.CheckpointSource`), so retention and ``gc``
do not delete it meanwhile.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierckpt.config import TierConfig

from .catalog import as_config
from .consolidate import ConsolidateResult, _copy_tensors, _plan
from .errors import NotFound, UsageError
from .hfshards import WRITE_BEHIND, Adapter, _convert, _dtype_ranks, _HfWriter, _Out  # noqa: F401 - WRITE_BEHIND: public here
from .outfiles import SAFETENSORS_DTYPES
from .s3export import S3Destination, check_destination, is_s3_url, parse_s3_url, staging_parent
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
S3_STAGE = "tierckpt-s3export"  # an S3 export's staging directory: $TMPDIR/.tierckpt-s3export.partial-PID


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
    (``pkg.mod.func`` or ``pkg.mod:func``; attributes may be nested: ``pkg.mod:Class.method``,
    for a static method), or torchtitan's ``StateDictAdapter.to_hf`` bound to the model it names:
    ``torchtitan:MODEL/FLAVOR`` or ``torchtitan:pkg.mod:config_function``
    (:mod:`restore.titanadapter`). ``None`` or ``""``: no adapter (names and
    tensors kept). Raises :class:`UsageError` naming the path when it cannot be imported or built,
    or is not callable."""
    if adapter is None or adapter == "":
        return None
    if callable(adapter):
        return adapter
    path = str(adapter)
    if path.startswith("torchtitan:"):
        from tierckpt.errors import ConfigError

        from .titanadapter import PREFIX, hf_adapter

        try:
            return hf_adapter(path[len(PREFIX) :])
        except ConfigError as e:
            raise UsageError(str(e)) from None
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


def is_export(path: str | os.PathLike, config: TierConfig | str | os.PathLike | None = None) -> bool:
    """Whether ``path`` is a finished export: a directory holding the index or the single shard,
    or an ``s3://`` prefix holding one of them (``config``: whose ``[s3]`` transport settings to
    use; credentials from boto3's chain)."""
    if is_s3_url(path):
        dest = S3Destination(as_config(config), str(path))
        try:
            return dest.is_export((INDEX_NAME, SINGLE_NAME))
        finally:
            dest.close()
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
        out: the output directory, or an ``s3://bucket/prefix`` URL (:mod:`restore.s3export`:
            shards uploaded as they complete, the index last); ``{checkpoint_id}`` in it is
            replaced by the checkpoint's id. It must not exist or be empty (hold no object),
            unless ``overwrite``.
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
        out_str = str(out).replace("{checkpoint_id}", cid)
        out_path = Path(out_str)
        to_s3 = is_s3_url(out_str)
        if to_s3:
            check_destination(cfg, out_str)  # a usable URL, outside the [s3] tier's own prefix
            out_str = "s3://" + "/".join(parse_s3_url(out_str))
        else:
            if out_path.exists() and not out_path.is_dir():
                raise UsageError(f"--out {out_path}: exists and is not a directory")
            if out_path.is_dir() and any(out_path.iterdir()) and not overwrite:
                raise ExportExists(
                    f"--out {out_path}: exists and is not empty"
                    + (" (an export already)" if is_export(out_path) else "")
                    + "; replace it with --force (overwrite=True)"
                )
        md = src.metadata
        res = ExportResult(cid, out_str)
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

        dest: S3Destination | None = None
        if to_s3:
            dest = S3Destination(cfg, out_str)
            try:
                if not overwrite and dest.has_objects():
                    raise ExportExists(
                        f"--out {out_str}: holds objects"
                        + (" (an export already)" if dest.is_export((INDEX_NAME, SINGLE_NAME)) else "")
                        + "; replace them with --force (overwrite=True)"
                    )
                stage = staging_parent()
                stage.mkdir(parents=True, exist_ok=True)
                _clean_partials(stage / S3_STAGE)
                tmp = stage / f".{S3_STAGE}{PARTIAL}{os.getpid()}"
                dest.begin((INDEX_NAME, SINGLE_NAME))
            except BaseException:
                dest.close()
                raise
        else:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            _clean_partials(out_path)
            tmp = out_path.with_name(f".{out_path.name}{PARTIAL}{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            on_shard = None
            if dest is not None:
                d = dest

                def on_shard(name: str) -> None:
                    if name != SINGLE_NAME:  # the single shard is the marker: uploaded last
                        d.send(tmp / name)

            writer = _HfWriter(tmp, cid, names, planned, shards, ranks, fn, cast, on_shard=on_shard)
            scratch = ConsolidateResult(cid, res.out, "hf")
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
                with open(tmp / p.name, "rb+") as copied:
                    os.fsync(copied.fileno())
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
            if dest is not None:
                marker = tmp / (INDEX_NAME if split.is_sharded else SINGLE_NAME)
                dest.finish([tmp / n for n in res.files], marker)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                _fsync_dir(tmp)
                _publish(tmp, out_path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if dest is not None:
                dest.close()
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
