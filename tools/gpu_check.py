"""GPU checks for tierckpt, for one CUDA device, in one run (target: under 5 minutes on an H200).

    python tools/gpu_check.py [--gib 20] [--dir /tmp/tierckpt-gpu] [--out gpu_check.json]

1. Bit-exact round trip of a ~20 GiB CUDA state dict (half bf16, half fp32) through
   ``TieredWriter``/``TieredReader`` (local tier), loaded back into CUDA tensors.
2. The pinned device-to-host ceiling (one large ``copy_`` into pinned memory) against our capture
   bandwidth (bytes / time until every chunk landed in the pinned pool).
3. Blocking time per checkpoint in a loop with real forward/backward work: ``TieredWriter``
   (save call + optimizer pre-step wait) against ``dcp.async_save`` with DCP's ``DefaultStager``
   (pinned, async staging; time in async_save + waiting for its staging before the next step).
4. The capture checks (issue 35): the same state saved with ``[job] verify_capture = "all"`` +
   ``nonfinite = "warn"`` and with both off, alternately: time until captured, CPU-s/GiB of the
   process and ``verify_cpu_s``; and a NaN planted in one tensor must be counted in the metadata.

Prints a table and writes JSON. Exits 1 if the round trip is not bit-exact. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierckpt import HostConfig, LocalConfig, TierConfig, TieredReader, TieredWriter  # noqa: E402

GiB = 1 << 30


def init_pg() -> None:
    if not dist.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("cpu:gloo,cuda:nccl")


def make_state(gib: float) -> dict[str, torch.Tensor]:
    n = max(2, int(gib * 4))  # 256 MiB tensors
    sd = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in range(n):
        if i % 2 == 0:
            sd[f"bf16.{i}"] = torch.randn(GiB // 4 // 2, device="cuda", generator=g).to(torch.bfloat16)
        else:
            sd[f"fp32.{i}"] = torch.randn(GiB // 4 // 4, device="cuda", generator=g)
    return sd


def d2h_ceiling(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t0))
    del src, dst
    return best


def roundtrip(sd: dict, cfg: TierConfig) -> dict:
    w = TieredWriter(cfg)
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id="rt-1", storage_writer=w)
    t_save = time.perf_counter() - t0
    w.wait_captured()
    t_cap = time.perf_counter() - t0
    w.wait()
    t_commit = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    t0 = time.perf_counter()
    dcp.load(out, checkpoint_id="rt-1", storage_reader=TieredReader(cfg))
    torch.cuda.synchronize()
    t_load = time.perf_counter() - t0
    same = all(torch.equal(out[k], sd[k]) for k in sd)
    del out
    return {
        "bytes": nbytes,
        "bit_exact": same,
        "save_call_s": t_save,
        "captured_s": t_cap,
        "capture_gib_s": nbytes / GiB / w.stats.capture_s if w.stats.capture_s else None,
        "committed_s": t_commit,
        "load_s": t_load,
    }


def blocking_loop(cfg: TierConfig, steps: int, tmp: Path) -> dict:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192, device="cuda") for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4096, 8192, device="cuda")

    def step() -> None:
        model(x).float().pow(2).mean().backward()

    step()
    opt.step()
    opt.zero_grad()
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    res: dict = {}
    # tierckpt
    w = TieredWriter(cfg)
    handle = w.attach(opt)
    blocked = []
    for i in range(steps):
        step()
        t0 = time.perf_counter()
        dcp.save(sd, checkpoint_id=f"loop-{i}", storage_writer=w)
        t_save = time.perf_counter() - t0
        step()
        t0 = time.perf_counter()
        w.wait_captured()
        blocked.append(t_save + time.perf_counter() - t0)
        opt.step()
        opt.zero_grad()
    w.wait()
    handle.remove()
    res["tierckpt_blocked_ms"] = sorted(blocked)[len(blocked) // 2] * 1e3
    # dcp.async_save + DefaultStager
    stager = DefaultStager(StagingOptions(True, False, True, True))
    blocked = []
    prev = None
    for i in range(steps):
        step()
        t0 = time.perf_counter()
        if prev is not None:
            prev.upload_completion.result()
        resp = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(str(tmp / f"async-{i}")), async_stager=stager)
        t_save = time.perf_counter() - t0
        step()
        t0 = time.perf_counter()
        resp.staging_completion.result()
        blocked.append(t_save + time.perf_counter() - t0)
        opt.step()
        opt.zero_grad()
        prev = resp
        shutil.rmtree(tmp / f"async-{i - 2}", ignore_errors=True)
    prev.upload_completion.result()
    stager.close()
    res["async_save_blocked_ms"] = sorted(blocked)[len(blocked) // 2] * 1e3
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    res["fwd_bwd_ms"] = (time.perf_counter() - t0) * 1e3
    res["state_gib"] = sum(v.numel() * v.element_size() for v in model.state_dict().values()) * 3 / GiB
    return res


def capture_checks(sd: dict, tmp: Path, reps: int = 3) -> dict:
    """Off vs ``verify_capture=all`` + ``nonfinite=warn`` on the same CUDA state (alternating)."""
    import dataclasses
    import resource

    from tierckpt import JobConfig

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    modes = {"off": JobConfig(), "all+nonfinite": JobConfig(verify_capture="all", nonfinite="warn")}
    writers = {
        m: TieredWriter(
            TierConfig(
                host=HostConfig(buffer_size=8 * GiB, chunk_size=256 << 20),
                local=LocalConfig(path=str(tmp / f"vc-{m}"), flush_threads=8, keep=1),
                job=dataclasses.replace(j),
            )
        )
        for m, j in modes.items()
    }
    res: dict = {m: {"captured_s": [], "cpu_s_per_gib": [], "verify_cpu_s_per_gib": []} for m in modes}
    for w in writers.values():  # warm-up: the pools allocated and touched
        dcp.save(sd, checkpoint_id="vc-warm", storage_writer=w)
        w.wait()
    for i in range(reps):
        for m, w in writers.items():
            torch.cuda.synchronize()
            c0, t0 = cpu(), time.perf_counter()
            dcp.save(sd, checkpoint_id=f"vc-{i}", storage_writer=w)
            w.wait_captured()
            res[m]["captured_s"].append(time.perf_counter() - t0)
            w.wait()
            res[m]["cpu_s_per_gib"].append((cpu() - c0) / (nbytes / GiB))
            res[m]["verify_cpu_s_per_gib"].append(w.stats.verify_cpu_s / (nbytes / GiB))
    out = {m: {k: sorted(v)[len(v) // 2] for k, v in r.items()} for m, r in res.items()}
    first = next(iter(sd))
    keep = sd[first].view(-1)[12345].item()
    sd[first].view(-1)[12345] = float("nan")
    w = writers["all+nonfinite"]
    dcp.save(sd, checkpoint_id="vc-nan", storage_writer=w)
    w.wait()
    sd[first].view(-1)[12345] = keep
    doc = json.loads((tmp / "vc-all+nonfinite" / "vc-nan" / "metadata.json").read_bytes().partition(b"\n")[2])
    out["nan_counted"] = sum(it.get("nonfinite") or 0 for it in doc["items"]) == 1
    for w in writers.values():
        w.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=20.0)
    ap.add_argument("--dir", default="")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    init_pg()
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="tierckpt-gpu-"))
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = TierConfig(
        host=HostConfig(buffer_size=16 * GiB, chunk_size=256 << 20),
        local=LocalConfig(path=str(tmp / "local"), flush_threads=8, keep=1),
    )
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["d2h_ceiling_gib_s"] = d2h_ceiling(4 * GiB) / GiB
    sd = make_state(args.gib)
    report["roundtrip"] = roundtrip(sd, cfg)
    report["capture_checks"] = capture_checks(sd, tmp)
    del sd
    torch.cuda.empty_cache()
    report["blocking"] = blocking_loop(cfg, args.steps, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    rt, bl = report["roundtrip"], report["blocking"]
    rows = [
        ("device", report["device"]),
        ("pinned D2H ceiling GiB/s", f"{report['d2h_ceiling_gib_s']:.1f}"),
        ("capture GiB/s (tierckpt)", f"{rt['capture_gib_s']:.1f}" if rt["capture_gib_s"] else "-"),
        (
            "capture / ceiling",
            f"{rt['capture_gib_s'] / report['d2h_ceiling_gib_s']:.2f}" if rt["capture_gib_s"] else "-",
        ),
        (f"round trip {rt['bytes'] / GiB:.1f} GiB bit-exact", "yes" if rt["bit_exact"] else "NO"),
        (
            "save call / captured / committed s",
            f"{rt['save_call_s']:.2f} / {rt['captured_s']:.2f} / {rt['committed_s']:.2f}",
        ),
        ("load s", f"{rt['load_s']:.2f}"),
        ("fwd+bwd ms", f"{bl['fwd_bwd_ms']:.0f}"),
        ("blocked ms/ckpt tierckpt", f"{bl['tierckpt_blocked_ms']:.1f}"),
        ("blocked ms/ckpt async_save+DefaultStager", f"{bl['async_save_blocked_ms']:.1f}"),
    ]
    cc = report["capture_checks"]
    for m in ("off", "all+nonfinite"):
        rows.append(
            (
                f"checks {m}: captured s / CPU-s/GiB / verify CPU-s/GiB",
                f"{cc[m]['captured_s']:.2f} / {cc[m]['cpu_s_per_gib']:.3f} / {cc[m]['verify_cpu_s_per_gib']:.3f}",
            )
        )
    rows.append(("checks: planted NaN counted in metadata", "yes" if cc["nan_counted"] else "NO"))
    for k, v in rows:
        print(f"{k:45s} {v}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()
    return 0 if rt["bit_exact"] and cc["nan_counted"] else 1


if __name__ == "__main__":
    sys.exit(main())
