"""torchtitan's own ``StateDictAdapter.to_hf`` as the Hugging Face export's adapter, in one line.

torchtitan's adapters (``torchtitan.protocols.state_dict_adapter.StateDictAdapter``) are classes
built from the model's configuration and an optional Hugging Face assets folder
(``Adapter(model_config, hf_assets_path)``); their ``to_hf`` is an instance method mapping
torchtitan's names and tensors (``layers.0.attention.qkv_linear.wq.weight``) to Hugging Face's
(``model.layers.0.self_attn.q_proj.weight``, Q/K rows permuted for RoPE). A dotted path cannot
name such a bound method, so ``[export] adapter`` (and ``--adapter``) also takes::

    adapter = "torchtitan:llama3/8B"                      # MODEL/FLAVOR of torchtitan.models
    adapter = "torchtitan:my_configs:llama3_8b_tierckpt"  # a torchtitan config function (--module/--config)

The first builds ``torchtitan.models.MODEL.model_registry(FLAVOR)`` (torchtitan's own model
spec: the architecture and its ``state_dict_adapter`` class); the second calls the function
(``module:function``, what ``torchrun -m torchtitan.train --module M --config F`` calls) and uses
its ``model_spec``. Either way the adapter is ``spec.state_dict_adapter(spec.model, None)`` and
:func:`hf_adapter` returns its bound ``to_hf``. No assets folder is passed: ``to_hf`` needs only
the architecture (the assets' index serves torchtitan's own HF *writer*, which the export replaces).

torchtitan's checkpoints hold the model's parameters at the top level of the state (beside
``optimizer.``, ``lr_scheduler``, ``dataloader``, ``train_state``), so an export names them with
``keys`` (e.g. ``["tok_embeddings.", "layers.", "norm.", "lm_head."]`` for llama3); ``to_hf``
raises on any other key. Who calls: :func:`restore.export.load_adapter`, in the exporting process.
Needs torchtitan importable there (``pip install "tierckpt[torchtitan]"``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from tierckpt.errors import ConfigError

__all__ = ["PREFIX", "hf_adapter", "model_spec"]

PREFIX = "torchtitan:"  # the adapter setting's form this module handles


def model_spec(ref: str) -> Any:
    """torchtitan's model spec named by ``ref``: ``"MODEL/FLAVOR"`` (``torchtitan.models.MODEL.
    model_registry(FLAVOR)``) or ``"package.module:config_function"`` (the function's
    ``Trainer.Config().model_spec``). Raises :class:`ConfigError` naming ``ref`` when it cannot be
    built or has no state dict adapter."""
    try:
        if "/" in ref:
            name, _, flavor = ref.partition("/")
            spec = importlib.import_module(f"torchtitan.models.{name}").model_registry(flavor)
        else:
            mod_name, sep, fn_name = ref.partition(":")
            if not sep or not mod_name or not fn_name:
                raise ConfigError("use MODEL/FLAVOR or package.module:config_function")
            config = getattr(importlib.import_module(mod_name), fn_name)()
            spec = config.model_spec
    except ConfigError as e:
        raise ConfigError(f"adapter {PREFIX}{ref}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's reference: name it with the cause
        raise ConfigError(
            f"adapter {PREFIX}{ref}: cannot build torchtitan's model spec: {type(e).__name__}: {e}"
        ) from None
    if getattr(spec, "state_dict_adapter", None) is None:
        raise ConfigError(
            f"adapter {PREFIX}{ref}: torchtitan's model spec {getattr(spec, 'name', '?')!r} has no state dict adapter"
        )
    return spec


def hf_adapter(ref: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The bound ``to_hf`` of the state dict adapter of the model spec ``ref`` names (see
    :func:`model_spec`; ``ref`` without the ``torchtitan:`` prefix). Raises :class:`ConfigError`."""
    spec = model_spec(ref)
    try:
        adapter = spec.state_dict_adapter(spec.model, None)
    except Exception as e:  # noqa: BLE001 - torchtitan's constructor: name the spec with the cause
        raise ConfigError(
            f"adapter {PREFIX}{ref}: {spec.state_dict_adapter.__name__}(model config, None) failed: "
            f"{type(e).__name__}: {e}"
        ) from None
    fn: Callable[[dict[str, Any]], dict[str, Any]] = adapter.to_hf
    return fn
