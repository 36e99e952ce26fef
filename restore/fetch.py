"""``fetch``: copy a committed checkpoint into the local tier from other nodes or S3, resumably and verified.

Contract of :func:`fetch_checkpoint`:

* The destination is the first configured tier (local). The sources, fastest first: other
  nodes' copies of it (when its path is node-local, ``{node}``: the node directories this
  process can read, :func:`restore.catalog.open_peer_nodes`; their own files and the peer hop's
  copies), then every later shared tier holding the checkpoint committed (S3). Each file is taken
  from the first source that holds it committed with the right size; a range that fails there
  (read error, CRC32C) is taken from the next source. ``latest`` is what this node's load would
  resolve (:func:`restore.catalog.find_latest_here`) with peer nodes, else the newest checkpoint
  committed on the shared tiers.
* Every selected data file is downloaded with parallel ranged reads, several files and ranges
  at once: the sources' ``read_concurrency`` workers (fewer if ``workers x range`` would pass
  :data:`~tierckpt.readback.BUFFER_BUDGET`), ranges of :func:`tierckpt.readback.range_size`
  (about ``[s3] part_size``, a multiple of the checkpoint's chunk size so that every range holds
  whole CRC32C pieces), into page-aligned buffers. Each range is checked against its pieces
  *before* it is written; a bad range is read again (:func:`tierckpt.readback.read_checked`,
  :data:`~tierckpt.readback.TRIES` reads), then the next source is tried, then the fetch fails
  with ``ChecksumMismatch``.
* Resumable, with durability proportional to the work: each file is written through the local
  tier's resumable sink (:meth:`tierckpt.tiers.base.Tier.open_resumable`, one block per range,
  tagged with the save; direct I/O where the file system allows it). The local tier records
  landed blocks durably in batches (every few hundred MiB per file, and at an interruption) and
  fsyncs each file once at the end. After an interruption (Ctrl-C, kill, crash) the next fetch
  re-checks the recorded ranges, keeps the good ones and downloads the rest; a crash loses at most
  the progress since the last record. Nothing appears under a file's final name before all of it
  is in and durable.
* A file already present locally with the right size is checked range by range; if it is
  intact it is skipped, otherwise only its bad ranges are downloaded again.
* ``ID/metadata.json`` is written on the local tier last, byte-identical to the source's copy
  (same ``committed`` time, so ``latest`` agrees across tiers). Until then the local copy is partial:
  never loaded, never ``latest``. With ``ranks`` only the files written by those ranks are
  fetched, and the metadata is still written: :class:`tierckpt.TieredReader` reads each data file
  from the local tier when it is there and from S3 (or another node) otherwise.
* :attr:`FetchResult.sources` says where each selected file came from (``local`` when it was
  there already, ``node NAME``, ``s3``; several joined by ``+`` when ranges came from several).
* A local committed copy of the same id from a *different* save is never overwritten
  (``CommitConflict``). Two fetches never write one file at once: the second fails, saying
  another fetch is running (a resumable sink has one writer per key).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tierckpt.catalog import lease as leases
from tierckpt.catalog.listing import find_latest, list_checkpoints, read_checkpoint_doc
from tierckpt.codec import strip_stored
from tierckpt.codec.view import decoding
from tierckpt.config import TierConfig
from tierckpt.config.values import node_name
from tierckpt.errors import (
    CheckpointNotFound,
    CommitConflict,
    CorruptCheckpoint,
    TierckptError,
    TierError,
)
from tierckpt.format.layout import (
    MAX_METADATA_BYTES,
    check_checkpoint_id,
    metadata_key,
)
from tierckpt.format.metadata import CheckpointDoc, parse_metadata
from tierckpt.load.readback import range_size
from tierckpt.tiers import is_node_name, tier_kinds
from tierckpt.tiers.base import Tier

from .catalog import (
    PeerNode,
    as_config,
    find_latest_here,
    node_files,
    open_peer_nodes,
    open_tiers,
    rank_of_file,
)
from .download import SIDECAR_FORMAT, FilePlan, Source, download
from .errors import UsageError
from .pieces import FileCheck

__all__ = ["SIDECAR_FORMAT", "FetchResult", "fetch_checkpoint"]

log = logging.getLogger("tierckpt.restore")


@dataclass
class FetchResult:
    """What :func:`fetch_checkpoint` did."""

    checkpoint_id: str
    local_url: str  # where the checkpoint was written: the local tier's (the node's) directory / ID
    source_url: str  # the first source (another node's directory or the shared tier), for messages
    ranks: list[int] | None
    files: list[str]  # the data files selected
    downloaded: list[str] = field(default_factory=list)  # files (partly) downloaded now
    skipped: list[str] = field(default_factory=list)  # files already complete and intact locally
    resumed: list[str] = field(default_factory=list)  # files whose earlier partial download was kept
    repaired: list[str] = field(default_factory=list)  # files present locally whose bad ranges were replaced
    sources: dict[str, str] = field(default_factory=dict)  # file -> "local", "node NAME", "s3" ("a+b": several)
    bytes_downloaded: int = 0
    bytes_reused: int = 0  # verified bytes kept from local files and partial downloads
    ranges_retried: int = 0
    committed: bool = False  # the local metadata.json is in place
    seconds: float = 0.0
    node: str | None = None  # the node whose directory was written ([local] path with {node}), else None
    node_from: str = ""  # how that node was chosen: "--node", "TIERCKPT_NODE", "GROUP_RANK", "NODE_RANK", "host name"
    other_nodes: list[str] = field(default_factory=list)  # the other node directories readable here
    fresh_node: bool = False  # the node's directory held no committed checkpoint before this fetch

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["seconds"] = round(self.seconds, 3)
        return d


def fetch_checkpoint(
    config: TierConfig | str | os.PathLike | None,
    checkpoint_id: str = "latest",
    ranks: Iterable[int] | None = None,
    progress: bool = True,
    peers: bool = True,
    node: str | None = None,
) -> FetchResult:
    """Copy committed checkpoint ``checkpoint_id`` (or ``"latest"``) into the local tier from
    other nodes' directories readable here and from the shared tiers (S3).

    Args:
        config: a :class:`TierConfig`, a TOML path, or ``None`` for ``$TIERCKPT_CONFIG``; it needs
            ``[local]`` and a source: ``[s3]``, or a node-local ``[local]`` path (``{node}``)
            whose other nodes' directories this process can read.
        ranks: fetch only the data files written by these ranks (None: all files).
        progress: show a progress bar on a terminal.
        peers: take files from other nodes' directories where readable (False: shared tiers only).
        node: with a node-local ``[local]`` path (``{node}``), the node whose directory receives
            the checkpoint (None: this process's node name, :func:`tierckpt.config.values.node_name`:
            ``TIERCKPT_NODE``, else torchrun's ``GROUP_RANK``, else ``NODE_RANK``, else the host
            name); :attr:`FetchResult.local_url` and :attr:`FetchResult.node` say where it went.

    Blocks until the files and the metadata are in place (or the fetch failed); runs in the
    calling process, any rank or a launcher script. Returns a :class:`FetchResult`. Raises
    :class:`CheckpointNotFound` if no source holds a committed copy (or a selected file),
    :class:`ChecksumMismatch` if every source's bytes of a range fail their CRC32C,
    :class:`CommitConflict` if the local tier holds a different save under the same id. An
    interrupted fetch (any exception, ``KeyboardInterrupt`` included) is resumed by calling it again.
    See the module docstring for the whole contract.
    """
    t0 = time.perf_counter()
    if ranks is not None:
        ranks = list(ranks)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
        if bad:  # checked before any tier is contacted
            raise UsageError(f"--rank {bad[0]!r}: ranks are integers from 0")
    if checkpoint_id != "latest":
        check_checkpoint_id(checkpoint_id)  # InvalidCheckpointId before any tier is contacted
    if node is not None and not is_node_name(node):
        raise UsageError(f"--node {node[:60]!r}: a node name is letters, digits and ._- (no '/' or '..')")
    cfg = as_config(config)
    tiers = open_tiers(cfg)
    node_from = "--node" if node is not None else _node_source()
    if tiers[0].node_local:
        if node is not None and node != node_name():
            for_node = tier_kinds(cfg)[0].for_node
            assert for_node is not None  # a node-local first tier's kind builds other nodes' tiers
            tiers[0].close()
            tiers[0] = for_node(cfg, node)
        node = node if node is not None else node_name()
    elif node is not None:
        for t in tiers:
            t.close()
        raise UsageError(
            f"--node {node}: the [local] path{(' of ' + cfg.source) if cfg.source else ''} has no {{node}}: "
            "every process writes the same directory"
        )
    local, shared = tiers[0], [t for t in tiers[1:] if not t.node_local]
    nodes: list[PeerNode] = []
    plans: list[FilePlan] = []
    held: list[leases.Lease] = []
    try:
        nodes = open_peer_nodes(cfg, tiers) if peers else []
        fresh = local.node_local and not any(c.committed for c in list_checkpoints(local))
        if not shared and not nodes:
            where = f" {cfg.source}" if cfg.source else ""
            raise UsageError(
                "fetch copies from [s3] or from other nodes' [local] directories ({node}) to [local]: "
                + (
                    f"the configuration{where} has no [s3] section and no other node's directory is readable here"
                    if local.node_local
                    else f"the configuration{where} needs both sections"
                )
            )
        cid = _resolve(cfg, tiers, shared, nodes, checkpoint_id)
        sources = _holders(cid, shared, nodes)
        if not sources:
            here = " (the local tier holds a committed copy already)" if local.exists(metadata_key(cid)) else ""
            raise CheckpointNotFound(
                f"checkpoint {cid} is not committed on "
                + ", ".join([t.url for t in shared] + [n.tier.url for n in nodes])
                + here
            )
        # Leases: gc or retention anywhere leave the sources and the local files alone meanwhile.
        for src in sources:
            try:
                held.append(leases.acquire(src.tier, cid, purpose="fetch"))
            except CheckpointNotFound:
                raise
            except (TierckptError, OSError) as e:
                if src.tier.node_local:  # another node's directory may be read-only here: read it all the same
                    log.debug("no lease on %s (%s): reading it without one", src.tier.url, e)
                    continue
                raise
        held.append(leases.acquire(local, cid, kind="fetch", purpose="fetch into this tier", require_committed=False))
        mkey = metadata_key(cid)
        doc, raw = _metadata(cid, sources)
        man = doc.manifest
        local_raw = _local_metadata(local, cid, man.save_token)
        selected = _select(man.files, man.world_size, ranks)
        rank_list = None if ranks is None else sorted(set(ranks))
        res = FetchResult(cid, f"{local.url}/{cid}", f"{sources[0].tier.url}/{cid}", rank_list, sorted(selected))
        res.node, res.node_from = (node, node_from) if local.node_local else (None, "")
        res.other_nodes = [n.node for n in nodes]
        res.fresh_node = fresh
        by_file = doc.files_items()
        sized = next((s.tier for s in sources if not s.tier.node_local), sources[0].tier)
        rsize = range_size(sized, man.chunk_size)
        on_nodes = _file_sources(cid, man.save_token, sources, nodes)
        on_shared = [src for src in sources if not src.tier.node_local]
        for file in sorted(selected):
            fc = FileCheck(file, man.files[file], by_file.get(file, []), man.chunk_size)
            if fc.covered != fc.size:
                raise CorruptCheckpoint(
                    f"{sources[0].tier.url}/{mkey}: the CRC pieces of {file} cover {fc.covered} of {fc.size} bytes"
                )
            plans.append(FilePlan(local, cid, man.save_token, fc, rsize, on_nodes.get(file, []) + on_shared))
        for p in plans:
            p.prepare()
            res.bytes_reused += p.reused
            if p.state == "skipped":
                res.skipped.append(p.file)
            elif p.state == "resumed":
                res.resumed.append(p.file)
            elif p.state == "repaired":
                res.repaired.append(p.file)
        todo = [p for p in plans if p.sink is not None]
        for p in todo:
            if p.missing():
                _check_sizes(p)
        download(cid, todo, res, progress)
        for p in todo:
            p.finish()
            if p.state != "skipped":
                res.downloaded.append(p.file)
        res.sources = {p.file: p.source_label() for p in plans}
        if local_raw != raw:
            # Last: the local copy becomes committed only now, with the source's bytes (same commit time).
            try:
                local.put(mkey, raw, if_absent=local_raw is None)
            except CommitConflict:
                if _local_metadata(local, cid, man.save_token) != raw:  # another fetch committed the same save: fine
                    raise
        res.committed = True
        res.seconds = time.perf_counter() - t0
        return res
    finally:
        for p in plans:
            p.close()
        for lease in held:
            lease.release()
        for n in nodes:
            n.tier.close()
        for t in tiers:
            t.close()


def _node_source() -> str:
    """What :func:`~tierckpt.config.values.node_name` took this process's node name from."""
    for var in ("TIERCKPT_NODE", "GROUP_RANK", "NODE_RANK"):
        if os.environ.get(var):
            return var
    return "host name"


def _resolve(cfg: TierConfig, tiers: list[Tier], shared: list[Tier], nodes: list[PeerNode], checkpoint_id: str) -> str:
    """The checkpoint id to fetch: ``latest`` as this node's load resolves it (peer nodes), or
    the newest on the shared tiers."""
    if checkpoint_id == "latest":
        if nodes:
            return find_latest_here(cfg, tiers, nodes).checkpoint_id
        return find_latest(shared).checkpoint_id
    return check_checkpoint_id(checkpoint_id)


def _holders(cid: str, shared: list[Tier], nodes: list[PeerNode]) -> list[Source]:
    """The sources holding ``cid`` committed: other nodes first (their order), then shared tiers."""
    out = [Source(n.label, n.tier) for n in nodes if n.info(cid) is not None]
    out += [Source(t.name, decoding(t, cid)) for t in shared if t.exists(metadata_key(cid))]
    return out


def _metadata(cid: str, sources: list[Source]) -> tuple[CheckpointDoc, bytes]:
    """The checkpoint's metadata (parsed, and its bytes) from the first source with a valid copy
    (size-checked before it is read, then validated: :func:`tierckpt.catalog.read_checkpoint_doc`'s checks)."""
    errors = []
    key = metadata_key(cid)
    for src in sources:
        where = f"{src.tier.url}/{key}"
        try:
            size = src.tier.size(key)
            if size > MAX_METADATA_BYTES:
                raise CorruptCheckpoint(f"{where}: metadata of {size} bytes is larger than {MAX_METADATA_BYTES} bytes")
            raw = src.tier.get(key, 0, size)
            doc = parse_metadata(raw, where)
            if doc.manifest.checkpoint_id != cid:
                raise CorruptCheckpoint(f"{where}: metadata names checkpoint {doc.manifest.checkpoint_id!r}")
            return doc, strip_stored(raw)  # the local copy holds plain files: no stored index
        except (CheckpointNotFound, CorruptCheckpoint, TierError) as e:
            errors.append(f"{src.label}: {e}")
            log.warning("metadata of %s from %s: %s; trying the next source", cid, src.label, e)
    raise CorruptCheckpoint(f"checkpoint {cid}: no source holds valid metadata: " + "; ".join(errors))


def _file_sources(cid: str, token: str, sources: list[Source], nodes: list[PeerNode]) -> dict[str, list[Source]]:
    """Data file -> the other nodes holding it with the manifest's size (when their copy is the
    same save), in source order; a shared tier's commit covers every file."""
    by_label = {n.label: n for n in nodes}
    out: dict[str, list[Source]] = {}
    for src in sources:
        node = by_label.get(src.label)
        info = None if node is None else node.info(cid)
        if info is None:
            continue
        try:
            doc = read_checkpoint_doc(src.tier, cid)
        except (CheckpointNotFound, CorruptCheckpoint, TierError) as e:
            log.warning("skipping %s as a source of %s: %s", src.label, cid, e)
            continue
        if doc.manifest.save_token != token:
            log.warning("skipping %s as a source of %s: it holds another save of it", src.label, cid)
            continue
        for f in node_files(info, doc.manifest):
            out.setdefault(f, []).append(src)
    return out


def _check_sizes(p: FilePlan) -> None:
    """Drop shared sources whose object has another size than the manifest's; none left: an error."""
    if not p.sources:
        raise CheckpointNotFound(f"checkpoint {p.cid}: data file {p.file} is on no readable node and on no shared tier")
    kept, wrong = [], []
    for src in p.sources:
        if src.tier.node_local:
            kept.append(src)  # sized from the node's listing already
            continue
        got = src.tier.size(p.key)
        if got != p.size:
            wrong.append(f"{src.tier.url}/{p.key}: the object has {got} bytes, the manifest says {p.size}")
        else:
            kept.append(src)
    if not kept:
        raise CorruptCheckpoint(wrong[0])
    p.sources = kept


def _local_metadata(local: Tier, cid: str, token: str) -> bytes | None:
    """The local metadata.json bytes if the local tier holds a committed copy of the same save."""
    mkey = metadata_key(cid)
    try:
        raw = local.get(mkey)
    except CheckpointNotFound:
        return None
    try:
        man = parse_metadata(raw, f"{local.url}/{mkey}").manifest
    except CorruptCheckpoint as e:
        log.warning("%s; replacing it with the source's copy", e)
        return b""
    if man.save_token != token:
        raise CommitConflict(
            f"{local.url}/{cid} holds a different save of checkpoint {cid} "
            f"(token {man.save_token[:8]}, the source has {token[:8]}); it is never overwritten"
        )
    return raw


def _select(files: dict[str, int], world: int, ranks: Iterable[int] | None) -> dict[str, int]:
    if ranks is None:
        return dict(files)
    want = set(ranks)
    bad = sorted(r for r in want if r < 0 or r >= world)
    if bad:
        raise UsageError(f"--rank {bad[0]}: the checkpoint was saved by {world} rank(s) (0-{world - 1})")
    return {f: s for f, s in files.items() if rank_of_file(f) in want}
