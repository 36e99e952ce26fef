"""The timeline picture of a section's tiered saves (``tierckpt-restore timeline``'s drawing), next
to the JSON output: ``<out stem>-<section>-timeline.png``."""

from __future__ import annotations

from pathlib import Path

from benchlib.common import Ctx, log
from tierckpt.telemetry.history import group_checkpoints, read_history
from tierckpt.tiers.local import LocalTier


def write_timeline(ctx: Ctx, section: str, roots: list[Path], last: int | None = None, what: str = "") -> str:
    """Draw the phase history kept under the local tier roots ``roots`` (the newest ``last`` saves);
    returns a note for the section's table (where the picture went, or why there is none)."""
    out = Path(ctx.args.out)
    out = out.with_name(f"{out.stem}-{section}-timeline.png")
    try:
        from tierckpt.telemetry.hub import flush_history
        from tierckpt.telemetry.timeline import draw

        flush_history()  # this process's last saves (section e2e); other processes wrote theirs at close
        runs = group_checkpoints(read_history([LocalTier(r) for r in roots if r.is_dir()]))
        runs = runs[-last:] if last else runs
        if not runs:
            return f"timeline: no history under {', '.join(map(str, roots))}"
        draw(runs, out, title=f"tools/bench.py {section}: {what or 'tiered saves'} ({len(runs)} checkpoints)")
    except ImportError as e:
        return f"timeline not drawn: {e}"
    log(f"{section}: timeline of {len(runs)} checkpoints in {out}")
    return f"timeline of {len(runs)} tiered checkpoints ({what or 'saves'}): {out}"
