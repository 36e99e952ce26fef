"""``[export]``: the background Hugging Face export's section (re-exported by :mod:`.sections`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from .values import (
    _brief,
)

__all__ = ["EXPORT_DTYPES", "EXPORT_FORMATS", "ExportConfig"]


EXPORT_FORMATS = ("hf",)
EXPORT_DTYPES = ("keep", "bfloat16", "float16", "float32")
_SHARD_UNITS = ("KB", "MB", "GB", "TB")  # what transformers' max_shard_size takes (huggingface_hub)


def _dotted(path: str) -> bool:
    return all(part.isidentifier() for part in path.replace(":", ".").split("."))


def _adapter_ref_ok(ref: str) -> bool:
    """A dotted path, ``torchtitan:MODEL/FLAVOR`` or ``torchtitan:pkg.module:function``."""
    if not ref.startswith("torchtitan:"):
        return _dotted(ref)
    rest = ref[len("torchtitan:") :]
    if "/" in rest:
        model, _, flavor = rest.partition("/")
        return model.isidentifier() and bool(flavor) and all(c.isalnum() or c in "._-" for c in flavor)
    return rest.count(":") == 1 and _dotted(rest)


@dataclass
class ExportConfig:
    """``[export]``: every Nth committed checkpoint also becomes a Hugging Face folder, in the background.

    One worker process per job (started by rank 0 after the commit, niced, off the commit path;
    with ``{node}`` in ``path``, one per node, by the rank that writes the checkpoint's metadata
    on that node) writes what ``save_pretrained``
    writes, through ``tierckpt-restore export`` (docs/integrations.md). Its errors are logged
    and reach the trainer at the next ``wait()`` as a warning; the checkpoint is not affected.
    Needs ``pip install "tierckpt[hf]"``.

    Attributes:
        format: ``"hf"``: ``model.safetensors`` or ``model-0000K-of-0000N.safetensors`` shards and
            ``model.safetensors.index.json``, split as ``save_pretrained`` splits them.
        every: export every Nth committed checkpoint (those whose commit sequence number is a
            multiple of N); 0: only on request (``tierckpt-restore export``).
        path: the output directory, or an ``s3://bucket/prefix`` URL (uploaded through the S3
            tier's code with the ``[s3]`` section's endpoint and settings, credentials from boto3's
            chain; shards first, ``model.safetensors.index.json`` last; not inside the ``[s3]``
            tier's own prefix), ``{checkpoint_id}`` replaced by the checkpoint's id (and
            ``{node}`` by the node's name); required when ``every`` is set.
        keys: export only the keys starting with one of these prefixes (e.g. ``["model."]``);
            empty: every tensor.
        strip_prefix: removed from the start of every name (e.g. ``"model."``).
        dtype: ``"keep"``, or cast floating-point tensors to ``"bfloat16"``, ``"float16"`` or
            ``"float32"``.
        files: extra files (or directories whose files) copied into every export:
            ``config.json``, tokenizer files, ``generation_config.json``.
        adapter: dotted path (``package.module.function`` or ``package.module:function``) of a
            callable mapping ``{name: tensor}`` to Hugging Face's names and tensors, called one
            tensor at a time; or torchtitan's own ``StateDictAdapter.to_hf`` for a model:
            ``"torchtitan:llama3/8B"`` (torchtitan's model and flavor) or
            ``"torchtitan:my_configs:llama3_8b_tierckpt"`` (a torchtitan config function;
            :mod:`restore.titanadapter`); empty: names kept.
        max_shard_size: the largest shard, as ``save_pretrained`` spells it (``"5GB"``, ``"500MB"``).
    """

    format: str = "hf"
    every: int = 0
    path: str = ""
    keys: list[str] = field(default_factory=list)
    strip_prefix: str = ""
    dtype: str = "keep"
    files: list[str] = field(default_factory=list)
    adapter: str = ""
    max_shard_size: str = "50GB"

    def validate(self, where: str = "[export]") -> None:
        if self.format not in EXPORT_FORMATS:
            raise ConfigError(
                f"{where} format: one of {', '.join(map(repr, EXPORT_FORMATS))}, got {_brief(self.format)}"
            )
        if self.every < 0:
            raise ConfigError(f"{where} every: must be 0 (on request only) or positive, got {self.every}")
        if self.every and not self.path:
            raise ConfigError(f"{where} path: required when every is set (where the exports go)")
        if self.path.startswith("s3://"):
            bucket, _, prefix = self.path[len("s3://") :].partition("/")
            if not bucket or not prefix.strip("/"):
                raise ConfigError(f"{where} path: s3://BUCKET/PREFIX (a prefix of its own), got {_brief(self.path)}")
        if self.dtype not in EXPORT_DTYPES:
            raise ConfigError(f"{where} dtype: one of {', '.join(map(repr, EXPORT_DTYPES))}, got {_brief(self.dtype)}")
        size = self.max_shard_size.strip()
        try:
            ok = size[-2:].upper() in _SHARD_UNITS and float(size[:-2]) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(
                f'{where} max_shard_size: a size as save_pretrained takes it ("5GB", "500MB"; units '
                f"{', '.join(_SHARD_UNITS)}), got {_brief(self.max_shard_size)}"
            )
        if self.adapter and not _adapter_ref_ok(self.adapter):
            raise ConfigError(
                f"{where} adapter: a dotted path such as mypkg.convert:to_hf, or torchtitan:MODEL/FLAVOR "
                f"(torchtitan:llama3/8B) or torchtitan:pkg.module:config_function, got {_brief(self.adapter)}"
            )

    def check_s3(self, tier_bucket: str, tier_prefix: str, where: str = "[export]") -> None:
        """Refuse an ``s3://`` path inside the ``[s3]`` tier's own prefix (``tier_prefix``) in the
        same bucket: that tier's retention and ``gc`` own every key there."""
        if not self.path.startswith("s3://"):
            return
        bucket, _, prefix = self.path[len("s3://") :].partition("/")
        prefix, tier_prefix = prefix.strip("/"), tier_prefix.strip("/")
        if bucket == tier_bucket and (not tier_prefix or prefix == tier_prefix or prefix.startswith(tier_prefix + "/")):
            raise ConfigError(
                f"{where} path: {_brief(self.path)} lies inside the [s3] tier s3://{bucket}/{tier_prefix} "
                "(its retention and gc own every key there): use another prefix or bucket"
            )
