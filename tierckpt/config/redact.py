"""Redaction of secrets in URLs and free text, before they reach a message or a log line.

Contract:

* :func:`redact_url` returns a URL with its user information (``user:password@``) replaced by
  ``***@`` and its query string and fragment replaced by ``?***`` / ``#***`` (presigned URLs carry
  their signature and credential there). Scheme, host, port and path are kept, so the message
  still says where the request went. It never raises, whatever the input.
* :func:`redact` applies :func:`redact_url` to every URL (``scheme://...``) found in a text, and
  masks the value of ``key=value`` / ``key: value`` pairs whose key names a secret (password,
  secret, token, signature, credential, ...). It never raises and never makes a text longer
  than ``len(text) + 8 * number of masked items``.

Used by the S3 tier, the configuration checks and the restore CLI on every text that may hold
an endpoint URL or a server's or library's message (botocore's ``EndpointConnectionError``
prints the full request URL, user information included). Redaction is a second line of
defence: ``[s3] endpoint_url`` with user information is refused by the configuration checks.
"""

from __future__ import annotations

import re

__all__ = ["MASK", "redact", "redact_url"]

MASK = "***"

# scheme://authority[/path][?query][#fragment]; a URL ends at whitespace, quotes or angle brackets.
_URL_RE = re.compile(r"(?i)\b[a-z][a-z0-9+.\-]{0,31}://[^\s\"'<>`]*")
_SPLIT_RE = re.compile(r"(?is)^([a-z][a-z0-9+.\-]*://)?([^/]*)(.*)$")
# A key naming a secret: password, secret, token, signature, credential, api key, access key.
_SECRET_KEY = r"[\w.\-]*(?:password|passwd|secret|token|signature|credential|api[_-]?key|access[_-]?key)[\w.\-]*"
# key=value (query strings, environment, keyword arguments) and 'key': 'value' (reprs, JSON).
_SECRET_KV_RE = re.compile(
    rf"(?i)(\b{_SECRET_KEY}\s*=\s*['\"]?|['\"]{_SECRET_KEY}['\"]\s*:\s*['\"]?)([^\s&'\",;)}}\]]+)"
)


def redact_url(url: str) -> str:
    """``url`` without user information, query string and fragment (see the module docstring)."""
    try:
        text = str(url)
        cuts = [i for i in (text.find("?"), text.find("#")) if i != -1]
        cut = min(cuts) if cuts else len(text)
        base, tail = text[:cut], text[cut:]
        m = _SPLIT_RE.match(base)
        if m is None:  # pragma: no cover - the pattern matches every string
            return MASK
        prefix, authority, path = m.group(1) or "", m.group(2), m.group(3)
        rest = authority + path
        at = rest.find("@")
        if at != -1 and ":" in rest[:at]:
            # user:password@ (a raw '/' in the password would end the authority early).
            authority, path = f"{MASK}@", rest[at + 1 :]
        elif "@" in authority:
            authority = f"{MASK}@{authority.rsplit('@', 1)[1]}"
        suffix = (f"?{MASK}" if tail.startswith("?") else "") + (f"#{MASK}" if "#" in tail else "")
        return f"{prefix}{authority}{path}{suffix}"
    except Exception:  # noqa: BLE001 - redaction must never raise
        return MASK


def redact(text: object) -> str:
    """``str(text)`` with every URL passed through :func:`redact_url` and secret values masked."""
    try:
        s = str(text)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the error being reported
        return f"<unprintable {type(text).__name__}>"
    try:
        s = _URL_RE.sub(lambda m: redact_url(m.group(0)), s)
        return _SECRET_KV_RE.sub(lambda m: f"{m.group(1)}{MASK}", s)
    except Exception:  # noqa: BLE001 - pragma: no cover - regex substitution on a str
        return MASK
