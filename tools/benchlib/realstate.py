"""Real training state for the compression measurements (``tools/bench.py --only compress``).

Compression ratios of random tensors say nothing: the three states here come from training.

* ``gpt``: a small GPT (byte-level, 6 blocks, d=256, ~5M parameters) trained for ``steps`` steps
  (300 by default) with AdamW on the Python standard library's source text, saved the way mixed
  precision trainers save it: ``model`` (bf16 weights), ``master`` (fp32 master weights) and
  ``optim`` (fp32 ``exp_avg`` / ``exp_avg_sq`` per parameter, and the step).
* ``titan``: torchtitan's llama3 ``debugmodel`` (built as in ``tests/titan_scenarios.py``, one
  process, no FSDP) trained 60 steps on random tokens with torchtitan's AdamW settings: fp32
  ``model`` and ``optim`` state.
* ``frozen``: a fine-tune of the ``gpt`` model where 90% of the parameters (by count: the
  embeddings and the first blocks) are frozen; fp32 ``model`` (every parameter) and AdamW state
  of the trainable 10%; one state per checkpoint, ``checkpoints`` checkpoints ``every`` steps apart.

States are built once and cached as ``.pt`` files under ``cache`` (training takes minutes on two
cores); delete the directory to rebuild. Deterministic (fixed seeds, one thread).
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parent.parent.parent


def _corpus(limit: int = 8 << 20, pattern: str = "*.py") -> torch.Tensor:
    """The bytes of the standard library's files matching ``pattern`` (sorted, first ``limit`` bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for p in sorted(root.glob(pattern)):
        out += p.read_bytes()
        if len(out) >= limit:
            break
    return torch.frombuffer(bytearray(out[:limit]), dtype=torch.uint8).long()


def _gpt() -> nn.Module:
    sys.path.insert(0, str(REPO / "tools"))
    from train_gpt import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab=256, d=256, layers=6, heads=4, ctx=128)


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    data: torch.Tensor,
    seed: int,
    bsz: int = 16,
    ctx: int = 128,
) -> None:
    g = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(steps):
        i = torch.randint(0, len(data) - ctx - 1, (bsz,), generator=g)
        x = torch.stack([data[j : j + ctx + 1] for j in i.tolist()])
        logits = model(x[:, :-1])
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _adam_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Any] = {"exp_avg": {}, "exp_avg_sq": {}}
    for p, st in opt.state.items():
        out["exp_avg"][names[id(p)]] = st["exp_avg"].clone()
        out["exp_avg_sq"][names[id(p)]] = st["exp_avg_sq"].clone()
        out["step"] = st["step"].clone()
    return out


def gpt_state(cache: Path, steps: int = 300) -> dict[str, Any]:
    """The mixed-precision GPT state (see the module docstring), cached in ``cache``."""
    path = cache / f"gpt-{steps}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    torch.set_num_threads(1)
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    _train(model, opt, steps, _corpus(), seed=1)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {"model": {k: v.to(torch.bfloat16) for k, v in sd.items()}, "master": sd, "optim": _adam_state(model, opt)}
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    torch.save(sd, cache / f"gpt-{steps}-weights.pt")
    return state


def titan_state(cache: Path, steps: int = 60) -> dict[str, Any] | None:
    """torchtitan's debugmodel + AdamW after ``steps`` steps (None where torchtitan is missing)."""
    path = cache / f"titan-{steps}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    try:
        from torchtitan.models.llama3 import model_registry
    except ImportError:
        return None
    import torch.nn.functional as F

    torch.set_num_threads(1)
    mc = model_registry("debugmodel").model
    torch.manual_seed(0)
    with torch.device("meta"):
        model = mc.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)

    class _Attention(nn.Module):
        def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **_kw):  # noqa: ANN001, ANN202
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                scale=scale,
                enable_gqa=enable_gqa,
            )
            return out.transpose(1, 2)

    for mod in model.modules():
        if hasattr(mod, "inner_attention"):
            mod.inner_attention = _Attention()
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        tokens = torch.randint(0, 2048, (4, 65), generator=g)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "optim": _adam_state(model, opt)}
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state


def frozen_states(cache: Path, checkpoints: int = 3, every: int = 20, frozen: float = 0.9) -> list[dict[str, Any]]:
    """``checkpoints`` states of a fine-tune of the ``gpt`` model with ``frozen`` of its
    parameters (by count, from the first) frozen, ``every`` steps apart."""
    path = cache / f"frozen-{checkpoints}x{every}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    gpt_state(cache)
    torch.set_num_threads(1)
    model = _gpt()
    model.load_state_dict(torch.load(cache / "gpt-300-weights.pt", weights_only=True))
    params = list(model.named_parameters())
    total = sum(p.numel() for _, p in params)
    seen = 0
    for _n, p in params:  # freeze from the first parameter on until `frozen` of the count is frozen
        if seen + p.numel() <= frozen * total:
            p.requires_grad_(False)
            seen += p.numel()
    trainable = [p for _, p in params if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    data = _corpus(8 << 20, "*/*.py")  # other text than the pre-training run's (the packages' sources)
    out = []
    for c in range(checkpoints):
        _train(model, opt, every, data, seed=100 + c)
        out.append(
            {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "optim": _adam_state(model, opt)}
        )
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def tensors(state: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a nested state dict, with its dotted key, in key order."""
    if isinstance(state, torch.Tensor):
        return [(prefix, state)]
    out = []
    if isinstance(state, dict):
        for k in state:
            out += tensors(state[k], f"{prefix}.{k}" if prefix else str(k))
    return out
