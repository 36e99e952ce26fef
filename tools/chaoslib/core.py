"""What every chaos case shares: :class:`CaseResult` and its table, error classification, random
states and their comparison, tier configurations."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tierckpt import CheckpointNotFound, TierckptError, TieredReader
from tierckpt.config import TierConfig
from tierckpt.testing import bits, errors_in, find_error, raw
from tierckpt.testing import placeholder as _placeholder

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20
BUCKET = "tierckpt-chaos"

log = logging.getLogger("chaos")


# -- results ----------------------------------------------------------------------------------


@dataclass
class CaseResult:
    """What one case found. ``lost`` problems are counted in ``failures`` too."""

    case: str
    trials: int = 0
    failures: int = 0
    lost: int = 0
    seconds: float = 0.0
    notes: dict[str, int] = field(default_factory=dict)  # tallies shown in the table
    problems: list[str] = field(default_factory=list)  # one line per failure
    skipped: str = ""

    def note(self, what: str, n: int = 1) -> None:
        self.notes[what] = self.notes.get(what, 0) + n

    known: dict[str, int] = field(default_factory=dict)  # failures explained by a KNOWN_BUGS entry

    def fail(self, trial: Any, msg: str, known: str = "") -> None:
        self.failures += 1
        tag = ""
        if known:
            self.known[known] = self.known.get(known, 0) + 1
            tag = f" [known bug: {known}]"
        self.problems.append(f"[{self.case} {trial}] {msg}{tag}")

    def lose(self, trial: Any, msg: str, known: str = "") -> None:
        self.lost += 1
        self.fail(trial, "LOST: " + msg, known)

    @property
    def ok(self) -> bool:
        return self.failures == 0 and self.lost == 0

    @property
    def unexplained(self) -> int:
        """Failures not explained by a known bug (what a CI test asserts to be 0)."""
        return self.failures - sum(self.known.values())

    def notes_text(self, limit: int = 8) -> str:
        if self.skipped:
            return f"skipped: {self.skipped}"
        items = [(f"KNOWN BUG {k}", v) for k, v in self.known.items()] + sorted(
            self.notes.items(), key=lambda kv: -kv[1]
        )
        text = ", ".join(f"{k} {v}" for k, v in items[: limit + len(self.known)])
        if len(items) > limit + len(self.known):
            text += f", +{len(items) - limit} more"
        return text

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"ok": self.ok}


def format_table(results: list[CaseResult]) -> str:
    rows = [("case", "trials", "failures", "lost", "seconds", "notes")]
    for r in results:
        rows.append((r.case, str(r.trials), str(r.failures), str(r.lost), f"{r.seconds:.1f}", r.notes_text()))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for j, row in enumerate(rows):
        lines.append(
            " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row[:5], widths)))
            + " | "
            + row[5]
        )
        if j == 0:
            lines.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * 20)
    return "\n".join(lines)


# Bugs found by this harness (library or trainer code this harness may not change). Failures they
# explain are still failures (the exit status says so); tests/test_chaos.py reproduces each one
# deterministically as a strict xfail and tolerates only these in its random trials.
KNOWN_BUGS: dict[str, str] = {}  # failures explained by an open library bug (none open now)


# -- error helpers ------------------------------------------------------------------------------


# DCP 2.13 turns a failed read_metadata into an AssertionError carrying only the message text.
_TIERCKPT_TEXT = re.compile(
    r"is not committed on any tier|no committed checkpoint|CRC32C|no tier holds valid metadata|"
    r"already committed|already exists|not valid tierckpt metadata|cannot read item"
)


def is_clear(exc: BaseException) -> bool:
    """A tierckpt error (possibly wrapped by DCP, possibly only as text) rather than a random crash."""
    if find_error(exc, TierckptError) is not None:
        return True
    return any(_TIERCKPT_TEXT.search(str(e)) for e in errors_in(exc))


def is_not_found(exc: BaseException) -> bool:
    if find_error(exc, CheckpointNotFound) is not None:
        return True
    return any("is not committed on any tier" in str(e) or "no committed checkpoint" in str(e) for e in errors_in(exc))


def short(exc: BaseException, n: int = 300) -> str:
    """The most telling error in ``exc``: a tierckpt error, else the first one DCP wrapped."""
    every = errors_in(exc)
    inner = (
        [e for e in every if isinstance(e, TierckptError)] or [e for e in every if not hasattr(e, "failures")] or [exc]
    )
    e = inner[0]
    return f"{type(e).__name__}: {e}".replace("\n", " | ")[:n]


# -- states -------------------------------------------------------------------------------------


def make_state(seed: int, big: int = 1 * MiB) -> dict:
    """Random bits (NaN payloads, -0, subnormals) in several dtypes plus a non-tensor item."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "big": bits((big // 4,), torch.float32, g),
            "bf16": bits((129, 17), torch.bfloat16, g),
            "i64": bits((33,), torch.int64, g),
            "scalar": torch.tensor(float(seed) + 0.5),
        },
        "meta": {"seed": seed, "name": f"state-{seed}"},
    }


def placeholder(x: Any) -> Any:
    """Same structure, tensors filled with 0x5A bytes (a load that skips a tensor is caught)."""
    return _placeholder(x, 0x5A)


def mutate(state: dict, g: torch.Generator) -> None:
    """A 'training step': change every tensor in place."""
    for _k, v in state["model"].items():
        r = raw(v)
        r.add_(torch.randint(1, 255, r.shape, dtype=torch.uint8, generator=g))
    state["meta"]["seed"] += 1000


def load_state(cfg: TierConfig, expected: dict, cid: str) -> tuple[dict, TieredReader]:
    target = placeholder(expected)
    reader = TieredReader(cfg)
    dcp.load(target, checkpoint_id=cid, storage_reader=reader, no_dist=True)
    return target, reader


# -- configurations -----------------------------------------------------------------------------


def toml_text(d: dict) -> str:
    out = []
    for sec, kv in d.items():
        out.append(f"[{sec}]")
        for k, v in kv.items():
            if isinstance(v, bool):
                out.append(f"{k} = {'true' if v else 'false'}")
            elif isinstance(v, (int, float)):
                out.append(f"{k} = {v}")
            else:
                out.append(f"{k} = {json.dumps(str(v))}")
        out.append("")
    return "\n".join(out)


def only(cfg: TierConfig, tier: str) -> TierConfig | None:
    """``cfg`` restricted to one tier (``local`` or ``s3``), or None if it has no such tier."""
    if tier == "local":
        return None if cfg.local is None else dataclasses.replace(cfg, s3=None)
    if cfg.s3 is None:
        return None
    # the hop's codec keys apply to the copy from [local] only (refused without it); loads need none
    return dataclasses.replace(
        cfg, local=None, s3=dataclasses.replace(cfg.s3, compression="none", copy_unchanged=False)
    )
