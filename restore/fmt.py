"""Output helpers for the CLI: sizes, ages, aligned tables, JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from tierckpt.errors import InvalidCheckpointId
from tierckpt.format.layout import check_checkpoint_id

__all__ = [
    "EXAMPLES_HEAD",
    "add_json",
    "add_tier",
    "checkpoint_ref",
    "cli_id",
    "human_age",
    "human_size",
    "print_json",
    "table",
]

EXAMPLES_HEAD = "examples:\n"


def human_size(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"  # pragma: no cover


def human_age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def cli_id(value: str) -> str:
    """An id as typed or pasted (``$(tierckpt-restore latest)`` keeps no newline, but a value read
    from a file often ends with one): ``value`` without one trailing newline. Nothing else is
    stripped; the result is validated by :func:`check_checkpoint_id`."""
    return value[:-1] if value.endswith("\n") else value


def checkpoint_ref(value: str) -> str:
    """argparse type: ``latest`` or a valid checkpoint id (one trailing newline stripped first);
    anything else is refused with the id rules (exit status 2) before any tier is contacted."""
    value = cli_id(value)
    if value == "latest":
        return value
    try:
        return check_checkpoint_id(value)
    except InvalidCheckpointId as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON for scripts instead of text")


def add_tier(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tier", choices=("local", "s3"), help="only this tier (default: every configured tier)")
