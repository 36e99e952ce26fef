"""A Lightning job whose checkpoints go through tierckpt (docs/integrations.md, Lightning recipe).

    python tools/lightning_example/train.py                       # 1 process, CPU
    torchrun --nproc_per_node 2 tools/lightning_example/train.py  # DDP, 2 processes (gloo on CPU)
    torchrun --nproc_per_node 2 tools/lightning_example/train.py --fsdp2    # ModelParallelStrategy

Run it twice: the second run resumes from the last checkpoint (``ckpt_path="last"``) and trains
``--steps`` further. Stop it at any moment (Ctrl-C, kill -9): the next run resumes from the newest
committed checkpoint. ``tierckpt-restore list --config tools/lightning_example/tiers.toml`` shows
what the tiers hold (``save_top_k=2``: two).
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from tierckpt.integrations.lightning import TierckptCheckpointIO, TierckptModelParallelStrategy

HERE = os.path.dirname(os.path.abspath(__file__))


class Regressor(L.LightningModule):
    def __init__(self, width: int, fsdp2: bool) -> None:
        super().__init__()
        self.fsdp2 = fsdp2
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 1))

    def configure_model(self) -> None:
        if self.fsdp2:  # ModelParallelStrategy: shard here (FSDP2)
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, idx):  # noqa: ANN001, ANN201
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", default=os.path.join(HERE, "tiers.toml"))
    ap.add_argument("--dirpath", default="/tmp/tierckpt-lightning-example/ckpt", help="where the pointer files go")
    ap.add_argument("--steps", type=int, default=40, help="steps to train in this run")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--fsdp2", action="store_true")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(0))
    y = x[:, :1] * 0.5 - x[:, 1:2] ** 2
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    if a.fsdp2:
        strategy, plugins = TierckptModelParallelStrategy(a.tiers, data_parallel_size=world, tensor_parallel_size=1), []
    else:
        strategy, plugins = ("ddp" if world > 1 else "auto"), [TierckptCheckpointIO(a.tiers)]
    ckpt = ModelCheckpoint(dirpath=a.dirpath, every_n_train_steps=a.every, save_top_k=2, monitor="step", mode="max",
                           save_last="link")
    # how far the last run got: the newest checkpoint's step (Lightning reads it from the checkpoint)
    done = 0
    last = os.path.join(a.dirpath, "last.ckpt")
    if os.path.exists(last):
        import json

        with open(last) as f:
            done = json.load(f).get("step") or 0
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, plugins=plugins, max_steps=done + a.steps,
                        callbacks=[ckpt], logger=False, enable_model_summary=False)
    trainer.fit(Regressor(a.width, a.fsdp2), loader, ckpt_path="last")
    if trainer.is_global_zero:
        print(f"trained to step {trainer.global_step}; checkpoints under {a.dirpath} (pointers) and in the tiers "
              f"of {a.tiers}")


if __name__ == "__main__":
    main()
