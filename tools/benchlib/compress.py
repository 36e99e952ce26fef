"""Section ``compress`` of ``tools/bench.py`` (only with ``--only compress``): lossless compression
by byte planes and server-side copies of unchanged parts, on real training state
(:mod:`benchlib.realstate`: a small GPT after 300 steps with bf16 weights + fp32 master + AdamW,
torchtitan's debugmodel after 60 steps, a fine-tune with 90% of the parameters frozen).

1. **Ratios and speeds.** Each state is laid out as the writer lays a rank's file out (items in
   key order at 64-byte aligned offsets, plane width from the dtype) and cut into 4 MiB frames;
   per category (bf16 weights, fp32 master, ``exp_avg``, ``exp_avg_sq``, the whole state): our
   frames (byte planes, zstd literal-only per plane at the default level 1,
   :mod:`tierckpt.codec.frames`), zstd level 1 on the raw
   bytes, and, where installed, blosc2 (shuffle + zstd-1) and ZipNN (Huffman) side by side.
   Speeds are bytes per CPU second of the one thread that codes (``time.thread_time``), after a
   warm-up pass, the least of three passes.
2. **DCP's ZStandard extension** on the same state: ``dcp.save`` with ``FileSystemWriter``
   (one thread) with and without ``_extensions=[ZStandard()]``; its ratio, and its speed as
   logical bytes per CPU second added by the extension.
3. **Promotion through a throttled endpoint.** SeaweedFS behind :class:`benchlib.throttle.Throttle`
   (in a child process, :func:`benchlib.throttle.spawn`: not on the client's GIL) at each of ``--throttle-mbs`` (250 MB/s: a node's share of the network), a ~270 MB state (four GPT
   states), ``[s3] compression`` "none" vs "zstd" (``copy_unchanged`` off), interleaved repeats:
   ``promote_s`` from ``writer.history``. Target: faster by >= 0.9x the compression ratio.
4. **Frozen fine-tune.** Three checkpoints of the 90%-frozen fine-tune promoted to SeaweedFS with
   ``compression = "zstd"`` and ``copy_unchanged``: per checkpoint the bytes uploaded and copied by
   the server, against the state's bytes and against the bytes that changed; then, without S3,
   the floor (the changed tensors coded on their own) and the coded bytes of the frames that
   differ for frame sizes 4 MiB .. 64 KiB (the granularity loss).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from benchlib.common import REPO, log, med, row
from benchlib.realstate import frozen_states, gpt_state, tensors, titan_state
from tierckpt.codec.frames import decode_into, encode, encode_into, segments_of, stored_bound
from tierckpt.codec.hop import width_runs
from tierckpt.format.layout import padded

FRAME = 4 << 20
MB = 1e6


def _layout(ts: list[tuple[str, torch.Tensor]]) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """One file of ``ts`` as the writer lays it out: bytes and width runs."""
    parts, items, at = [], [], 0
    for _k, t in ts:
        b = (
            t.contiguous().reshape(-1).view(torch.uint8).numpy()
            if t.numel() and t.dim()
            else np.frombuffer(t.contiguous().numpy().tobytes(), np.uint8)
        )
        n = padded(len(b))
        parts.append(b)
        if n > len(b):
            parts.append(np.zeros(n - len(b), np.uint8))
        items.append((at, n, str(t.dtype).removeprefix("torch.")))
        at += n
    return (np.concatenate(parts) if parts else np.zeros(0, np.uint8)), width_runs(items)


def _ours(data: np.ndarray, runs: list, level: int = 1) -> tuple[int, float, float]:
    """Our frames, coded as the hop codes them (:func:`encode_into` a buffer reused from frame to
    frame) and decoded as the read path decodes them (:func:`decode_into` the caller's buffer)."""
    stored, tc, td = 0, 0.0, 0.0
    out = bytearray(FRAME)
    dst = bytearray(FRAME + 4096)
    for s in range(0, len(data), FRAME):
        e = min(len(data), s + FRAME)
        t0 = time.thread_time()
        segs = segments_of(s, e, runs)
        if len(dst) < stored_bound(e - s, segs):
            dst = bytearray(stored_bound(e - s, segs))
        z = memoryview(dst)[: encode_into(data[s:e], segs, level, dst)]
        tc += time.thread_time() - t0
        t0 = time.thread_time()
        decode_into(z, memoryview(out)[: e - s], "bench")
        td += time.thread_time() - t0
        stored += len(z)
    return stored, tc, td


def _plain_zstd(data: np.ndarray) -> tuple[int, float, float]:
    import zstandard

    c, d = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    stored, tc, td = 0, 0.0, 0.0
    for s in range(0, len(data), FRAME):
        f = data[s : s + FRAME]
        t0 = time.thread_time()
        z = c.compress(f)
        tc += time.thread_time() - t0
        t0 = time.thread_time()
        d.decompress(z)
        td += time.thread_time() - t0
        stored += len(z)
    return stored, tc, td


def _blosc2(ts: list[tuple[str, torch.Tensor]]) -> tuple[int, float, float] | None:
    try:
        import blosc2
    except ImportError:
        return None
    blosc2.set_nthreads(1)
    stored, tc, td = 0, 0.0, 0.0
    for _k, t in ts:
        a = t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() and t.dim() else None
        if a is None:
            continue
        w = min(8, t.element_size())
        for s in range(0, len(a), FRAME):
            f = a[s : s + FRAME]
            t0 = time.thread_time()
            z = blosc2.compress2(
                f,
                typesize=w,
                clevel=1,
                codec=blosc2.Codec.ZSTD,
                filters=[blosc2.Filter.SHUFFLE],
                splitmode=blosc2.SplitMode.ALWAYS_SPLIT,
            )
            tc += time.thread_time() - t0
            t0 = time.thread_time()
            blosc2.decompress2(z)
            td += time.thread_time() - t0
            stored += len(z)
    return stored, tc, td


def _zipnn(ts: list[tuple[str, torch.Tensor]]) -> tuple[int, float, float] | None:
    """ZipNN's Huffman codec (its own threads: CPU time of the whole process)."""
    try:
        from zipnn import ZipNN
    except ImportError:
        return None
    dtypes = {t.dtype for _k, t in ts}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.bfloat16, torch.float32):
        return None
    z = ZipNN(
        method="HUFFMAN", input_format="byte", bytearray_dtype=str(next(iter(dtypes))).removeprefix("torch."), threads=1
    )
    stored, tc, td = 0, 0.0, 0.0
    for _k, t in ts:
        a = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() and t.dim() else b""
        for s in range(0, len(a), FRAME):
            f = a[s : s + FRAME]
            t0 = time.process_time()
            c = z.compress(f)
            tc += time.process_time() - t0
            t0 = time.process_time()
            z.decompress(c)
            td += time.process_time() - t0
            stored += len(c)
    return stored, tc, td


def _categories(state: dict) -> dict[str, list[tuple[str, torch.Tensor]]]:
    out: dict[str, list] = {}
    for k, t in tensors(state):
        top = k.split(".")[0]
        sub = k.split(".")[1] if top == "optim" else ""
        cat = {"model": "weights", "master": "fp32 master"}.get(
            top, sub if sub in ("exp_avg", "exp_avg_sq") else "other"
        )
        cat = f"{cat} ({str(t.dtype).removeprefix('torch.')})"
        out.setdefault(cat, []).append((k, t))
    out["whole state"] = tensors(state)
    return out


def _best(fn, repeats: int) -> tuple[int, float, float] | None:
    """``fn()`` once to warm up (codec objects, scratch buffers: a codec thread of the hop is
    warm after its first frame), then the least CPU time of ``repeats`` runs, compress and
    decompress each (the least is the run least disturbed by the other jobs on these cores)."""
    if fn() is None:
        return None
    runs = [fn() for _ in range(repeats)]
    return runs[0][0], min(r[1] for r in runs), min(r[2] for r in runs)


def _ratios(name: str, state: dict, repeats: int = 3) -> list[dict]:
    rows = []
    for cat, ts in _categories(state).items():
        data, runs = _layout(ts)
        n = len(data)
        if n < 4096:
            continue
        for method, fn in (
            ("tierckpt planes+zstd literal-only", lambda d=data, r=runs: _ours(d, r)),
            ("zstd-1, no planes", lambda d=data: _plain_zstd(d)),
            ("blosc2 shuffle+zstd-1", lambda t=ts: _blosc2(t)),
            ("ZipNN Huffman", lambda t=ts: _zipnn(t)),
        ):
            res = _best(fn, repeats)
            if res is None:
                continue
            stored, tc, td = res
            rows.append(
                row(
                    f"{name}: {cat}: {method}",
                    [tc],
                    n,
                    ratio=n / max(1, stored),
                    note=f"{n / MB:.1f} MB, compress {n / tc / 1e9:.2f} GB/s, decompress {n / td / 1e9:.2f} GB/s "
                    "per core",
                    state=name,
                    category=cat,
                    method=method,
                    bytes=n,
                    stored=stored,
                    compress_gbs=n / tc / 1e9,
                    decompress_gbs=n / td / 1e9,
                )
            )
    return rows


def _dcp_zstd(state: dict, work: Path, repeats: int) -> dict:
    """DCP's ZStandard extension: ``dcp.save`` (one thread) with and without it, after a warm-up,
    alternated ``repeats`` times (CPU seconds of the process); and its codec alone, the way the
    extension runs it per item (``torch.save`` into a zstd stream writer at its default level),
    on one thread, for a like-for-like codec speed."""
    import io

    import zstandard
    from torch.distributed.checkpoint._extension import ZStandard

    out: dict[str, Any] = {"plain": {"cpu_s": []}, "zstd": {"cpu_s": []}}
    for rep in range(repeats + 1):
        for mode in ("plain", "zstd"):
            d = work / f"dcp-{mode}-{rep}"
            kw = {"_extensions": [ZStandard()]} if mode == "zstd" else {}
            c0 = time.process_time()
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d), thread_count=1, **kw))
            if rep:  # the first round warms up
                out[mode]["cpu_s"].append(time.process_time() - c0)
            out[mode]["bytes"] = sum(p.stat().st_size for p in d.glob("*.distcp"))
    logical = out["plain"]["bytes"]
    extra = max(1e-9, med(out["zstd"]["cpu_s"]) - med(out["plain"]["cpu_s"]))
    out["ratio"] = logical / max(1, out["zstd"]["bytes"])
    out["save_gbs"] = logical / extra / 1e9
    stream_cpu = 0.0
    for _k, t in tensors(state):
        buf = io.BytesIO()
        raw = io.BytesIO()
        torch.save(t, raw)
        t0 = time.thread_time()
        w = zstandard.ZstdCompressor().stream_writer(buf, closefd=False)
        w.write(raw.getbuffer())
        w.flush(zstandard.FLUSH_FRAME)
        stream_cpu += time.thread_time() - t0
    out["codec_gbs"] = logical / stream_cpu / 1e9
    return out


def _s3_cfg(work: Path, endpoint: str, bucket: str, tag: str, **s3: Any):
    from tierckpt.config import config_from_dict

    return config_from_dict(
        {
            "host": {"buffer_size": "256MiB", "chunk_size": "32MiB"},
            "local": {"path": str(work / f"local-{tag}"), "keep": 2, "fsync": False},
            "s3": {
                "bucket": bucket,
                "prefix": tag,
                "endpoint_url": endpoint,
                "part_size": "16MiB",
                "concurrency": 4,
                "keep": 2,
                **s3,
            },
        }
    )


def _promote(cfg, state: dict, cid: str) -> Any:
    from tierckpt import TieredWriter

    w = TieredWriter(cfg)
    try:
        dcp.save(state, checkpoint_id=cid, storage_writer=w, no_dist=True)
        w.wait()
        return w.history[-1]
    finally:
        w.close()


def _throttled(ctx, cache: Path, rate_mbs: float) -> list[dict]:
    from benchlib.s3clients import start_s3_server
    from benchlib.throttle import spawn
    from tools.s3servers import make_bucket

    base = gpt_state(cache)
    state = {f"copy{i}": {k: v.clone() for k, v in tensors(base)} for i in range(1 if ctx.quick else 4)}
    for i, sd in enumerate(state.values()):  # four different states: no frame repeats another
        for v in sd.values():
            if v.is_floating_point() and v.numel() > 1:
                v.view(-1)[i::97] = v.view(-1)[i::97] * 1.0001
    url, stop, note = start_s3_server("seaweedfs", ctx.work / f"weed-throttle-{rate_mbs:.0f}")
    port = int(url.rsplit(":", 1)[1])
    th_port, th_stop = spawn(port, rate_mbs * MB)
    rows = []
    try:
        make_bucket(url, "compress")
        ep = f"http://127.0.0.1:{th_port}"
        times: dict[str, list[float]] = {"none": [], "zstd": []}
        stats: dict[str, Any] = {}
        for rep in range(1 if ctx.quick else ctx.repeats):
            for mode in ("none", "zstd"):
                cfg = _s3_cfg(ctx.work, ep, "compress", f"thr-{mode}", compression=mode)
                st = _promote(cfg, state, f"step-{rep}")
                times[mode].append(st.promote_s)
                stats[mode] = st
                log(f"compress: throttled promotion {mode}: {st.promote_s:.2f} s")
        logical = stats["zstd"].bytes
        ratio = logical / max(1, stats["zstd"].stored_bytes or logical)
        speedup = med(times["none"]) / med(times["zstd"])
        rows.append(row(f"promotion at {rate_mbs:.0f} MB/s, compression none", times["none"], logical))
        rows.append(
            row(
                f"promotion at {rate_mbs:.0f} MB/s, compression zstd",
                times["zstd"],
                logical,
                ratio=speedup,
                note=f"ratio {ratio:.3f}; speedup {speedup:.3f}x = {speedup / ratio:.2f} of the ratio "
                f"(target >= 0.9); compress {stats['zstd'].compress_cpu_s:.2f} CPU-s",
                compression_ratio=ratio,
                speedup=speedup,
                compress_cpu_s=stats["zstd"].compress_cpu_s,
                server=note,
            )
        )
    finally:
        th_stop()
        stop()
    return rows


def _frozen(ctx, cache: Path) -> list[dict]:
    from benchlib.s3clients import start_s3_server
    from tools.s3servers import make_bucket

    states = frozen_states(cache)
    url, stop, _note = start_s3_server("seaweedfs", ctx.work / "weed-frozen")
    rows = []
    try:
        make_bucket(url, "frozen")
        cfg = _s3_cfg(ctx.work, url, "frozen", "frozen", compression="zstd", copy_unchanged=True)
        prev = None
        for i, sd in enumerate(states):
            st = _promote(cfg, sd, f"ft-{i + 1}")
            logical = st.bytes
            changed = None
            if prev is not None:
                changed = sum(
                    t.numel() * t.element_size()
                    for (k, t), (_k, p) in zip(tensors(sd), tensors(prev))
                    if not torch.equal(t, p)
                )
            prev = sd
            rows.append(
                row(
                    f"frozen-90% fine-tune, checkpoint {i + 1}",
                    [st.promote_s],
                    logical,
                    ratio=st.uploaded_bytes / logical,
                    note=f"uploaded {st.uploaded_bytes / MB:.2f} MB ({100 * st.uploaded_bytes / logical:.1f}% of "
                    f"{logical / MB:.1f} MB), server-side copies {st.copied_bytes / MB:.2f} MB"
                    + (f", changed tensors {100 * changed / logical:.1f}% of the state" if changed is not None else ""),
                    uploaded=st.uploaded_bytes,
                    copied=st.copied_bytes,
                    stored=st.stored_bytes,
                    changed=changed,
                )
            )
    finally:
        stop()
    return rows + _frozen_floor(states[-2], states[-1])


def _frozen_floor(prev: dict, cur: dict) -> list[dict]:
    """What a checkpoint of the frozen fine-tune must upload at the least, without S3: the
    tensors that changed since ``prev``, coded on their own (no frame holds an unchanged byte),
    and the coded bytes of the frames that differ for frame sizes from 4 MiB down to 64 KiB
    (the granularity loss: a frame with one changed byte is uploaded whole)."""
    a, _ = _layout(tensors(prev))
    b, runs = _layout(tensors(cur))
    n = len(b)
    changed = [(k, t) for (k, t), (_k, p) in zip(tensors(cur), tensors(prev)) if not torch.equal(t, p)]
    cdata, cruns = _layout(changed)
    floor = _ours(cdata, cruns)[0]
    raw = sum(t.numel() * t.element_size() for _k, t in changed)
    rows = [
        row(
            "frozen-90%: floor (the changed tensors, coded)",
            None,
            n,
            ratio=floor / n,
            note=f"{raw / MB:.2f} MB changed ({100 * raw / n:.1f}% of {n / MB:.1f} MB), coded {floor / MB:.2f} MB "
            f"({100 * floor / n:.1f}%; ratio {raw / max(1, floor):.3f})",
            floor=floor,
            changed=raw,
        )
    ]
    diff = a != b
    for f in (FRAME, 1 << 20, 256 << 10, 64 << 10):
        up = sum(
            len(encode(b[s : s + f], segments_of(s, min(n, s + f), runs)))
            for s in range(0, n, f)
            if diff[s : s + f].any()
        )
        rows.append(
            row(
                f"frozen-90%: frames of {f >> 10} KiB, coded bytes of the frames that differ",
                None,
                n,
                ratio=up / n,
                note=f"{up / MB:.2f} MB = {100 * up / n:.1f}% of the state",
                frame=f,
                uploaded=up,
            )
        )
    return rows


def section_compress(ctx) -> dict:
    cache = REPO / "bench-out" / "states"
    rows: list[dict] = []
    notes: list[str] = []
    gpt = gpt_state(cache)
    states = {"gpt": gpt, "titan": titan_state(cache), "frozen": frozen_states(cache)[-1]}
    for name, st in states.items():
        if st is None:
            notes.append(f"{name}: torchtitan is not installed; skipped")
            continue
        log(f"compress: ratios on {name}")
        rows += _ratios(name, st, 1 if ctx.quick else 3)
    log("compress: DCP ZStandard")
    d = _dcp_zstd(gpt, ctx.work, 1 if ctx.quick else 3)
    ours = next(
        r for r in rows if r["state"] == "gpt" and r["category"] == "whole state" and r["method"].startswith("tierckpt")
    )
    rows.append(
        row(
            "gpt: whole state: DCP FileSystemWriter + ZStandard",
            d["zstd"]["cpu_s"],
            d["plain"]["bytes"],
            ratio=d["ratio"],
            note=f"its codec {d['codec_gbs']:.3f} GB/s per core (CPU added to dcp.save: "
            f"{d['save_gbs']:.3f} GB/s); ours: ratio {ours['ratio']:.3f}, "
            f"{ours['compress_gbs']:.2f} GB/s = {ours['compress_gbs'] / d['codec_gbs']:.1f}x "
            "its codec's speed",
            dcp=d,
        )
    )
    for rate in (float(x) for x in str(ctx.args.throttle_mbs).split(",") if x.strip()):
        log(f"compress: promotion throttled to {rate:.0f} MB/s")
        rows += _throttled(ctx, cache, rate)
    log("compress: frozen fine-tune")
    rows += _frozen(ctx, cache)
    notes.append(
        "speeds: bytes per CPU second of the coding thread (ZipNN: of the process, it has its own threads), "
        "after a warm-up pass, least of 3 passes"
    )
    return {"rows": rows, "notes": notes}
