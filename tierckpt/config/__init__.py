"""Stage ``config``: the job's configuration -- one dataclass per section, values, validation, redaction.

What it does: reads TOML (or takes dataclasses built in Python), validates every key with a message
naming it (:mod:`.sections`), parses values such as sizes, endpoints and node names
(:mod:`.values`), and keeps secrets out of messages and logs (:mod:`.redact`).

May import: :mod:`tierckpt.errors` and the standard library only (the lowest stage above the base).
May be imported by: every other stage, ``restore/``, ``tools/`` and tests.

``tierckpt.config`` is also the public path of the configuration (``from tierckpt.config import
Config``): every name of the former ``tierckpt/config.py`` module is served from here unchanged.
"""

from __future__ import annotations

from typing import Any

from . import sections
from .sections import (
    CONFIG_ENV,
    Config,
    ExportConfig,
    HostConfig,
    JobConfig,
    LocalConfig,
    PeerConfig,
    S3Config,
    TierConfig,
    check_endpoint_url,
    load_config,
    node_name,
    parse_size,
    register_section,
)
from .values import MAX_SIZE, MAX_TIMEOUT_S, GiB, KiB, MiB

__all__ = [
    "CONFIG_ENV",
    "Config",
    "ExportConfig",
    "HostConfig",
    "JobConfig",
    "LocalConfig",
    "PeerConfig",
    "S3Config",
    "TierConfig",
    "check_endpoint_url",
    "load_config",
    "node_name",
    "parse_size",
    "register_section",
    "GiB",
    "KiB",
    "MAX_SIZE",
    "MAX_TIMEOUT_S",
    "MiB",
]


def __getattr__(name: str) -> Any:
    """The rest of the former ``tierckpt.config`` module's names (constants such as ``S3_MAX_PART``)."""
    try:
        return getattr(sections, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
