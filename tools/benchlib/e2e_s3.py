"""Part of section ``e2e``: training with an S3 hop behind the local tier, compression on that hop
"none" vs "zstd", side by side in one run (``--e2e-s3 seaweedfs|moto|off``).

A small GPT (:class:`benchlib.e2e.TinyGPT`, the ``--quick`` size of section ``e2e``) trained on
random tokens with a checkpoint every iteration into [local] + [s3] on a loopback server, in
interleaved rounds of blocks: no checkpoint, ``[s3] compression = "none"``, ``"zstd"``. Per
block: the training loop's wall time (forward/backward, optimizer steps, checkpoint calls: what
training feels; after one untimed iteration), the drain after it (``writer.wait()``: the S3 hop catching up) and the CPU
seconds of the process. Target (issue #23): the loop with ``"zstd"`` within noise of ``"none"``
(the no-checkpoint blocks of the rounds give the noise).
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from benchlib.common import Ctx, MiB, cpu_seconds, log, med, now, rm, row, tensor_bytes
from benchlib.lazy import train_state


def e2e_s3_rows(ctx: Ctx, server: str) -> tuple[list[dict], list[str]]:
    """The rows and notes of the S3-hop comparison (see the module docstring)."""
    from benchlib.e2e import TinyGPT
    from benchlib.s3clients import start_s3_server
    from tierckpt import TieredWriter
    from tierckpt.config import config_from_dict
    from tools.s3servers import make_bucket

    root = ctx.work / "e2e-s3"
    root.mkdir()
    torch.manual_seed(0)
    vocab, d, layers, heads, ff, T, B = 4096, 384, 4, 6, 1536, 128, 4
    iters, rounds = (3, 1) if ctx.quick else (4, 3)
    model = TinyGPT(vocab, d, layers, heads, ff, T)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (B, T), generator=g)
    y = torch.randint(0, vocab, (B, T), generator=g)

    def step() -> None:
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()
    state_bytes = tensor_bytes(train_state(model, opt))
    url, stop, note = start_s3_server(server, root / "s3")
    try:
        make_bucket(url, "e2e")

        def block(mode: str, r: int) -> dict:
            writer = None
            if mode != "no checkpoint":
                cfg = config_from_dict(
                    {
                        "host": {"buffer_size": "512MiB", "chunk_size": "32MiB"},
                        "local": {"path": str(root / f"local-{mode}"), "keep": 2},
                        "s3": {
                            "bucket": "e2e",
                            "prefix": f"{mode}-{r}",
                            "endpoint_url": url,
                            "keep": 2,
                            "part_size": "16MiB",
                            "concurrency": 4,
                            "compression": mode,
                        },
                    }
                )
                writer = TieredWriter(cfg)
            handle = writer.attach(opt) if writer else None
            for i in range(iters + 1):  # the first iteration (and its promotion) is an untimed warm-up
                if i == 1:
                    if writer:
                        writer.wait()
                    c0, t0 = cpu_seconds(), now()
                step()
                if writer:
                    dcp.save(
                        train_state(model, opt), checkpoint_id=f"s3e2e-{r}-{i:03d}", storage_writer=writer, no_dist=True
                    )
            loop = now() - t0
            if writer:
                writer.wait()
            total = now() - t0
            out = {"loop_s": loop, "drain_s": total - loop, "total_s": total, "cpu_s": cpu_seconds() - c0}
            if writer:
                hist = writer.history[-iters:]
                out["promote_s"] = [h.promote_s for h in hist]
                out["stored"] = sum(h.stored_bytes or h.bytes for h in hist)
                out["logical"] = sum(h.bytes for h in hist)
                out["compress_cpu_s"] = sum(h.compress_cpu_s for h in hist)
                handle.remove()
                writer.close()
            rm(root / f"local-{mode}")
            return out

        modes = ("no checkpoint", "none", "zstd")
        blocks: dict[str, list[dict]] = {m: [] for m in modes}
        log("e2e-s3: warm-up block (not counted: the first block after the server's start runs slow)")
        block("no checkpoint", -1)
        for r in range(rounds):
            for m in modes:
                log(f"e2e-s3: round {r + 1}/{rounds}: {m}")
                blocks[m].append(block(m, r))
    finally:
        stop()
        rm(root)
    base = [b["loop_s"] for b in blocks["no checkpoint"]]
    noise = (max(base) - min(base)) / med(base) if len(base) > 1 else None
    rows = []
    for m, bl in blocks.items():
        loops = [b["loop_s"] for b in bl]
        name = f"e2e with S3 hop: {'no checkpoint' if m == 'no checkpoint' else f'[s3] compression = {m}'}"
        extra = ""
        if m != "no checkpoint":
            ratio = sum(b["logical"] for b in bl) / max(1, sum(b["stored"] for b in bl))
            extra = (
                f"; drain after the loop {med([b['drain_s'] for b in bl]):.1f} s, promote_s median "
                f"{med([p for b in bl for p in b['promote_s']]):.1f} s, stored ratio {ratio:.3f}, "
                f"compress {sum(b['compress_cpu_s'] for b in bl):.2f} CPU-s"
            )
        rows.append(
            row(
                name,
                loops,
                state_bytes * iters if m != "no checkpoint" else None,
                ratio=med(loops) / med(base),
                note=f"ratio: training loop vs no checkpoint; loops {', '.join(f'{v:.1f}' for v in loops)} s; "
                f"CPU {med([b['cpu_s'] for b in bl]):.1f} s/block" + extra,
                blocks=bl,
            )
        )
    nz = med([b["loop_s"] for b in blocks["zstd"]]) / med([b["loop_s"] for b in blocks["none"]])
    notes = [
        f"e2e with S3 hop ({note}): GPT state+Adam {state_bytes / MiB:.0f} MiB, a checkpoint every iteration, "
        f"{iters} iterations per block, {rounds} interleaved round(s); loop zstd/none = {nz:.3f}"
        + (f", no-checkpoint blocks spread {100 * noise:.1f}% (the noise)" if noise is not None else "")
    ]
    return rows, notes
