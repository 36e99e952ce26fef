"""A small GPT-style model trained on CPU with tiered checkpoints: the demo's and the tests' trainer.

Run alone (one process) or under several processes with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` set (gloo, DDP). Deterministic: weights from ``--seed``, batch ``i`` from
``(seed, i)``, no dropout, so a resumed run reproduces an uninterrupted run's losses (at the
same world size).

    python tools/train_gpt.py --config tiers.toml --steps 30 --ckpt-every 5 --log run.jsonl [--resume]
    python tools/train_gpt.py --writer dcp --dcp-dir /tmp/dcp ...     # DCP's FileSystemWriter, for comparison

Writes one JSON line per event to ``--log`` (rank 0): ``start``, ``resumed`` (step, state digest),
``step`` (loss), ``save`` (blocked seconds), ``done``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierckpt import TieredReader, TieredWriter, load_config  # noqa: E402
from tierckpt.errors import CheckpointNotFound  # noqa: E402


class TinyGPT(nn.Module):
    """Token + position embeddings, pre-norm transformer blocks with a causal mask, LM head."""

    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 4, heads: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), diagonal=1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def read_events(path: Path) -> list[dict]:
    """The JSON-lines events this trainer wrote to ``--log PATH`` (none if the file is missing).

    A killed run's last line may be torn: lines that are not valid JSON are skipped.
    """
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a killed run's last line may be torn
    return out


def batch(seed: int, step: int, rank: int, bsz: int, ctx: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    return torch.randint(0, vocab, (bsz, ctx + 1), generator=g)


class AppState(Stateful):
    """Model + optimizer + the data position, as DCP state (``state_dict``/``load_state_dict``)."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim, self.step = model, optim, 0

    def state_dict(self) -> dict:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd, "trainer": {"step": self.step}}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = int(sd["trainer"]["step"])


def digest(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    """SHA-256 over every tensor of the model and optimizer state, in key order."""
    msd, osd = get_state_dict(model, optim)
    h = hashlib.sha256()

    def walk(prefix: str, x) -> None:
        if isinstance(x, torch.Tensor):
            h.update(prefix.encode())
            h.update(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if x.numel() else b"")
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(f"{prefix}.{k}", x[k])
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}.{i}", v)
        else:
            h.update(f"{prefix}={x!r}".encode())

    walk("model", msd)
    walk("optim", osd)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="tier configuration (TOML); default $TIERCKPT_CONFIG")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--resume", action="store_true", help="load 'latest' first if there is one")
    p.add_argument("--writer", choices=["tiered", "dcp", "none"], default="tiered")
    p.add_argument("--dcp-dir", default="", help="with --writer dcp: where FileSystemWriter saves")
    p.add_argument("--log", default="", help="JSON-lines event log (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--digests", action="store_true", help="log the state digest with every checkpoint")
    p.add_argument("--chaos", default="", help="testing only: kill points inside the tiers (tools/chaos_tiers.py)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    logf = open(args.log, "a") if args.log and rank == 0 else None

    def event(**kw) -> None:
        if logf is not None:
            logf.write(json.dumps({"t": time.time(), **kw}) + "\n")
            logf.flush()

    torch.manual_seed(args.seed)
    vocab = 256
    model = TinyGPT(vocab, args.d_model, args.layers, 4, args.ctx)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    app = AppState(model, optim)
    state = {"app": app}
    no_dist = world == 1
    cfg = load_config(args.config) if args.writer == "tiered" or args.resume else None
    writer = TieredWriter(cfg) if args.writer == "tiered" else None
    if writer is not None:
        writer.attach(optim)
    if args.chaos and writer is not None:  # -- chaos hook (tools/chaos.py); inert without --chaos --
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import chaos_tiers

        chaos_tiers.install(writer, args.chaos)
    event(event="start", world=world, writer=args.writer, params=sum(p.numel() for p in model.parameters()))

    if args.resume:
        try:
            t0 = time.perf_counter()
            reader = TieredReader(cfg)
            reader.resolve()  # CheckpointNotFound here (on every rank alike), before DCP would wrap it
            dcp.load(state, checkpoint_id="latest", storage_reader=reader, no_dist=no_dist)
            load_s = time.perf_counter() - t0
            got = torch.tensor([sum(reader.from_peers.values())], dtype=torch.int64)
            if world > 1:
                dist.all_reduce(got)  # bytes every rank received from other nodes
            event(
                event="resumed",
                step=app.step,
                checkpoint=reader.resolved_id,
                digest=digest(model, optim),
                load_s=load_s,
                served=reader.served,
                from_peers=int(got.item()),
            )
        except CheckpointNotFound:
            event(event="fresh", reason="no committed checkpoint")

    loss_fn = nn.CrossEntropyLoss()
    while app.step < args.steps:
        x = batch(args.seed, app.step, rank, args.batch, args.ctx, vocab)
        logits = ddp(x[:, :-1])
        loss = loss_fn(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
        loss.backward()
        t0 = time.perf_counter()
        optim.step()
        step_wait = time.perf_counter() - t0
        optim.zero_grad(set_to_none=True)
        app.step += 1
        event(event="step", step=app.step, loss=loss.item(), opt_step_s=step_wait)
        if args.writer != "none" and app.step % args.ckpt_every == 0:
            cid = f"step-{app.step:06d}"
            t0 = time.perf_counter()
            if writer is not None:
                dcp.save(state, checkpoint_id=cid, storage_writer=writer, no_dist=no_dist)
            else:
                path = Path(args.dcp_dir) / cid
                dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=no_dist)
                old = Path(args.dcp_dir) / f"step-{app.step - 2 * args.ckpt_every:06d}"
                if rank == 0 and old.exists():
                    shutil.rmtree(old, ignore_errors=True)
            saved = time.perf_counter() - t0
            event(
                event="save",
                step=app.step,
                checkpoint=cid,
                save_s=saved,
                **({"digest": digest(model, optim)} if args.digests else {}),
            )
    if writer is not None:
        writer.wait()
        hist = [s.to_json() for s in writer.history]
        event(event="stats", history=hist)
    event(event="done", step=app.step, digest=digest(model, optim))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
