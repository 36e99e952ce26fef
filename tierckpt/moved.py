"""Old import paths, kept working for one release after the tree was grouped into packages by stage.

Until the 0.1 series the package was flat (``tierckpt/writer.py``, ``tierckpt/layout.py``, ...).
Each former module now lives in the package of its stage; its old dotted path still imports, with
a :class:`DeprecationWarning` naming the new path, through one mechanism rather than one shim file
per module:

* :data:`MOVED` maps every old module path to the module(s) that now hold its names. A finder on
  :data:`sys.meta_path` (:func:`install`, run by ``tierckpt/__init__.py``) answers ``import
  tierckpt.writer`` and ``from tierckpt.writer import X`` by warning once per path and binding the
  old name to the new module object itself (``tierckpt.writer is tierckpt.save.writer``), so
  classes, functions and module state are the very same objects. An old module whose names were
  split over several new modules is served by a small read-only view that looks each name up in
  them, in order.
* :func:`deprecated_names` is for the former modules whose path became a package of the same name
  (``tierckpt.save``): a module ``__getattr__`` that serves the old names, with the same warning.

Every warning's message starts with :data:`PREFIX`; the test suite turns those into errors so that
the code base itself never uses an old path (``tests/test_moved.py`` checks each one still works).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MOVED", "PREFIX", "install", "deprecated_names"]

PREFIX = "old import path"

MOVED: dict[str, tuple[str, ...]] = {
    # old module path -> the module(s) that hold its names now (looked up in this order)
    "tierckpt.configvalues": ("tierckpt.config.values",),
    "tierckpt.redact": ("tierckpt.config.redact",),
    "tierckpt.layout": ("tierckpt.format.layout", "tierckpt.format.metadata"),
    "tierckpt.dcpjson": ("tierckpt.format.dcpjson",),
    "tierckpt.jsonvalues": ("tierckpt.format.jsonvalues",),
    "tierckpt.safejson": ("tierckpt.format.safejson",),
    "tierckpt.codec.index": ("tierckpt.format.stored",),
    "tierckpt.checkpoints": ("tierckpt.catalog.checkpoints",),
    "tierckpt.nodes": ("tierckpt.catalog.nodes",),
    "tierckpt.lease": ("tierckpt.catalog.lease",),
    "tierckpt.planning": ("tierckpt.capture.planning",),
    "tierckpt.writer": ("tierckpt.save.writer",),
    "tierckpt.asyncsave": ("tierckpt.save.asyncsave",),
    "tierckpt.planchannel": ("tierckpt.save.planchannel",),
    "tierckpt.plancache": ("tierckpt.save.plancache",),
    "tierckpt.preempt": ("tierckpt.save.preempt",),
    "tierckpt.savehold": ("tierckpt.save.hold",),
    "tierckpt.engine": ("tierckpt.chain.engine",),
    "tierckpt.commit": ("tierckpt.chain.commit",),
    "tierckpt.replicate": ("tierckpt.chain.replicate",),
    "tierckpt.peercopy": ("tierckpt.chain.peercopy",),
    "tierckpt.encodedhop": ("tierckpt.chain.encodedhop",),
    "tierckpt.retention": ("tierckpt.chain.retention",),
    "tierckpt.peers": ("tierckpt.chain.peers",),
    "tierckpt.reader": ("tierckpt.load.reader",),
    "tierckpt.readback": ("tierckpt.load.readback",),
    "tierckpt.fill": ("tierckpt.load.fill",),
    "tierckpt.agreement": ("tierckpt.load.agreement",),
}


def _warn(old: str, new: str) -> None:
    """A DeprecationWarning attributed to the first frame outside the import machinery and this
    module (``warnings.warn`` skips importlib's frames itself when it counts ``stacklevel``)."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2: the caller of _warn
    frame_or_none: types.FrameType | None = frame
    while frame_or_none is not None and (
        frame_or_none.f_code.co_filename.startswith("<frozen importlib") or frame_or_none.f_code.co_filename == __file__
    ):
        if frame_or_none.f_code.co_filename == __file__:
            level += 1
        frame_or_none = frame_or_none.f_back
    warnings.warn(
        f"{PREFIX} {old}: use {new} (the old path is removed in the next release)", DeprecationWarning, stacklevel=level
    )


class _View(types.ModuleType):
    """An old module split over several new ones: each name is looked up in ``_targets``, in order."""

    def __init__(self, name: str, targets: Sequence[types.ModuleType]) -> None:
        super().__init__(name, f"Deprecated: the names of {name}, now in " + ", ".join(m.__name__ for m in targets))
        self._targets = tuple(targets)

    def __getattr__(self, name: str) -> Any:
        for module in self._targets:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted({n for m in self._targets for n in dir(m)})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED`; the module it "loads" is the new one (or a :class:`_View`)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        targets = MOVED[spec.name]
        _warn(spec.name, " or ".join(targets))
        modules = [importlib.import_module(t) for t in targets]
        return modules[0] if len(modules) == 1 else _View(spec.name, modules)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the new module was imported by :meth:`create_module`."""


def install() -> None:
    """Put the finder first on :data:`sys.meta_path` (once per process): an old path must resolve to
    the new module even where a stale copy of the old file is still importable (an older install
    or an editable finder of another checkout)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def deprecated_names(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` serving ``table``'s old names (name -> module that
    holds it now), each with the deprecation warning; other names raise :class:`AttributeError`."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        _warn(f"{package}.{name}", f"{module}.{name}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
