"""Values in a configuration: sizes with units, S3 endpoints, bucket and region names, the node name.

Pure parsing and validation, used by :mod:`tierckpt.config` (which re-exports the public names);
every problem is a :class:`~tierckpt.errors.ConfigError` naming the setting (``where``).
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError
from .redact import redact_url

__all__ = ["parse_size", "check_endpoint_url", "node_name", "KiB", "MiB", "GiB", "MAX_SIZE", "MAX_TIMEOUT_S"]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
S3_MIN_PART = 5 * MiB
S3_MAX_PART = 5 * GiB
MAX_SIZE = 1 << 62
"""Largest size any setting accepts (far above any real machine; keeps arithmetic finite)."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Largest timeout any setting accepts (a week: "forever" for a checkpoint, finite for the OS)."""
S3_MAX_ATTEMPTS = 100

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1024 * GiB,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, where: str = "size") -> int:
    """Parse ``value`` (int bytes or a string like ``"8GiB"``) into a non-negative byte count.

    ``where`` names the setting in the error message.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size (integer bytes or a string like '512MiB'), got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: size must not be negative, got {value}")
        if value > MAX_SIZE:
            raise ConfigError(f"{where}: size is too large (at most {MAX_SIZE} bytes)")
        return value
    if isinstance(value, str):
        if value.strip().startswith("-"):
            raise ConfigError(f"{where}: size must not be negative, got {value!r}")
        m = _SIZE_RE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{where}: cannot parse size {value!r} (use an integer or e.g. '512MiB', '8GiB', '64MB')")
        number = float(m.group(1)) if len(m.group(1)) <= 40 else math.inf
        size = number * _UNITS[m.group(2).lower()]
        if not size <= MAX_SIZE:
            raise ConfigError(f"{where}: size {value[:60]!r} is too large (at most {MAX_SIZE} bytes)")
        return int(size)
    raise ConfigError(f"{where}: expected a size (integer bytes or a string like '512MiB'), got {type(value).__name__}")


_HOST_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_HOSTNAME_RE = re.compile(rf"^(?:{_HOST_LABEL}\.)*{_HOST_LABEL}\.?$")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_ENDPOINT_EXAMPLE = "e.g. 'http://127.0.0.1:8333' or 'https://s3.example.com'"
_REGION_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_BUCKET_RE = re.compile(r"^[A-Za-z0-9._\-]{1,255}$")
_ARN_RE = re.compile(r"^arn:[\x21-\x7e]{1,1020}$")


def check_endpoint_url(url: str, where: str = "[s3] endpoint_url") -> str:
    """Return ``url`` if it is usable as an S3 endpoint, else raise :class:`ConfigError`.

    Empty means the provider's default endpoint (AWS). Otherwise: ``http`` or ``https``, a host
    name, IPv4 or bracketed IPv6 address, an optional port 1-65535 and an optional path; no user
    information (``user:password@`` is refused, credentials come from the AWS credential chain),
    no query string or fragment, no whitespace, control or non-ASCII characters. Messages show
    the value only through :func:`~tierckpt.redact.redact_url`, and never when it holds user
    information, so no secret reaches them.
    """
    if not url:
        return url
    if len(url) > 2048:
        raise ConfigError(f"{where}: too long ({len(url)} characters), expected a URL ({_ENDPOINT_EXAMPLE})")
    if "@" in url:
        raise ConfigError(
            f"{where}: must not contain a user name or password ('user:password@host'): S3 credentials "
            "come from the AWS credential chain (environment, profile, instance role), never from the configuration"
        )
    shown = repr(redact_url(url))
    m = _SCHEME_RE.match(url)
    if m is None:
        raise ConfigError(f"{where}: {shown} is not a URL ({_ENDPOINT_EXAMPLE})")
    if m.group(1).lower() not in ("http", "https"):
        raise ConfigError(f"{where}: the scheme must be http or https, got {m.group(1)[:20]!r} ({_ENDPOINT_EXAMPLE})")
    if any(c.isspace() or not c.isprintable() or not c.isascii() for c in url):
        raise ConfigError(f"{where}: {shown} contains spaces, control or non-ASCII characters ({_ENDPOINT_EXAMPLE})")
    if "?" in url or "#" in url:
        raise ConfigError(f"{where}: must not have a query string or fragment ('?...', '#...'), got {shown}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ConfigError(f"{where}: {shown} has an invalid host or port (the port is an integer 1-65535)") from None
    host = parts.hostname or ""
    if not host:
        raise ConfigError(f"{where}: {shown} has no host ({_ENDPOINT_EXAMPLE})")
    if parts.netloc.startswith("["):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{where}: {shown} has an invalid IPv6 address") from None
    elif len(host) > 255 or not _HOSTNAME_RE.match(host):
        raise ConfigError(f"{where}: {shown} has an invalid host name (letters, digits, '-' and '.')")
    if port == 0 or parts.netloc.endswith(":"):
        raise ConfigError(f"{where}: {shown} has an invalid port (an integer 1-65535)")
    return url


def node_name() -> str:
    """The name that fills ``{node}`` in ``[local] path``.

    First of: ``TIERCKPT_NODE``, torchrun's ``GROUP_RANK``, ``NODE_RANK``, the host name.
    """
    for var in ("TIERCKPT_NODE", "GROUP_RANK", "NODE_RANK"):
        v = os.environ.get(var)
        if v:
            return v
    return socket.gethostname()


def _brief(value: Any) -> str:
    """A short repr of a configuration value for a one-line message (URLs redacted)."""
    if isinstance(value, str):
        text = repr(redact_url(value) if "://" in value or "@" in value else value)
    elif isinstance(value, (list, dict)):
        return f"with {len(value)} element(s)"
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_PLAIN = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _nm(name: Any) -> str:
    """A section or key name for a one-line message (quoted and escaped unless plain)."""
    return name if isinstance(name, str) and _PLAIN.match(name) else repr(name)


COMPRESSIONS = ("none", "zstd")


def check_compression(compression: object, level: object, where: str) -> None:
    """Validate a tier section's ``compression`` / ``compression_level`` (messages name ``where``)."""
    if compression not in COMPRESSIONS:
        raise ConfigError(
            f"{where} compression: must be one of {', '.join(map(repr, COMPRESSIONS))}, got {_brief(compression)}"
        )
    if isinstance(level, bool) or not isinstance(level, int) or not -7 <= level <= 22:
        raise ConfigError(
            f"{where} compression_level: must be an integer between -7 and 22 (zstd), got {_brief(level)}"
        )
