"""torchtitan's adapter in one configuration line: ``[export] adapter = "torchtitan:..."``.

A checkpoint with torchtitan's layout (the model's parameters at the top level under torchtitan's
names, Q/K rows in torchtitan's RoPE order, beside ``optimizer.`` and ``train_state``) is
exported through an adapter class of torchtitan's shape (built as ``Adapter(model_config,
hf_assets_path)``, an instance method ``to_hf``), named by a torchtitan-style config function:
the folder is byte for byte ``save_pretrained``'s. Where torchtitan is installed, its own llama3
adapter is loaded by ``torchtitan:llama3/debugmodel`` and maps a name as torchtitan does.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from test_hf_export import SHARD, _tiny_config, saved  # noqa: E402,F401 - saved: the module's fixture

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# torchtitan's llama3 names, as its Llama3StateDictAdapter maps them (HF name pattern -> torchtitan's)
HF_TO_TITAN = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.qkv_linear.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.qkv_linear.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.qkv_linear.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def _rope_rows(w: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    """HF's RoPE row order from the interleaved one (``to_hf``) or back."""
    rows, cols = w.shape
    half = rows // heads // 2
    if to_hf:
        return w.view(heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)
    return w.view(heads, 2, half, cols).transpose(1, 2).reshape(rows, cols)


class TinyTitanAdapter:
    """An adapter of torchtitan's ``StateDictAdapter`` shape: built from the model's
    configuration and an assets path, ``to_hf`` an instance method using the configuration."""

    def __init__(self, model_config, hf_assets_path: str | None) -> None:
        self.model_config = model_config
        self.hf_assets_path = hf_assets_path
        self.to_hf_map = {v: k for k, v in HF_TO_TITAN.items()}

    def to_hf(self, state_dict: dict) -> dict:
        cfg = self.model_config
        out = {}
        for key, value in state_dict.items():
            abstract = re.sub(r"\d+", "{}", key, count=1)
            layer = re.search(r"\d+", key)
            name = self.to_hf_map[abstract].format(layer.group(0) if layer else "")
            if abstract.endswith("wq.weight"):
                value = _rope_rows(value, cfg.num_attention_heads, to_hf=True)
            elif abstract.endswith("wk.weight"):
                value = _rope_rows(value, cfg.num_key_value_heads, to_hf=True)
            out[name] = value
        return out

    def from_hf(self, hf_state_dict: dict) -> dict:
        cfg = self.model_config
        out = {}
        for key, value in hf_state_dict.items():
            abstract = re.sub(r"\d+", "{}", key, count=1)
            layer = re.search(r"\d+", key)
            name = HF_TO_TITAN[abstract].format(layer.group(0) if layer else "")
            if abstract.endswith("q_proj.weight"):
                value = _rope_rows(value, cfg.num_attention_heads, to_hf=False)
            elif abstract.endswith("k_proj.weight"):
                value = _rope_rows(value, cfg.num_key_value_heads, to_hf=False)
            out[name] = value
        return out


def tiny_titan_config() -> SimpleNamespace:
    """A torchtitan-style config function: what ``--module/--config`` names, with a model spec."""
    spec = SimpleNamespace(name="tiny", flavor="test", model=_tiny_config(), state_dict_adapter=TinyTitanAdapter)
    return SimpleNamespace(model_spec=spec, hf_assets_path="./no/such/assets")


def test_torchtitan_adapter_in_one_config_line(saved, tmp_path):  # noqa: F811
    from restore.export import export_hf
    from tierckpt import TieredWriter, load_config

    line = 'adapter = "torchtitan:test_hf_export_titan:tiny_titan_config"'
    cfg_path = tmp_path / "titan.toml"
    cfg_path.write_text(
        f'[host]\nbuffer_size = "8MiB"\nchunk_size = "1MiB"\n[local]\npath = "{tmp_path / "local"}"\nfsync = false\n'
        f'[export]\npath = "{tmp_path / "hf" / "{checkpoint_id}"}"\n'
        'keys = ["tok_embeddings.", "layers.", "norm.", "lm_head."]\n' + line + "\n"
    )
    cfg = load_config(cfg_path)
    assert cfg.export.adapter == "torchtitan:test_hf_export_titan:tiny_titan_config"
    # torchtitan's layout: the model's parameters at the top level under its names, beside the rest
    titan = TinyTitanAdapter(_tiny_config(), None).from_hf(saved["state"])
    state = {**titan, "optimizer": {"state": {"0": {"exp_avg": torch.ones(4)}}}, "train_state": {"step": 3}}
    w = TieredWriter(cfg)
    dcp.save(state, checkpoint_id="step-3", storage_writer=w, no_dist=True)
    w.wait()

    ex = cfg.export
    res = export_hf(
        cfg, "latest", out=ex.path, keys=ex.keys, adapter=ex.adapter, max_shard_size=SHARD, progress=False,
        files=[saved["ref"] / "config.json"],
    )  # fmt: skip
    folder, ref = tmp_path / "hf" / "step-3", saved["ref"]
    assert res.tensors == len(saved["state"])
    for p in ref.glob("*.safetensors"):
        assert (folder / p.name).read_bytes() == p.read_bytes(), p.name  # same names, rows, bytes
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for k, v in saved["state"].items():
        assert torch.equal(loaded[k], v), k


def test_bad_torchtitan_references_are_refused():
    from restore.errors import UsageError
    from restore.export import load_adapter
    from tierckpt.config.export import ExportConfig
    from tierckpt.errors import ConfigError

    for bad in ("torchtitan:", "torchtitan:llama3/", "torchtitan:a.b", "torchtitan:a b/c"):
        with pytest.raises(ConfigError, match="adapter"):
            ExportConfig(adapter=bad).validate()
    with pytest.raises(UsageError, match="torchtitan:no_such_module_here:cfg.*ModuleNotFoundError"):
        load_adapter("torchtitan:no_such_module_here:cfg")
    with pytest.raises(UsageError, match="use MODEL/FLAVOR"):
        load_adapter("torchtitan:justaname")


def test_torchtitans_own_llama3_adapter_by_model_and_flavor():
    pytest.importorskip("torchtitan.models.llama3")
    from restore.export import load_adapter

    to_hf = load_adapter("torchtitan:llama3/debugmodel")
    assert type(to_hf.__self__).__name__ == "Llama3StateDictAdapter"  # torchtitan's own, bound
    w = torch.empty(256, 256, device="meta")  # debugmodel: dim 256
    out = to_hf({"layers.1.attention.qkv_linear.wq.weight": w})
    assert list(out) == ["model.layers.1.self_attn.q_proj.weight"] and out[
        "model.layers.1.self_attn.q_proj.weight"
    ].shape == (256, 256)
