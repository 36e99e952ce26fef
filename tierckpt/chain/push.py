"""Push a backlog by hand: copy to each later tier what it lacks from the first tier, as a job's hops do.

A job's hops copy their backlog (checkpoints committed on the first tier that a later tier
lacks: an outage, a job that exited before its copies finished) before their next copy. When no
job runs any more, :func:`push_backlog` runs that same pass from one process (``tierckpt-restore
push``): the backlog pass of :mod:`.backlog`, with the same plan (what the destination should
have and lacks: everything newer than its newest, and its ``keep_every`` milestones), the same
leases (a read lease on each source, a writer's lease on the destination, held until committed)
and the same commit (metadata last, create-if-absent). A job copying the same checkpoint at the
same time is harmless: whichever commits second finds it committed.

With a node-local first tier (``[local] path`` with ``{node}``) every node directory this
process can read is a source: the pass runs as one round whose ranks are those directories (one
thread each), so a checkpoint whose ranks wrote on several nodes is copied from the nodes that
hold its files. A checkpoint is copied only when every data file its metadata names is held,
with its recorded size, by some readable directory; otherwise nothing of it is copied and the
result names the ranks missing and the node directories that could not be read.

Retention is not applied here: the caller runs it afterwards on every tier
(:func:`restore.gc.gc_checkpoints`), which then sees every promoted checkpoint.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..capture.ranksave import RankSave
from ..catalog.listing import committed_in_order
from ..config import Config
from ..errors import TierckptError
from ..format.layout import metadata_key, rank_of_file
from ..format.metadata import metadata_from_json
from ..tiers.base import Tier
from .backlog import BacklogPasses
from .commit import Channel, LocalChannel, Round
from .encodedhop import EncodedCopies

__all__ = ["HopPush", "PushSources", "push_backlog", "push_sources"]

log = logging.getLogger("tierckpt.replicate")


@dataclass
class HopPush:
    """What :func:`push_backlog` did for one later tier ``tier`` (a configuration section name)."""

    tier: str
    url: str
    needed: list[str] = field(default_factory=list)  # owed to the tier, oldest first
    promoted: list[str] = field(default_factory=list)  # committed there now
    failed: dict[str, str] = field(default_factory=dict)  # id -> why it stays owed
    error: str = ""  # the pass itself failed (the tier could not be listed): nothing copied
    nodes: list[str] = field(default_factory=list)  # node directories read (node-local first tier)
    unreadable: dict[str, str] = field(default_factory=dict)  # node -> "URL: why" (not read)

    def to_json(self) -> dict:
        return dict(self.__dict__)


class _Owner:
    """The hop owner of a one-process push: a local channel, and no retention during the pass."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def channel(self, job: RankSave) -> Channel:
        return LocalChannel()

    def retain(
        self, tier: Tier, protect: set[str], *, owed: set[str] | frozenset[str] = frozenset(), need_bytes: int = 0
    ) -> None:
        """No retention during the pass (the caller applies it on every tier afterwards)."""


@dataclass
class PushSources:
    """The copies of the first tier a push reads: ``(label, tier)`` per source (``node NAME`` for
    a node directory, the tier's name otherwise), the node directories that could not be read
    (node -> ``"URL: why"``), and the tiers this opened (the caller closes them)."""

    sources: list[tuple[str, Tier]]
    unreadable: dict[str, str] = field(default_factory=dict)
    opened: list[Tier] = field(default_factory=list)

    @property
    def nodes(self) -> list[str]:
        return [label.removeprefix("node ") for label, _t in self.sources if label.startswith("node ")]

    def close(self) -> None:
        for t in self.opened:
            t.close()


def push_sources(cfg: Config, tiers: list[Tier]) -> PushSources:
    """The sources of a push from ``tiers[0]``: itself, and with a node-local first tier every
    other node directory this process sees (:func:`tierckpt.catalog.nodes.open_node_dirs`) that
    it can list; one it cannot list (no permission, an I/O error) is named in ``unreadable``,
    never raised. This node's own directory is always a source (an error listing it fails the
    pass, as before)."""
    first = tiers[0]
    if not first.node_local:
        return PushSources([(first.name, first)])
    from ..catalog.nodes import open_node_dirs
    from ..config.values import node_name

    others = open_node_dirs(cfg, tiers)
    out = PushSources([(f"node {node_name()}", first)], opened=list(others.values()))
    for node, t in others.items():
        try:
            committed_in_order(t)
        except (TierckptError, OSError) as e:
            out.unreadable[node] = str(e) if t.url in str(e) else f"{t.url}: {e}"
            continue
        out.sources.append((f"node {node}", t))
    return out


class _Hop(BacklogPasses):
    """One hop ``src -> dst`` with the state a backlog pass keeps (see :class:`BacklogPasses`):
    one per source (the round's rank ``rank``). The coordinator's (rank 0) plan leaves out the
    checkpoints whose files the sources do not hold in full (:meth:`_plan_backlog`)."""

    def __init__(self, owner: _Owner, src: Tier, dst: Tier, index: int, sources: PushSources) -> None:
        self.owner = owner
        self._src_tier, self._dst_tier = src, dst
        self.name = dst.name
        self.hop = f"{index}-{dst.name}"
        self.settled = False
        self.started = threading.Event()
        self._lock = threading.Lock()
        self._need_pass = True
        self._owed: set[str] = set()
        self._pending: set[str] = set()
        self.failing = None
        self._encoded = EncodedCopies(owner.cfg.job.background_nice)
        self.sources = sources
        self.owed: list[str] = []  # coordinator: what the destination lacks, oldest first
        self.incomplete: dict[str, str] = {}  # coordinator: id -> why it is not copied at all

    @property
    def src(self) -> Tier:
        return self._src_tier

    @property
    def dst(self) -> Tier:
        return self._dst_tier

    def _plan_backlog(self, have: list[dict], world: int) -> dict:
        """The backlog plan, less the checkpoints some data file of which no source holds with
        the size its metadata records (named in :attr:`incomplete`, nothing of them copied)."""
        plan = super()._plan_backlog(have, world)
        self.owed = list(plan["needed"])
        keep = []
        for cid in plan["needed"]:
            why = self._missing(cid, plan["plan"][cid])
            if why is None:
                keep.append(cid)
            else:
                self.incomplete[cid] = why
                del plan["plan"][cid]
        plan["needed"] = keep
        return plan

    def _missing(self, cid: str, p: dict[str, Any]) -> str | None:
        """Why checkpoint ``cid`` cannot be copied whole from the sources (``p``: its plan,
        file -> [rank, size]), or None when every data file its metadata names is held."""
        label, src = self.sources.sources[p["md_rank"]]
        try:
            _md, man = metadata_from_json(src.get(metadata_key(cid)), f"{src.url}/{metadata_key(cid)}")
        except TierckptError as e:  # deleted meanwhile, unreadable: the pass reports it
            log.debug("push: cannot read the metadata of %s on %s: %s", cid, src.url, e)
            return None
        files: dict[str, list[int]] = p["files"]
        missing = sorted(f for f, size in man.files.items() if size and f not in files)
        wrong = sorted(f for f, size in man.files.items() if size and f in files and files[f][1] != size)
        if not missing and not wrong:
            return None
        read = ", ".join(lbl for lbl, _t in self.sources.sources)
        parts = []
        if missing:
            ranks = sorted({r for r in (rank_of_file(f) for f in missing) if r is not None})
            parts.append(
                f"the data files of rank(s) {', '.join(map(str, ranks))} ({', '.join(missing)}) are in no "
                f"directory read here ({read})"
            )
        for f in wrong:
            r, size = files[f]
            parts.append(
                f"data file {f} has {size} bytes on {self.sources.sources[r][0]}, its metadata records {man.files[f]}"
            )
        for node, why in self.sources.unreadable.items():
            parts.append(f"node {node} could not be read ({why})")
        return "not copied (nothing of it): " + "; ".join(parts)


class _PushChannel(LocalChannel):
    """The in-process channel of one push round; once a rank failed (:attr:`abort`) every wait
    on it ends at once (the others would otherwise wait ``[job] commit_timeout`` for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.abort = threading.Event()

    def wait_get(self, key: str, timeout: float, what: str, cancelled=lambda: False) -> bytes:
        return super().wait_get(key, timeout, what, lambda: self.abort.is_set() or cancelled())


def _run_rank(hop: _Hop, rnd: Round, ch: _PushChannel, out: dict[int, Any]) -> None:
    """One source's part of the round: its result, or the exception that stopped it, in ``out``
    (then the round is aborted for the other sources)."""
    try:
        out[rnd.rank] = hop._backlog_pass(rnd, None, "")
    except BaseException as e:  # noqa: BLE001 - reported by push_backlog
        out[rnd.rank] = e
        ch.abort.set()
    finally:
        rnd.finish()


def push_backlog(cfg: Config, tiers: list[Tier], only: str | None = None) -> list[HopPush]:
    """Copy to every later tier of ``tiers`` (fastest first; or only to the tier of section
    ``only``) the committed checkpoints of the first tier (every node directory readable here,
    when it is node-local: see the module docstring) it should have and lacks, each committed
    there by the commit protocol under leases. Returns one :class:`HopPush` per later tier; a
    tier that could not be listed or written, a checkpoint whose files are not all readable
    here, and a node directory that could not be read are reported in it (``error``,
    ``failed``, ``unreadable``), never raised, so that the other tiers are still pushed."""
    owner = _Owner(cfg)
    out: list[HopPush] = []
    sources = push_sources(cfg, tiers)
    try:
        for i, dst in enumerate(tiers[1:], start=1):
            if only is not None and dst.name != only:
                continue
            res = HopPush(dst.name, dst.url, nodes=sources.nodes, unreadable=dict(sources.unreadable))
            world = len(sources.sources)
            hops = [_Hop(owner, src, dst, i, sources) for _label, src in sources.sources]
            token = f"push-{uuid.uuid4().hex}"
            ch = _PushChannel()
            rounds = [
                Round(ch, token, f"backlog-{hops[0].hop}", r, world, cfg.job.commit_timeout, f"push to {dst.name}")
                for r in range(world)
            ]
            done: dict[int, Any] = {}
            threads = [
                threading.Thread(target=_run_rank, args=(hops[r], rounds[r], ch, done), name=f"tierckpt-push-{r}")
                for r in range(1, world)
            ]
            for t in threads:
                t.start()
            _run_rank(hops[0], rounds[0], ch, done)
            for t in threads:
                t.join()
            errors = [done[r] for r in range(world) if isinstance(done.get(r), BaseException)]
            if errors:  # the first cause, not a rank cancelled by it
                e = min(errors, key=lambda x: str(x).endswith(": cancelled"))
                res.error = f"{type(e).__name__}: {e}"
            else:
                res.needed = hops[0].owed
                res.promoted = done[0]["promoted"]
                res.failed = {**hops[0].incomplete, **dict(done[0]["failed"])}
                for cid in res.needed:  # skipped by the pass (logged there): still owed, so not ok
                    if cid not in res.promoted and cid not in res.failed:
                        res.failed[cid] = (
                            f"not copied: the directories read here ({', '.join(lbl for lbl, _t in sources.sources)}) "
                            "do not hold all of its files"
                        )
            out.append(res)
    finally:
        sources.close()
    return out
