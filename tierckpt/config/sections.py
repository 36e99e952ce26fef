"""The job's configuration: one dataclass per section, loaded from TOML and validated.

``load_config(path)`` reads a TOML file (``tomllib``); ``load_config()`` with no argument reads
the file named by the ``TIERCKPT_CONFIG`` environment variable. Every problem raises
:class:`~tierckpt.errors.ConfigError` with a one-line message naming the file, the section and
the key. The same validation runs when a :class:`Config` is built in Python.

The tier sections (``[local]``, ``[s3]``, and any section a tier module registers with
:func:`register_section`) describe the chain; which sections are tiers, and in which order, is
decided by the tier registry (:mod:`tierckpt.tiers`).

Sizes accept integers (bytes) or strings such as ``"512MiB"``, ``"8GiB"``, ``"64MB"``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .export import ExportConfig
from .s3section import S3Config
from .values import (  # noqa: F401 - the public names are re-exported
    _ARN_RE,
    _BUCKET_RE,
    _REGION_RE,
    MAX_SIZE,
    MAX_TIMEOUT_S,
    S3_MAX_ATTEMPTS,
    S3_MAX_PART,
    S3_MIN_PART,
    GiB,
    KiB,
    MiB,
    _brief,
    _nm,
    check_compression,
    check_endpoint_url,
    node_name,
    parse_size,
)

__all__ = [
    "HostConfig",
    "LocalConfig",
    "S3Config",
    "JobConfig",
    "PeerConfig",
    "ExportConfig",
    "Config",
    "TierConfig",
    "load_config",
    "register_section",
    "parse_size",
    "check_endpoint_url",
    "node_name",
    "CONFIG_ENV",
]

CONFIG_ENV = "TIERCKPT_CONFIG"
TELEMETRY_MODES = ("none", "otel")
MAX_HISTORY = 1024
NONFINITE_MODES = ("ignore", "warn", "refuse")
VERIFY_CAPTURE_MODES = ("off", "sample", "all")


@dataclass
class HostConfig:
    """``[host]``: the host-memory buffer pool that lazy capture copies into.

    Attributes:
        buffer_size: bytes of the pool, allocated once per process and reused by every save.
            All of it is touched when the first save starts, in every rank: where many ranks
            share a host's memory and each saves little (CPU jobs, tests), set it near the
            state's size (16 ranks x 1 GiB on a 24 GiB host spent minutes in page faults).
        chunk_size: the unit of capture and flush; a tensor larger than this is split. Clamped to
            a quarter of ``buffer_size`` so that capture and flush always overlap.
        pinned: use page-locked memory when CUDA is available (ignored on CPU-only machines).
    """

    buffer_size: int = 1 * GiB
    chunk_size: int = 32 * MiB
    pinned: bool = True

    def validate(self, where: str = "[host]") -> None:
        if self.buffer_size < 2 * MiB:
            raise ConfigError(f"{where} buffer_size: must be at least 2MiB, got {self.buffer_size}")
        if self.chunk_size < 64 * KiB:
            raise ConfigError(f"{where} chunk_size: must be at least 64KiB, got {self.chunk_size}")

    @property
    def effective_chunk_size(self) -> int:
        """The chunk size actually used: ``chunk_size`` clamped to a quarter of the pool, 4 KiB aligned."""
        c = min(self.chunk_size, self.buffer_size // 4)
        return max(4096, c - c % 4096)


@dataclass
class LocalConfig:
    """``[local]``: the local (usually node-local NVMe) tier.

    Attributes:
        path: root directory. ``{node}`` is replaced by :func:`node_name`, ``{hostname}`` by the
            host name, so that ranks of different nodes (or simulated nodes) use different roots.
        flush_threads: threads writing captured chunks to the rank's file.
        keep: committed checkpoints kept on this tier (0 keeps all).
        fsync: fsync data and metadata before commit (turn off only for throwaway tests).
        direct_io: ``"auto"`` (default): data files of 256 MiB and more are written (and large
            cold ranges read) with ``O_DIRECT`` from the page-aligned host pool, bypassing the page
            cache; smaller data files are written buffered and stay in the page cache, so that a
            resume on the node soon after reads them from memory as it would a ``torch.save``
            file (it costs a copy into the page cache: ~0.4 CPU-s/GiB against ~0.01 measured,
            in the flush threads); a file system that refuses ``O_DIRECT`` (some tmpfs, FUSE or
            network file systems) gets buffered I/O, with one log line per process. ``true``:
            ``O_DIRECT`` for every data file, required (a refusal is an error naming the file).
            ``false``: always buffered. A load of at most 256 MiB per
            rank is read through the page cache after a background prefetch (``auto`` and
            ``true``): small resumes do not pay ``O_DIRECT``'s per-read cost.
        fill_on_load: when ``dcp.load`` takes data files this rank wrote from a shared tier (S3)
            or from other nodes because this tier lacks them (a lost or replaced node), write them here as they
            arrive and commit the local copy after the load, so the next restart finds them
            local (:mod:`tierckpt.fill`; never fails a load).
    """

    path: str = ""
    flush_threads: int = 4
    keep: int = 3
    fsync: bool = True
    direct_io: bool | str = "auto"
    fill_on_load: bool = True

    def validate(self, where: str = "[local]") -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"{where} path: required, a directory path")
        if self.flush_threads < 1 or self.flush_threads > 64:
            raise ConfigError(f"{where} flush_threads: must be between 1 and 64, got {self.flush_threads}")
        if self.keep < 0:
            raise ConfigError(f"{where} keep: must not be negative, got {self.keep}")
        if self.direct_io not in (True, False, "auto"):
            raise ConfigError(f'{where} direct_io: one of "auto", true, false, got {self.direct_io!r}')

    @property
    def node_local(self) -> bool:
        """Whether each node has its own root (``{node}`` or ``{hostname}`` in ``path``)."""
        return "{node}" in self.path or "{hostname}" in self.path

    def resolved_path(self) -> Path:
        """``path`` with placeholders filled and ``~`` expanded."""
        p = self.path.replace("{node}", node_name()).replace("{hostname}", socket.gethostname())
        return Path(os.path.expanduser(p))


@dataclass
class PeerConfig:
    """``[peer]``: copies of each rank's committed data file on other nodes' local tiers.

    Attributes:
        replicas: how many other nodes keep a copy of each rank's file (0: off). Needs a node-local
            ``[local]`` path (``{node}``); partners are chosen from the node names, so a restarted
            job finds the copies again. Copies live in the partners' ``[local]`` tier and follow its
            ``keep``.
    """

    replicas: int = 0

    def validate(self, where: str = "[peer]") -> None:
        if not 0 <= self.replicas <= 8:
            raise ConfigError(f"{where} replicas: must be between 0 and 8, got {self.replicas}")


@dataclass
class JobConfig:
    """``[job]``: settings shared by the tiers.

    Attributes:
        commit_timeout: seconds the coordinator waits for every rank to report its data durable
            before it gives up on a checkpoint (it then stays uncommitted).
        log_level: level for the ``tierckpt`` logger ("" leaves its level alone: WARNING and
            above print). Where the application configured no logging, tierckpt prints on stderr
            as ``tierckpt.<module> LEVEL [rank R] message``; where it did, through its handlers.
        background_nice: niceness added to the flush, promotion and cleanup threads (Linux), so
            that they use the cycles training leaves idle; the capture thread, which training
            may wait for, keeps the process's priority. 0 turns it off.
        on_sigterm: ``"drain"`` (default): on SIGTERM (and SIGINT where the job has no handler of
            its own) the checkpoints in flight are committed to the first tier, and to the peer
            tier when that fits in ``drain_timeout``, before the previous handler or the default
            action runs (:mod:`tierckpt.preempt`). ``"ignore"``: tierckpt installs no handler.
        drain_timeout: seconds such a drain may take at most (keep it under the grace period
            between SIGTERM and SIGKILL, typically 30 s).
        telemetry: ``"none"`` (default: nothing is exported and OpenTelemetry is never imported)
            or ``"otel"``: a span per checkpoint phase and metrics through the OpenTelemetry
            providers the application configured (``pip install "tierckpt[otel]"``; see
            docs/telemetry.md and :mod:`tierckpt.telemetry.otel`).
        async_future: what a finished future of ``dcp.async_save`` with the thread executor and
            this writer as stager means: ``"accepted"`` (default: DCP planned the save, its
            capture is enqueued; training never waits longer), ``"captured"`` (the state is in
            host memory), ``"committed_local"`` (committed on the first tier, so
            ``tierckpt.list_checkpoints`` lists it). The stronger ones start the capture at once
            and keep DCP's save thread until then (see docs/usage.md). Process mode: always
            committed on every tier.
        history: checkpoints whose per-rank phases each process keeps in ``_history/`` on a
            local first tier, for ``tierckpt-restore timeline`` and ``advise``
            (:mod:`tierckpt.telemetry.history`); 0 keeps none.
        nonfinite: what a save does with NaN/Inf in a floating tensor (counted per item during
            the capture and recorded in the checkpoint's metadata: :mod:`tierckpt.capture.verify`):
            ``"ignore"`` (default: no scan), ``"warn"`` (scan, log a warning naming the items, commit),
            ``"refuse"`` (scan; such a checkpoint is never committed and the next ``dcp.save`` or
            ``wait_captured()`` raises :class:`~tierckpt.errors.NonFiniteError`).
        verify_capture: ``"off"`` (default), ``"sample"`` or ``"all"``: a digest of each source
            tensor computed with torch ops on its device is compared with the same digest of the
            host copy before its CRC32C is taken; a mismatch fails the checkpoint
            (:class:`~tierckpt.errors.CaptureMismatch`, never committed). ``"sample"`` checks a
            rotating eighth of the items each save (every item once in eight saves).
        on_resume_check: ``"module:function"`` called by :func:`tierckpt.resume` with the loaded
            state on rank 0 before training goes on; raising marks the checkpoint bad and the
            resume falls back to the previous healthy one ("" : no hook).
        max_rollbacks: how many checkpoints a resume may mark bad and fall back past before it
            gives up (:func:`tierckpt.resume`).
    """

    commit_timeout: float = 600.0
    log_level: str = ""
    background_nice: int = 10
    on_sigterm: str = "drain"
    drain_timeout: float = 20.0
    telemetry: str = "none"
    history: int = 64
    async_future: str = "accepted"
    nonfinite: str = "ignore"
    verify_capture: str = "off"
    on_resume_check: str = ""
    max_rollbacks: int = 3

    def validate(self, where: str = "[job]") -> None:
        if not 0 < self.commit_timeout <= MAX_TIMEOUT_S:
            raise ConfigError(
                f"{where} commit_timeout: must be positive and at most {MAX_TIMEOUT_S:.0f} seconds, got {self.commit_timeout}"
            )
        if not 0 <= self.background_nice <= 19:
            raise ConfigError(f"{where} background_nice: must be between 0 and 19, got {self.background_nice}")
        if self.async_future not in ("accepted", "captured", "committed_local"):
            raise ConfigError(
                f'{where} async_future: one of "accepted", "captured", "committed_local", got {self.async_future!r}'
            )
        if self.log_level and self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"{where} log_level: one of DEBUG, INFO, WARNING, ERROR, got {self.log_level!r}")
        if self.on_sigterm not in ("drain", "ignore"):
            raise ConfigError(f'{where} on_sigterm: one of "drain", "ignore", got {self.on_sigterm!r}')
        if not 0 < self.drain_timeout <= MAX_TIMEOUT_S:
            raise ConfigError(
                f"{where} drain_timeout: must be positive and at most {MAX_TIMEOUT_S:.0f} seconds, got {self.drain_timeout}"
            )
        if self.telemetry not in TELEMETRY_MODES:
            raise ConfigError(
                f"{where} telemetry: one of {', '.join(map(repr, TELEMETRY_MODES))}, got {_brief(self.telemetry)}"
            )
        if not 0 <= self.history <= MAX_HISTORY:
            raise ConfigError(f"{where} history: must be between 0 and {MAX_HISTORY}, got {self.history}")
        if self.nonfinite not in NONFINITE_MODES:
            raise ConfigError(
                f"{where} nonfinite: one of {', '.join(map(repr, NONFINITE_MODES))}, got {_brief(self.nonfinite)}"
            )
        if self.verify_capture not in VERIFY_CAPTURE_MODES:
            raise ConfigError(
                f"{where} verify_capture: one of {', '.join(map(repr, VERIFY_CAPTURE_MODES))}, "
                f"got {_brief(self.verify_capture)}"
            )
        if self.on_resume_check and not re.fullmatch(r"[\w.]+:[\w.]+", self.on_resume_check):
            raise ConfigError(f'{where} on_resume_check: "module:function", got {_brief(self.on_resume_check)}')
        if not 0 <= self.max_rollbacks <= 1000:
            raise ConfigError(f"{where} max_rollbacks: must be between 0 and 1000, got {self.max_rollbacks}")


@dataclass
class Config:
    """The whole configuration: ``[job]``, ``[host]``, and at least one tier section (``[local]``,
    ``[s3]``, or one registered by a tier module, kept in ``sections``).

    ``source`` names the file it came from (for messages); it is empty when built in Python.
    """

    host: HostConfig = field(default_factory=HostConfig)
    local: LocalConfig | None = None
    s3: S3Config | None = None
    job: JobConfig = field(default_factory=JobConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    source: str = ""
    sections: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def section(self, name: str) -> Any:
        """The section ``name`` (``"local"``, ``"s3"`` or a registered one), or None if absent."""
        if name in _BUILTIN:
            return getattr(self, name)
        return self.sections.get(name)

    def validate(self) -> None:
        pre = f"{self.source}: " if self.source else ""
        for name in self.sections:
            if name in _BUILTIN or name not in _SECTIONS:
                raise ConfigError(f"{pre}sections: [{_nm(name)}] is not a registered section")
        if self.local is None and self.s3 is None and not self.sections:
            raise ConfigError(f"{pre}at least one tier section ({', '.join(_tier_sections())}) is required")
        try:
            present = [
                (n, sec)
                for n, sec in (
                    ("host", self.host),
                    ("job", self.job),
                    ("local", self.local),
                    ("s3", self.s3),
                    ("peer", self.peer),
                    ("export", self.export),
                    *self.sections.items(),
                )
                if sec is not None
            ]
            for name, section in present:
                _coerce_section(name, section)
            for _name, section in present:
                section.validate()
            if self.s3 is not None:
                self.export.check_s3(self.s3.bucket, self.s3.prefix)
            if self.local is None and self.s3 is not None:
                for key, on in (
                    ("compression", self.s3.compression != "none"),
                    ("copy_unchanged", self.s3.copy_unchanged),
                ):
                    if on:
                        raise ConfigError(
                            f"[s3] {key}: applies to the copy into S3 from [local]; without a [local] section S3 "
                            "is the first tier, where saves write files as written (a codec there would sit on "
                            "the save's path): remove the key or add [local] (loading compressed checkpoints "
                            "needs no key; docs/compression.md)"
                        )
            if self.peer.replicas and (self.local is None or not self.local.node_local):
                raise ConfigError(
                    "[peer] replicas: needs a node-local [local] path (with {node}), where each node "
                    "keeps its own ranks' files"
                )
        except ConfigError as e:
            raise ConfigError(f"{pre}{e}") from None


TierConfig = Config
"""The former name of :class:`Config` (it always was the whole configuration, not one tier's)."""

_SECTIONS: dict[str, type] = {
    "host": HostConfig,
    "local": LocalConfig,
    "s3": S3Config,
    "job": JobConfig,
    "peer": PeerConfig,
    "export": ExportConfig,
}
_BUILTIN = frozenset(_SECTIONS)
_REQUIRED: dict[str, list[str]] = {"local": ["path"], "s3": ["bucket"]}
_SIZE_KEYS = {("host", "buffer_size"), ("host", "chunk_size"), ("s3", "part_size")}


def register_section(name: str, cls: type, *, required: tuple[str, ...] = (), sizes: tuple[str, ...] = ()) -> None:
    """Accept ``[name]`` in configuration files, parsed into the dataclass ``cls`` (which has a
    ``validate()`` raising :class:`ConfigError`) and kept in :attr:`Config.sections`. Called by a tier
    module when it registers its tier (:func:`tierckpt.tiers.register_tier`); ``required`` keys must
    be given, ``sizes`` keys accept sizes like ``"64MiB"``. Registering the same name twice with the
    same class is a no-op."""
    if name in _BUILTIN or (name in _SECTIONS and _SECTIONS[name] is not cls):
        raise ConfigError(f"section [{_nm(name)}] is already defined")
    _SECTIONS[name] = cls
    _REQUIRED[name] = list(required)
    _SIZE_KEYS.update((name, k) for k in sizes)


def _tier_sections() -> list[str]:
    return [f"[{n}]" for n in _SECTIONS if n not in ("host", "job", "peer", "export")]


def _coerce(section: str, key: str, value: Any, ftype: str, where: str) -> Any:
    if (section, key) in _SIZE_KEYS:
        return parse_size(value, where)
    if ftype == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {type(value).__name__} {_brief(value)}")
        return value
    if ftype == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} {_brief(value)}")
        if abs(value) > MAX_SIZE:
            raise ConfigError(f"{where}: integer out of range, got {_brief(value)}")
        return value
    if ftype == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {_brief(value)}")
        if isinstance(value, int) and abs(value) > MAX_SIZE or not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {_brief(value)}")
        return float(value)
    if ftype == "bool | str":  # a switch with an "auto" setting
        if not isinstance(value, bool) and value != "auto":
            raise ConfigError(f'{where}: expected "auto", true or false, got {type(value).__name__} {value!r}')
        return value
    if ftype == "list[str]":  # a TOML array of strings (one string counts as a list of one)
        if isinstance(value, str):
            return [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {type(value).__name__} {_brief(value)}")
        return list(value)
    if ftype == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {_brief(value)}")
        return value
    raise AssertionError(ftype)  # pragma: no cover - field types are fixed above


def _coerce_section(name: str, section: Any) -> None:
    """Parse sizes and check types of a section built in Python (as TOML loading does)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        setattr(section, f.name, _coerce(name, f.name, value, str(f.type), f"[{name}] {f.name}"))


def config_from_dict(data: Mapping[str, Any], source: str = "") -> Config:
    """Build and validate a :class:`Config` from parsed TOML (``source`` names the file)."""
    pre = f"{source}: " if source else ""
    sections: dict[str, Any] = {}
    for name, body in data.items():
        if name not in _SECTIONS:
            raise ConfigError(
                f"{pre}unknown section [{_nm(name)}] (known: {', '.join('[' + s + ']' for s in _SECTIONS)})"
            )
        if not isinstance(body, dict):
            raise ConfigError(f"{pre}[{name}] must be a table (a [{name}] section), got {type(body).__name__}")
        cls = _SECTIONS[name]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in body.items():
            where = f"{pre}[{name}] {_nm(key)}"
            if key not in fields:
                raise ConfigError(f"{where}: unknown key (known: {', '.join(fields)})")
            kwargs[key] = _coerce(name, key, value, str(fields[key].type), where)
        for req in _REQUIRED.get(name, []):
            if req not in kwargs:
                raise ConfigError(f"{pre}[{name}] {req}: missing required key")
        sections[name] = cls(**kwargs)
    return Config(
        host=sections.get("host", HostConfig()),
        local=sections.get("local"),
        s3=sections.get("s3"),
        job=sections.get("job", JobConfig()),
        peer=sections.get("peer", PeerConfig()),
        export=sections.get("export", ExportConfig()),
        source=source,
        sections={n: v for n, v in sections.items() if n not in _BUILTIN},
    )


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Load and validate the configuration file at ``path`` (or ``$TIERCKPT_CONFIG``)."""
    if path is None:
        path = os.environ.get(CONFIG_ENV)
        if not path:
            raise ConfigError(f"no configuration file given and {CONFIG_ENV} is not set")
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the configuration file: {e.strerror or e}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None
    return config_from_dict(data, source=str(p))
