"""An Accelerate job whose save_state/load_state go through tierckpt (docs/integrations.md,
Accelerate recipe).

    python tools/accelerate_example/train.py                         # 1 process, CPU
    torchrun --nproc_per_node 2 tools/accelerate_example/train.py    # 2 processes (DDP, gloo on CPU)
    accelerate launch --use_fsdp --fsdp_version 2 tools/accelerate_example/train.py   # GPUs: FSDP2

Run it twice: the second run's ``load_state()`` picks the newest ``checkpoint_<n>`` from the tiers
(model, optimizer, scheduler, RNG states, data loader position) and trains ``--steps`` further.
Kill it at any moment: the next run resumes from the newest committed checkpoint.
``tierckpt-restore list --config tools/accelerate_example/tiers.toml``: what the tiers hold
(``total_limit=2``: two).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

from tierckpt.catalog.checkpoints import list_checkpoints
from tierckpt.integrations import accelerate as tierckpt_accelerate

HERE = os.path.dirname(os.path.abspath(__file__))


class Steps:
    """The step counter, saved with the checkpoint (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", default=os.path.join(HERE, "tiers.toml"))
    ap.add_argument("--project-dir", default="/tmp/tierckpt-accelerate-example/run")
    ap.add_argument("--steps", type=int, default=40, help="steps to train in this run")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--width", type=int, default=256)
    a = ap.parse_args()
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # without it, Accelerate runs torchrun's CPU processes unconnected
        project_config=ProjectConfiguration(a.project_dir, automatic_checkpoint_naming=True, total_limit=2),
        # the loader's position travels with the checkpoint (needs torchdata)
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    ckpt = tierckpt_accelerate.enable(accelerator, a.tiers)
    accelerator.print(f"{accelerator.num_processes} process(es), {accelerator.distributed_type}")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, a.width), torch.nn.GELU(), torch.nn.Linear(a.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1] * 0.5 - x[:, 1:2] ** 2),
                                         batch_size=32, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    steps = Steps()
    accelerator.register_for_checkpointing(steps)

    if any(c.id.startswith("checkpoint_") for c in list_checkpoints(a.tiers)):
        accelerator.load_state()  # the newest checkpoint_<n> committed on some tier
        accelerator.print(f"resumed at step {steps.step}")
    end = steps.step + a.steps
    it = iter(loader)
    while steps.step < end:
        try:
            xb, yb = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        loss = F.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        steps.step += 1
        if steps.step % a.every == 0:
            where = accelerator.save_state()  # returns once captured; one tierckpt checkpoint
            accelerator.print(f"step {steps.step}: loss {loss.item():.4f}, saved {os.path.basename(where)}")
    ckpt.close()  # wait for the last commit (errors of background work surface here)
    accelerator.print(f"trained to step {steps.step}")


if __name__ == "__main__":
    main()
