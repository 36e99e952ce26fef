#!/usr/bin/env python
"""Draw the benchmark plots of ``docs/benchmarks.md`` from ``tools/bench.py``'s JSON outputs.

    python tools/plot_bench.py docs/data/bench-lazy-e2e.json docs/data/bench-s3.json [--out docs/img]

Reads any number of JSON files written by ``tools/bench.py --out`` and draws, from whichever
sections they hold:

* ``stall.png`` (section ``lazy``): the time the training thread is blocked per checkpoint against
  the state size, for sync ``FileSystemWriter``, ``dcp.async_save``, tierckpt and DCP's own planning
  with a no-op writer (the floor). Sizes come from ``--lazy-mib 64,128,...`` (the section's
  ``series``) or from several single-size runs.
* ``e2e_interval.png`` (section ``e2e``): the wall time of training with checkpoints against the
  checkpoint interval (``--e2e-every 1,2,4``), relative to the same training without any.
* ``s3_throughput.png`` (section ``s3``): GiB/s of every client the section measured (raw boto3
  uploads and ranged GETs, tierckpt's promotion, save-until-promoted and S3 load, s3torchconnector
  and awscrt where they were installed) against the state size, one panel per server.

Every plot is titled with the command that produced its data (from the JSON), so a figure is never
separated from how it was measured. Needs matplotlib (``pip install -e ".[plot]"``); uses the Agg
backend, no display.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30

MODES = (
    ("sync FileSystemWriter", "sync FileSystemWriter", "o-"),
    ("async_save", "dcp.async_save", "s-"),
    ("tiered", "tierckpt (TieredWriter)", "^-"),
)


def _load(paths: list[Path]) -> list[dict]:
    docs = []
    for p in paths:
        doc = json.loads(p.read_text())
        doc["_path"] = str(p)
        docs.append(doc)
    return docs


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _caption(docs: list[dict]) -> str:
    cmds = sorted({d.get("command", "?") for d in docs})
    dates = sorted({str(d.get("machine", {}).get("date_utc", "?"))[:10] for d in docs})
    return "\n".join(cmds) + f"\n({', '.join(dates)})"


def stall_points(docs: list[dict]) -> tuple[list[float], dict[str, list[float]], list[float], list[dict]]:
    """(state MiB, {mode: blocked ms}, floor ms, source docs), sorted by size, from every lazy section."""
    pts: list[tuple[float, dict[str, float], float]] = []
    used = []
    for d in docs:
        sec = d.get("sections", {}).get("lazy")
        if not sec:
            continue
        used.append(d)
        series = sec.get("series") or [
            {
                "state_bytes": sec["state_bytes"],
                "null_writer_s": _median(sec["null_writer_s"]),
                "blocked_s": {m: _median(sec["modes"][m]["blocked_s"]) for m, _, _ in MODES},
            }
        ]
        for s in series:
            pts.append(
                (s["state_bytes"] / MiB, {m: s["blocked_s"][m] * 1e3 for m, _, _ in MODES}, s["null_writer_s"] * 1e3)
            )
    pts.sort(key=lambda p: p[0])
    return [p[0] for p in pts], {m: [p[1][m] for p in pts] for m, _, _ in MODES}, [p[2] for p in pts], used


def e2e_points(docs: list[dict]) -> tuple[list[int], dict[str, list[float]], list[dict], dict]:
    """(intervals, {mode: time vs none}, source docs, first e2e section) from every e2e section."""
    by_every: dict[int, dict[str, float]] = {}
    used = []
    first: dict = {}
    for d in docs:
        sec = d.get("sections", {}).get("e2e")
        if not sec:
            continue
        used.append(d)
        first = first or sec
        by_every.update(e2e_ratios(sec))
    xs = sorted(by_every)
    return xs, {m: [by_every[x][m] for x in xs] for m, _, _ in MODES}, used, first


def e2e_ratios(sec: dict) -> dict[int, dict[str, float]]:
    """{interval: {mode: time vs no checkpoint}} of one e2e section.

    Each ratio is the median block of the mode over the median no-checkpoint block (blocks are
    interleaved, one per round): robust to one outlier block, such as the first block of a process
    that pays torch's warm-up. Sections without per-block times give the section's own ratios.
    """
    modes = sec.get("modes", {})
    none = [b["total_s"] for b in modes.get("none", {}).get("blocks", [])]
    out: dict[int, dict[str, float]] = {}
    series = sec.get("series") or [{"every": 1}]
    for s in series:
        e = int(s["every"])
        if none and e == int(series[0]["every"]) and all(modes.get(m, {}).get("blocks") for m, _, _ in MODES):
            out[e] = {m: _median([b["total_s"] for b in modes[m]["blocks"]]) / _median(none) for m, _, _ in MODES}
        elif none and s.get("total_s"):
            out[e] = {m: _median(s["total_s"][m]) / _median(none) for m, _, _ in MODES}
        elif "ratio_vs_none" in s:
            out[e] = dict(s["ratio_vs_none"])
        else:
            out[e] = {
                "tiered": sec["ratios"]["tiered/none"],
                "async_save": sec["ratios"]["async/none"],
                "sync FileSystemWriter": sec["ratios"]["sync/none"],
            }
    return out


S3_CLIENTS = (  # label in the JSON (after "<server> <size>: ") -> (legend, style, panel)
    ("raw boto3 upload, tier's client config", "raw boto3 multipart upload (same client settings)", "o--", "write"),
    ("raw boto3 upload, boto3 defaults", "raw boto3 multipart upload (boto3 defaults)", "o:", "write"),
    ("tierckpt promotion (promote_s)", "tierckpt promotion (local -> S3)", "^-", "write"),
    ("tierckpt save->promoted (dcp.save..wait)", "tierckpt dcp.save until promoted", "v-", "write"),
    ("s3torchconnector S3StorageWriter", "s3torchconnector S3StorageWriter", "x-", "write"),
    ("raw awscrt upload (send_filepath, direct_io)", "raw awscrt upload", "+--", "write"),
    ("raw boto3 ranged GETs", "raw boto3 ranged GETs", "s--", "read"),
    ("TieredReader from S3 only", "tierckpt dcp.load from S3 (CRC-checked)", "D-", "read"),
    ("s3torchconnector S3StorageReader", "s3torchconnector S3StorageReader", "x:", "read"),
    ("raw awscrt GETs", "raw awscrt GETs", "+:", "read"),
)


def s3_points(docs: list[dict]) -> tuple[dict[str, dict[str, list[tuple[float, float]]]], list[dict]]:
    """{server: {client: [(MiB, GiB/s)]}} from every s3 section's ``series``."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    used = []
    for d in docs:
        sec = d.get("sections", {}).get("s3")
        if not sec or not sec.get("series"):
            continue
        used.append(d)
        for s in sec["series"]:
            srv = out.setdefault(s["server"], {})
            for client, v in s["gib_s"].items():
                srv.setdefault(client, []).append((s["bytes"] / MiB, v))
    for srv in out.values():
        for pts in srv.values():
            pts.sort()
    return out, used


def plot_all(docs: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    out.mkdir(parents=True, exist_ok=True)

    xs, ys, floor, used = stall_points(docs)
    if xs:
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for m, label, style in MODES:
            ax.plot(xs, ys[m], style, label=label)
        ax.plot(xs, floor, "k:", label="DCP planning alone (no-op writer)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [f"{x:.0f}" for x in xs])
        ax.set_xlabel("checkpointed state (model + Adam), MiB")
        ax.set_ylabel("training blocked per checkpoint, ms (median)")
        ax.set_title("Stall per checkpoint against state size (MLP + Adam, CPU)", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.text(0.01, 0.005, _caption(used), fontsize=6, family="monospace", va="bottom")
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        written.append(out / "stall.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    ex, ey, used, first = e2e_points(docs)
    if ex:
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for m, label, style in MODES:
            ax.plot(ex, [100 * (r - 1) for r in ey[m]], style, label=label)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks(ex)
        ax.set_xlabel("checkpoint interval, training iterations")
        ax.set_ylabel("wall-time overhead vs no checkpoint, %\n(median block / median no-checkpoint block)")
        what = ""
        if first:
            what = (
                f" ({first.get('params', 0) / 1e6:.0f}M-param GPT + Adam, {first.get('state_bytes', 0) / MiB:.0f} MiB)"
            )
        ax.set_title(f"End-to-end overhead against checkpoint interval{what}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.text(0.01, 0.005, _caption(used), fontsize=6, family="monospace", va="bottom")
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        written.append(out / "e2e_interval.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    s3, used = s3_points(docs)
    if s3:
        fig, axes = plt.subplots(len(s3), 2, figsize=(12, 4.6 * len(s3)), squeeze=False)
        for row, (server, clients) in zip(axes, sorted(s3.items())):
            for ax, panel, what in ((row[0], "write", "writes (upload)"), (row[1], "read", "reads (download)")):
                for key, label, style, kind in S3_CLIENTS:
                    pts = clients.get(key)
                    if pts and kind == panel:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
                sizes = sorted({p[0] for pts in clients.values() for p in pts})
                ax.set_xscale("log", base=2)
                ax.set_xticks(sizes, [f"{s:.0f}" for s in sizes])
                ax.set_ylim(bottom=0)
                ax.set_xlabel("data file size (one rank), MiB")
                ax.set_ylabel("GiB/s (median of repeats)")
                ax.set_title(f"S3 {what} against other clients: {server}", fontsize=10)
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=7)
        fig.text(0.01, 0.005, _caption(used), fontsize=6, family="monospace", va="bottom")
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        written.append(out / "s3_throughput.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", type=Path, help="tools/bench.py --out files")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "img", help="directory for the PNGs (default docs/img)")
    args = ap.parse_args(argv)
    written = plot_all(_load(args.json), args.out)
    if not written:
        print("no lazy, e2e or s3 section with data in the given files: nothing drawn", file=sys.stderr)
        return 1
    for p in written:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
