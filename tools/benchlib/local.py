"""Section ``local``: save bandwidth vs the disk ceiling, load vs ``FileSystemReader``."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from benchlib.common import (
    Ctx,
    GiB,
    MiB,
    compare_state,
    cpu_seconds,
    drop_caches,
    empty_like_state,
    log,
    make_state,
    med,
    now,
    raw_write,
    rm,
    row,
    size_label,
    tensor_bytes,
    tiered_cfg,
    warm_file_tree,
    zero_state,
)
from tierckpt import TierConfig, TieredReader, TieredWriter
from tierckpt.chain.retention import delete_checkpoint
from tierckpt.tiers.local import drain_deletions


def section_local(ctx: Ctx) -> dict:
    size = int((0.25 if ctx.quick else ctx.args.size_gib) * GiB)
    R = ctx.repeats
    root = ctx.work / "local"
    root.mkdir()
    log(f"local: building a {size / GiB:.2f} GiB state dict")
    sd = make_state(size)
    nbytes = tensor_bytes(sd)
    ntensors = sum(isinstance(v, torch.Tensor) for v in sd.values())
    dest = empty_like_state(sd)
    import mmap

    # page-aligned (O_DIRECT needs it), huge pages when available, touched below
    _rawmm = mmap.mmap(-1, 256 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):
        _rawmm.madvise(mmap.MADV_HUGEPAGE)
    rawbuf = torch.frombuffer(_rawmm, dtype=torch.uint8)
    rawbuf.copy_(torch.randint(0, 256, (256 * MiB,), dtype=torch.uint8))

    pools = [(512 * MiB, 32 * MiB), (1 * GiB, 64 * MiB)]
    # keep=0 and the previous checkpoint deleted before the timer starts: the same treatment as the
    # other writers' outputs (retention would otherwise delete it inside the timed region).
    cfgs = {f"{size_label(p)}/{size_label(c)}": tiered_cfg(root / f"tiered-{p >> 20}m", p, c, keep=0) for p, c in pools}

    # ---- saves -------------------------------------------------------------------------
    save_times: dict[str, list[float]] = {}
    extra: dict[str, dict[str, list]] = {}
    last_out: dict[str, Any] = {}
    counter = {"n": 0}

    def tiered_save(label: str, cfg: TierConfig) -> Callable[[], float]:
        def run() -> float:
            counter["n"] += 1
            cid = f"bench-{label.replace('/', '-')}-{counter['n']:03d}"
            w = TieredWriter(cfg)
            prev = last_out.get(f"tiered {label}")
            if prev is not None:
                delete_checkpoint(w.engine.first_tier, prev)
                drain_deletions()
            os.sync()
            t0 = now()
            dcp.save(sd, checkpoint_id=cid, storage_writer=w)
            t1 = now()
            w.wait_captured()
            t2 = now()
            w.wait()
            t3 = now()
            st = w.stats
            e = extra.setdefault(f"tiered {label}", {})
            e.setdefault("blocked_in_save_s", []).append(t1 - t0)
            e.setdefault("captured_s", []).append(t2 - t0)
            e.setdefault("lib_save_blocked_s", []).append(st.save_blocked_s)
            e.setdefault("lib_capture_s", []).append(st.capture_s)
            e.setdefault("lib_flush_durable_s", []).append(st.flush_s)
            e.setdefault("commit_tail_s", []).append(t3 - t0 - (st.flush_s or 0.0))
            last_out[f"tiered {label}"] = cid
            return t3 - t0

        return run

    def out_path(name: str) -> Path:
        return root / name.replace(" ", "_").replace("/", "-").replace("=", "")

    def generic(name: str, fn: Callable[[Path], None]) -> Callable[[], float]:
        def run() -> float:
            p = out_path(name)
            rm(p)
            os.sync()
            t0 = now()
            fn(p)
            t = now() - t0
            last_out[name] = p
            return t

        return run

    def do_torch_save(p: Path) -> None:
        with open(p, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())

    methods: dict[str, Callable[[], float]] = {
        "raw write+fsync 1 thread": None,  # filled below (need cleanup after)
        "raw write+fsync 2 threads": None,
        "raw O_DIRECT write+fsync 1 thread": None,
        "raw O_DIRECT write+fsync 2 threads": None,
        "torch.save+fsync": generic("torch.save+fsync", do_torch_save),
        "DCP FileSystemWriter": generic(
            "DCP FileSystemWriter", lambda p: dcp.save(sd, storage_writer=dcp.FileSystemWriter(p))
        ),
        "DCP FileSystemWriter thread_count=4": generic(
            "DCP FileSystemWriter thread_count=4",
            lambda p: dcp.save(sd, storage_writer=dcp.FileSystemWriter(p, thread_count=4)),
        ),
    }
    for direct in (False, True):
        for threads in (1, 2):
            name = f"raw {'O_DIRECT ' if direct else ''}write+fsync {threads} thread{'s' if threads > 1 else ''}"

            def raw(threads: int = threads, name: str = name, direct: bool = direct) -> float:
                p = out_path(name)
                rm(p)
                os.sync()
                t = raw_write(p, nbytes, rawbuf, threads, direct)
                rm(p)
                return t

            methods[name] = raw
    for label, cfg in cfgs.items():
        methods[f"tiered {label}"] = tiered_save(label, cfg)

    # the first TieredWriter save of a process allocates and touches the pool: measure it once
    first_save: dict[str, float] = {}
    for label in cfgs:
        os.sync()
        log(f"local: first tiered save {label} (fresh pool)")
        first_save[label] = methods[f"tiered {label}"]()
    for name in extra:
        for k in extra[name]:
            extra[name][k].clear()
    # warm DCP's code paths once (tiny state) so the first timed DCP call is not penalized
    tiny = {"x": torch.zeros(8)}
    dcp.save(tiny, storage_writer=dcp.FileSystemWriter(root / "warm"))
    dcp.load(tiny, storage_reader=dcp.FileSystemReader(root / "warm"))
    rm(root / "warm")

    save_cpu: dict[str, list[float]] = {}
    for r in range(R):
        for name, fn in methods.items():
            log(f"local: save rep {r + 1}/{R}: {name}")
            if name.startswith("tiered"):
                os.sync()
            c0 = cpu_seconds()
            save_times.setdefault(name, []).append(fn())
            save_cpu.setdefault(name, []).append(cpu_seconds() - c0)
    rm(out_path("DCP FileSystemWriter thread_count=4"))

    # ---- loads -------------------------------------------------------------------------
    cold = drop_caches()
    loads: dict[str, Callable[[], None]] = {}
    load_paths: dict[str, Path] = {
        "torch.load + copy_ into dest": last_out["torch.save+fsync"],
        "DCP FileSystemReader": last_out["DCP FileSystemWriter"],
    }

    def do_torch_load() -> None:
        obj = torch.load(last_out["torch.save+fsync"], weights_only=True)
        for k, v in obj.items():
            if isinstance(v, torch.Tensor):
                dest[k].copy_(v)
            else:
                dest[k] = v
        del obj

    loads["torch.load + copy_ into dest"] = do_torch_load
    loads["DCP FileSystemReader"] = lambda: dcp.load(
        dest, storage_reader=dcp.FileSystemReader(last_out["DCP FileSystemWriter"])
    )
    for label, cfg in cfgs.items():
        cid = last_out[f"tiered {label}"]
        loads[f"TieredReader {label}"] = lambda cfg=cfg, cid=cid: dcp.load(
            dest, checkpoint_id=cid, storage_reader=TieredReader(cfg)
        )
        load_paths[f"TieredReader {label}"] = cfg.local.resolved_path()  # keep=1: only this checkpoint

    load_times: dict[str, list[float]] = {}
    load_cpu: dict[str, list[float]] = {}
    verified: dict[str, Any] = {}
    for r in range(R):
        for name, fn in loads.items():
            log(f"local: load rep {r + 1}/{R}: {name}")
            if r == 0:
                zero_state(dest)
            gc.collect()
            if cold:
                drop_caches()
            else:
                warm_file_tree(load_paths[name])
            t0 = now()
            c0 = cpu_seconds()
            fn()
            load_times.setdefault(name, []).append(now() - t0)
            load_cpu.setdefault(name, []).append(cpu_seconds() - c0)
            if r == 0:
                bad = compare_state(dest, sd)
                verified[name] = "ok" if not bad else f"MISMATCH in {bad[:5]}"

    # ---- rows --------------------------------------------------------------------------
    rows = []
    ceiling_name = min(
        ("raw O_DIRECT write+fsync 1 thread", "raw O_DIRECT write+fsync 2 threads"), key=lambda n: med(save_times[n])
    )
    ceiling_bw = nbytes / med(save_times[ceiling_name])
    buffered_name = min(("raw write+fsync 1 thread", "raw write+fsync 2 threads"), key=lambda n: med(save_times[n]))
    gib = nbytes / GiB
    for name, ts in save_times.items():
        bw = nbytes / med(ts)
        note = ""
        if name == ceiling_name:
            note = "ceiling"
        e = {}
        if name in extra:
            e = {k: {"median": med(v), "min": min(v)} for k, v in extra[name].items() if v}
            note = (
                f"blocked in dcp.save {e['blocked_in_save_s']['median'] * 1e3:.1f} ms, captured "
                f"{e['captured_s']['median']:.2f} s, durable {e['lib_flush_durable_s']['median']:.2f} s, "
                f"commit tail {e['commit_tail_s']['median']:.2f} s"
            )
        rows.append(
            row(
                "save: " + name,
                ts,
                nbytes,
                ratio=bw / ceiling_bw,
                note=note,
                details=e,
                cpu_s_per_gib=med(save_cpu[name]) / gib,
            )
        )
    for label, t in first_save.items():
        rows.append(
            row(
                f"save: tiered {label} first save (fresh pool)",
                [t],
                nbytes,
                ratio=(nbytes / t) / ceiling_bw,
                note="once, before the repeats; touches the pool",
            )
        )
    fs_load = med(load_times["DCP FileSystemReader"])
    for name, ts in load_times.items():
        rows.append(
            row(
                "load: " + name,
                ts,
                nbytes,
                ratio=fs_load / med(ts),
                note=f"{'cold' if cold else 'warm'}; verify {verified.get(name)}",
                cpu_s_per_gib=med(load_cpu[name]) / gib,
            )
        )

    ratios: dict[str, float] = {}
    targets: dict[str, tuple[str, float]] = {}
    for label in cfgs:
        ratios[f"tiered_save_bw/raw_ceiling [{label}]"] = (nbytes / med(save_times[f"tiered {label}"])) / ceiling_bw
        targets[f"tiered_save_bw/raw_ceiling [{label}]"] = (">=", 0.9)
        durable = med(extra[f"tiered {label}"]["lib_flush_durable_s"])
        ratios[f"(info) tiered_durable_bw/raw_ceiling [{label}]"] = (nbytes / durable) / ceiling_bw
        ratios[f"tiered_load_bw/fsreader_load_bw [{label}]"] = fs_load / med(load_times[f"TieredReader {label}"])
        targets[f"tiered_load_bw/fsreader_load_bw [{label}]"] = (">=", 2.0)
    ratios["(info) raw O_DIRECT ceiling / raw buffered"] = med(save_times[buffered_name]) / med(
        save_times[ceiling_name]
    )
    notes = [
        f"state: {nbytes / GiB:.3f} GiB in {ntensors} tensors (+ non-tensor items); {R} interleaved repeats; "
        f"ratio column: save bw / ceiling ({ceiling_name}: fallocate + O_DIRECT pwrite of 64 MiB from a page-aligned "
        "buffer + fsync, the I/O the local tier's sink does), load: FileSystemReader time / this time; "
        "CPU-s/GiB: this process's user+system CPU (all threads) during the operation per GiB",
        f"loads are {'cold (page cache dropped before each)' if cold else 'warm (drop_caches not permitted; every file pre-read)'}",
        "tiered save time = dcp.save start .. writer.wait() returned (fsynced, renamed, metadata committed, "
        "keep=0); every writer's previous output is deleted before its timer starts, "
        "the TieredWriter deletes its previous checkpoint (retention) inside the timed commit; "
        "(info) ratios use the time until the data file was durable (fsync+rename), before the commit",
    ]
    for cfg in cfgs.values():
        rm(cfg.local.resolved_path())
    rm(root)
    del sd, dest, rawbuf
    gc.collect()
    return {
        "rows": rows,
        "ratios": ratios,
        "targets": targets,
        "notes": notes,
        "state_bytes": nbytes,
        "tensors": ntensors,
        "loads_cold": cold,
        "repeats": R,
    }
