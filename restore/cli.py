"""``tierckpt-restore``: list, verify, fetch, consolidate and clean up tierckpt checkpoints.

Thin by design: each subcommand lives in its own ``cmd_*.py`` module that parses its options,
calls the library (:mod:`restore`), and prints (tables for people, ``--json`` for scripts).
Errors are turned into one line on stderr and an exit status in one place (:mod:`restore.errors`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from tierckpt.config.redact import redact

from . import (
    cmd_advise,
    cmd_consolidate,
    cmd_delete,
    cmd_export,
    cmd_fetch,
    cmd_gc,
    cmd_latest,
    cmd_list,
    cmd_mark,
    cmd_push,
    cmd_timeline,
    cmd_verify,
)
from .errors import EXIT_OK, EXIT_USAGE, PROG, report

__all__ = ["COMMANDS", "build_parser", "main"]

COMMANDS = (
    cmd_list,
    cmd_latest,
    cmd_verify,
    cmd_fetch,
    cmd_consolidate,
    cmd_export,
    cmd_gc,
    cmd_push,
    cmd_delete,
    cmd_timeline,
    cmd_advise,
    cmd_mark,
)

EPILOG = """examples:
  export TIERCKPT_CONFIG=tiers.toml
  tierckpt-restore list
  tierckpt-restore latest
  tierckpt-restore verify latest
  tierckpt-restore fetch latest --rank 0
  tierckpt-restore consolidate latest --out model.safetensors --keys model.
  tierckpt-restore export latest --format hf --out hf-model --keys model. --strip-prefix model.
  tierckpt-restore gc --dry-run
  tierckpt-restore push
  tierckpt-restore delete --all --yes
  tierckpt-restore timeline --last 5 --out timeline.png
  tierckpt-restore advise --mtbf 8h

exit status: 0 ok, 1 not found or verification failed, 2 usage, configuration or credentials
error (access denied), 3 other error (storage, network), 130 interrupted.
TIERCKPT_DEBUG=1 prints tracebacks.
"""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        print(f"{PROG}: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _common() -> argparse.ArgumentParser:
    """Options accepted before or after the subcommand."""
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument(
        "--config",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="tier configuration (TOML); default: $TIERCKPT_CONFIG",
    )
    c.add_argument(
        "-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bars, only errors on stderr"
    )
    c.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log what is done")
    return c


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    p = _Parser(
        prog=PROG,
        parents=[common],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect, verify, fetch, consolidate and clean up tierckpt checkpoints "
        "(local tier and S3 tier of one configuration); draw their timeline and advise "
        "how often to checkpoint.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for mod in COMMANDS:
        mod.register(sub, [common])
    return p


class _Formatter(logging.Formatter):
    """``tierckpt-restore: level: message``, redacted (no URL user information or query string)."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{PROG}: {record.levelname.lower()}: {redact(record.getMessage())}"


class _Handler(logging.StreamHandler):
    """Writes each message on a line of its own above the progress bars (``tqdm.write``: the
    bars are cleared and drawn again below it), never into the middle of a bar."""

    def emit(self, record: logging.LogRecord) -> None:
        bars = sys.modules.get("tqdm")  # imported by the commands that draw bars, only
        if bars is None:
            super().emit(record)
            return
        try:
            bars.tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)


def _setup_logging(verbose: bool, quiet: bool) -> None:
    handler = _Handler(sys.stderr)
    handler.setFormatter(_Formatter())
    root = logging.getLogger("tierckpt")
    root.handlers[:] = [handler]
    root.propagate = False
    root.setLevel(logging.INFO if verbose else logging.ERROR if quiet else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit status (the console script exits with it)."""
    args = build_parser().parse_args(argv)
    for name, default in (("config", None), ("quiet", False), ("verbose", False)):
        if not hasattr(args, name):
            setattr(args, name, default)
    if args.config is None:
        args.config = os.environ.get("TIERCKPT_CONFIG") or None
    _setup_logging(args.verbose, args.quiet)
    try:
        return int(args.func(args) or EXIT_OK)
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): not an error worth a message.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the one place errors become messages
        return report(e, hint=getattr(args, "interrupt_hint", ""))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
