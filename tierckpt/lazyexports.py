"""PEP 562 lazy public names for a package (``tierckpt`` and ``restore``): each name is imported
from its module on first use, so that importing the package (the CLI, a launcher script) does not
import torch."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` for ``table`` (public name ->
    module, relative to ``package``): a name is imported on first use and cached in the package."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        mod = sys.modules[package]
        return sorted(set(vars(mod)) | set(getattr(mod, "__all__", ())))

    return __getattr__, __dir__
