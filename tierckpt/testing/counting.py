"""Counters of what a process's checkpointing costs in coordination: S3 requests, bytes through
object collectives, tensor collectives and point-to-point transfers, store operations.

Used by the scale harness (:mod:`tierckpt.testing.scale`): each worker process calls
:func:`install` once, before it creates any tierckpt object, then runs its work inside
``counters.phase(name)`` blocks and returns ``counters.dump()`` (JSON-able). Nothing in
``tierckpt`` imports this module; it changes no behaviour, it only counts::

    counters = install()
    with counters.phase("save"):
        dcp.save(sd, checkpoint_id="step-1", storage_writer=w)
        w.wait()
    report = counters.dump()   # {"save": {"s3": {...}, "obj": {...}, "tensor": {...}, "store": {...}, ...}}

What is counted, and how:

* **S3**: every botocore client created after :func:`install` (tierckpt makes its clients with
  ``boto3.session.Session(...).client``, which goes through ``botocore.session.Session.create_client``)
  gets two event handlers. ``before-call`` fires once per API call (a ListObjectsV2 page is one
  call): ``s3.calls[op]``. ``before-send`` fires once per HTTP attempt, retries included:
  ``s3.attempts[op]`` (attempts - calls = botocore's retries). Each call is also filed under
  ``s3.sites["Op <- tierckpt call chain"]``: the innermost tierckpt frames that led to it, so a
  count can be traced to the code path that makes it.
* **Object collectives** (``all_gather_object``, ``broadcast_object_list``, ``gather_object``,
  ``scatter_object_list``): calls (one call = one round on the critical path) and the pickled
  bytes of the objects this rank received from other ranks (``recv_bytes``: the objects delivered
  into this rank's output list, re-pickled with the protocol torch uses, this rank's own object
  excluded) and of what it contributed (``sent_bytes``). Tensor collectives that torch issues
  inside an object collective are not counted again.
* **Tensor collectives and point-to-point** (``isend``/``irecv``/``send``/``recv``,
  ``broadcast``, ``all_reduce``, ``all_gather``, ``barrier``...): calls and tensor bytes (received
  for ``irecv``/``recv``/a non-source ``broadcast``/others' ``all_gather`` slots; sent for
  ``isend``/``send``). ``new_group`` calls are counted under ``groups``.
* **Store**: ``torch.distributed.distributed_c10d._get_default_store`` (which every tierckpt store
  user calls: :class:`~tierckpt.commit.StoreChannel` via ``default_channel``, the plan channel,
  the save hold) returns a counting proxy: ``store[op]`` for set/get/check/add/delete_key/wait/
  multi_get..., plus ``check_miss`` for a ``check`` that answered False (a poll that found nothing:
  that count depends on timing, the others do not).

Names are keyed by the collective; a call on a process group other than the default one gets the
suffix ``[sub]``. Counts are process-wide: a background thread's request lands in whatever phase
the main thread is in. Phases nest: ``phase("b")`` inside ``phase("a")`` counts under ``"a/b"``;
outside any phase, counts go under ``"-"``. Every counter is updated under one lock.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import pickle
import sys
import threading
import types
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Counters", "PhaseCounts", "install", "uninstall", "installed", "merge", "collapse", "OBJECT_COLLECTIVES"]

OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
TENSOR_OPS = (
    "isend",
    "irecv",
    "send",
    "recv",
    "broadcast",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
)
STORE_OPS = ("set", "get", "check", "add", "delete_key", "wait", "multi_get", "multi_set", "compare_set", "append")
NO_PHASE = "-"
_SITE_DEPTH = 4  # tierckpt frames (outside tiers/) named per S3 call site

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../tierckpt
_TIERS = os.path.join(_PKG, "tiers") + os.sep
_TESTING = os.path.join(_PKG, "testing") + os.sep


@dataclass
class PhaseCounts:
    """What one phase of one process cost (see the module docstring for each field)."""

    s3_calls: Counter = field(default_factory=Counter)
    s3_attempts: Counter = field(default_factory=Counter)
    s3_sites: Counter = field(default_factory=Counter)
    obj: dict[str, Counter] = field(default_factory=dict)
    tensor: dict[str, Counter] = field(default_factory=dict)
    store: Counter = field(default_factory=Counter)
    groups: int = 0

    def to_json(self) -> dict:
        return {
            "s3": {"calls": dict(self.s3_calls), "attempts": dict(self.s3_attempts), "sites": dict(self.s3_sites)},
            "obj": {k: dict(v) for k, v in self.obj.items()},
            "tensor": {k: dict(v) for k, v in self.tensor.items()},
            "store": dict(self.store),
            "groups": self.groups,
        }


class Counters:
    """The process's counters, by phase. Thread-safe; created by :func:`install`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phases: dict[str, PhaseCounts] = {}
        self._stack: list[str] = []

    # -- phases ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count under ``name`` (nested in the current phase, ``"outer/name"``) until the block ends."""
        if not name or "/" in name:
            raise ValueError(f"phase name {name!r}: must be non-empty, without '/'")
        with self._lock:
            self._stack.append(name)
            self._phases.setdefault("/".join(self._stack), PhaseCounts())
        try:
            yield
        finally:
            with self._lock:
                self._stack.pop()

    def _cur(self) -> PhaseCounts:  # under self._lock
        key = "/".join(self._stack) or NO_PHASE
        pc = self._phases.get(key)
        if pc is None:
            pc = self._phases[key] = PhaseCounts()
        return pc

    # -- recording (called by the hooks) --------------------------------------------------
    def s3_call(self, op: str, site: str) -> None:
        with self._lock:
            pc = self._cur()
            pc.s3_calls[op] += 1
            pc.s3_sites[f"{op} <- {site}"] += 1

    def s3_attempt(self, op: str) -> None:
        with self._lock:
            self._cur().s3_attempts[op] += 1

    def collective(self, kind: str, name: str, recv: int, sent: int) -> None:
        with self._lock:
            pc = self._cur()
            c = (pc.obj if kind == "obj" else pc.tensor).setdefault(name, Counter())
            c["calls"] += 1
            c["recv_bytes"] += recv
            c["sent_bytes"] += sent

    def store_op(self, op: str, miss: bool = False) -> None:
        with self._lock:
            pc = self._cur()
            pc.store[op] += 1
            if miss:
                pc.store["check_miss"] += 1

    def group_created(self) -> None:
        with self._lock:
            self._cur().groups += 1

    # -- reading --------------------------------------------------------------------------
    def dump(self) -> dict[str, dict]:
        """Phase -> counts, JSON-able (see :func:`merge` to add several processes' dumps)."""
        with self._lock:
            return {k: v.to_json() for k, v in self._phases.items()}

    def reset(self) -> None:
        with self._lock:
            self._phases.clear()


def merge(dumps: list[dict]) -> dict:
    """The sum of several :meth:`Counters.dump` phase entries (one phase's counts of many ranks,
    or several phases of one rank): same shape, every number added."""

    def add(into: dict, d: dict) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                add(into.setdefault(k, {}), v)
            else:
                into[k] = into.get(k, 0) + v

    out: dict = {"s3": {"calls": {}, "attempts": {}, "sites": {}}, "obj": {}, "tensor": {}, "store": {}, "groups": 0}
    for d in dumps:
        add(out, d)
    return out


def collapse(dump: dict, top: str) -> dict:
    """Phase ``top`` of one :meth:`Counters.dump` with all its sub-phases (``top/...``) added in."""
    return merge([v for k, v in dump.items() if k == top or k.startswith(top + "/")])


# -- the hooks ------------------------------------------------------------------------------

_installed: Counters | None = None
_undo: list[Callable[[], None]] = []
_tls = threading.local()


def installed() -> Counters | None:
    """The process's counters if :func:`install` ran, else None."""
    return _installed


def _site() -> str:
    """The tierckpt call chain of the current S3 call: the tier method called from outside
    ``tierckpt/tiers`` (the outermost tier frame), then up to :data:`_SITE_DEPTH` frames of its
    callers, innermost first (``"tiers/s3/reads.py:get < catalog.py:commit_header < ..."``)."""
    tier = ""
    rest: list[str] = []
    f: types.FrameType | None = sys._getframe(2)
    while f is not None and len(rest) < _SITE_DEPTH:
        fn = f.f_code.co_filename
        if fn.startswith(_PKG) and not fn.startswith(_TESTING):
            name = f"{os.path.relpath(fn, _PKG)}:{f.f_code.co_name}"
            if fn.startswith(_TIERS) and not rest:
                tier = name
            elif not fn.startswith(_TIERS) and (not rest or rest[-1] != name):
                rest.append(name)
        f = f.f_back
    chain = ([tier] if tier else []) + rest
    return " < ".join(chain) if chain else "(outside tierckpt)"


def _hook_botocore(c: Counters) -> None:
    import botocore.session

    orig = botocore.session.Session.create_client

    def on_call(event_name: str = "", **_: Any) -> None:
        c.s3_call(event_name.rsplit(".", 1)[-1], _site())
        return None  # a value would become the API response

    def on_send(event_name: str = "", **_: Any) -> None:
        c.s3_attempt(event_name.rsplit(".", 1)[-1])
        return None  # a value would become the HTTP response

    def create_client(self: Any, *args: Any, **kwargs: Any) -> Any:
        client = orig(self, *args, **kwargs)
        client.meta.events.register("before-call.s3", on_call, unique_id="tierckpt-counting-call")
        client.meta.events.register("before-send.s3", on_send, unique_id="tierckpt-counting-send")
        return client

    botocore.session.Session.create_client = create_client
    _undo.append(lambda: setattr(botocore.session.Session, "create_client", orig))


_PROTOCOL = pickle.DEFAULT_PROTOCOL  # torch's _object_to_tensor uses pickle.Pickler's default


def _size(obj: Any) -> int:
    try:
        return len(pickle.dumps(obj, protocol=_PROTOCOL))
    except Exception:  # noqa: BLE001 - an object torch could send but we cannot re-pickle counts as 0
        return 0


def _tensor_bytes(t: Any) -> int:
    try:
        return int(t.numel()) * int(t.element_size())
    except Exception:  # noqa: BLE001 - not a tensor
        return 0


def _group_rank(dist: Any, group: Any) -> int:
    return dist.get_rank(group) if group is not None else dist.get_rank()


def _is_src(dist: Any, a: dict, key: str) -> bool:
    """Whether this rank is the source/destination named by ``a[key]`` (global rank) or
    ``a['group_' + key]`` (rank in ``a['group']``)."""
    if a.get(key) is not None:
        return dist.get_rank() == a[key]
    g = a.get(f"group_{key}")
    return g is not None and _group_rank(dist, a.get("group")) == g


def _object_traffic(dist: Any, name: str, a: dict) -> tuple[int, int]:
    """(received, sent) pickled bytes of object collective ``name`` with bound arguments ``a``,
    after it returned."""
    if name == "all_gather_object":
        me = _group_rank(dist, a.get("group"))
        return sum(_size(o) for i, o in enumerate(a["object_list"]) if i != me), _size(a["obj"])
    if name == "broadcast_object_list":
        total = sum(_size(o) for o in a["object_list"])
        return (0, total) if _is_src(dist, a, "src") else (total, 0)
    if name == "gather_object":
        if _is_src(dist, a, "dst"):
            me = _group_rank(dist, a.get("group"))
            return sum(_size(o) for i, o in enumerate(a.get("object_gather_list") or []) if i != me), 0
        return 0, _size(a["obj"])
    if name == "scatter_object_list":
        if _is_src(dist, a, "src"):
            me = _group_rank(dist, a.get("group"))
            return 0, sum(_size(o) for i, o in enumerate(a.get("scatter_object_input_list") or []) if i != me)
        return sum(_size(o) for o in a["scatter_object_output_list"]), 0
    return 0, 0


def _tensor_traffic(dist: Any, name: str, a: dict) -> tuple[int, int]:
    """(received, sent) tensor bytes of tensor op ``name`` with bound arguments ``a``."""
    if name in ("irecv", "recv"):
        return _tensor_bytes(a["tensor"]), 0
    if name in ("isend", "send"):
        return 0, _tensor_bytes(a["tensor"])
    if name == "broadcast":
        n = _tensor_bytes(a["tensor"])
        return (0, n) if _is_src(dist, a, "src") else (n, 0)
    if name == "all_gather":
        me = _group_rank(dist, a.get("group"))
        return sum(_tensor_bytes(t) for i, t in enumerate(a["tensor_list"]) if i != me), _tensor_bytes(a["tensor"])
    if name == "all_reduce":
        n = _tensor_bytes(a["tensor"])
        return n, n
    return 0, 0


def _hook_dist(c: Counters) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def wrap(name: str, kind: str, orig: Callable) -> Callable:
        sig = inspect.signature(orig)
        traffic = _object_traffic if kind == "obj" else _tensor_traffic

        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(_tls, "inside", 0):  # torch's own tensor calls inside an object collective
                return orig(*args, **kwargs)
            _tls.inside = 1
            try:
                res = orig(*args, **kwargs)
            finally:
                _tls.inside = 0
            try:
                b = sig.bind(*args, **kwargs)
                b.apply_defaults()
                a = dict(b.arguments)
                recv, sent = traffic(dist, name, a)
                group = a.get("group")
                sub = group is not None and group is not getattr(dist.group, "WORLD", None)
                c.collective(kind, name + ("[sub]" if sub else ""), recv, sent)
            except Exception:  # noqa: BLE001 - counting never breaks the call it counts
                c.collective(kind, name + "[uncounted]", 0, 0)
            return res

        counted.__wrapped__ = orig  # type: ignore[attr-defined]
        return counted

    def patch(name: str, kind: str) -> None:
        orig = getattr(c10d, name, None)
        if orig is None:
            return
        new = wrap(name, kind, orig)
        for mod in (dist, c10d):
            if getattr(mod, name, None) is orig:
                setattr(mod, name, new)
                _undo.append(functools.partial(setattr, mod, name, orig))

    for n in OBJECT_COLLECTIVES:
        patch(n, "obj")
    for n in TENSOR_OPS:
        patch(n, "tensor")

    orig_ng = c10d.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        c.group_created()
        return orig_ng(*args, **kwargs)

    for mod in (dist, c10d):
        if getattr(mod, "new_group", None) is orig_ng:
            mod.new_group = new_group  # type: ignore[attr-defined]  # torch.distributed re-exports it at runtime
            _undo.append(functools.partial(setattr, mod, "new_group", orig_ng))

    orig_store = c10d._get_default_store

    def get_default_store() -> Any:
        return _CountingStore(orig_store(), c)

    c10d._get_default_store = get_default_store
    _undo.append(lambda: setattr(c10d, "_get_default_store", orig_store))


class _CountingStore:
    """A ``torch.distributed.Store`` stand-in that counts :data:`STORE_OPS` and forwards everything."""

    def __init__(self, store: Any, c: Counters) -> None:
        self._store, self._c = store, c

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        c = self._c
        if name == "clone":  # a thread's own client (tierckpt.chain.jobstore) counts as well
            return lambda: _CountingStore(attr(), c)
        if name not in STORE_OPS:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            res = attr(*args, **kwargs)
            c.store_op(name, miss=(name == "check" and not res))
            return res

        return counted


def install() -> Counters:
    """Hook botocore, torch.distributed and the default store of this process (idempotent) and
    return its :class:`Counters`. Call it before any tierckpt object or S3 client is created: a
    client made earlier is not counted."""
    global _installed
    if _installed is None:
        c = Counters()
        _hook_botocore(c)
        _hook_dist(c)
        _installed = c
    return _installed


def uninstall() -> None:
    """Undo :func:`install` (clients created meanwhile keep counting into the old counters)."""
    global _installed
    while _undo:
        _undo.pop()()
    _installed = None
