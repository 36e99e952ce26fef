"""The old flat module paths (``tierckpt.writer``, ``tierckpt.layout``, ...) still import for one
release, each with a DeprecationWarning naming the new path, and give the very same objects."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import tierckpt
from tierckpt.moved import MOVED, PREFIX


def _fresh_import(name: str):
    """Import ``name`` as a first import would (the warning is issued once per process and path)."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    importlib.import_module(parent)
    if hasattr(sys.modules[parent], child) and getattr(sys.modules[parent], child).__name__ != name:
        delattr(sys.modules[parent], child)  # the alias bound by an earlier import
    return importlib.import_module(name)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_and_is_the_new_module(old):
    new = [importlib.import_module(n) for n in MOVED[old]]
    with pytest.warns(DeprecationWarning, match=f"^{PREFIX} {old}: use {MOVED[old][0]}"):
        mod = _fresh_import(old)
    if len(new) == 1:
        assert mod is new[0]
    for target in new:
        for name in getattr(target, "__all__", ()):
            if name in ("DTYPES",):
                continue  # served lazily (imports torch); checked below
            assert getattr(mod, name) is getattr(target, name), (old, name)


def test_from_import_of_old_path():
    sys.modules.pop("tierckpt.writer", None)
    with pytest.warns(DeprecationWarning, match="tierckpt.save.writer"):
        from tierckpt.writer import TieredWriter  # noqa: PLC0415 - the old path under test
    assert TieredWriter is tierckpt.TieredWriter
    sys.modules.pop("tierckpt.layout", None)
    with pytest.warns(DeprecationWarning, match="tierckpt.format.layout"):
        from tierckpt.layout import DTYPES, ItemRecord, data_key  # noqa: PLC0415
    from tierckpt.format.dcpjson import DTYPES as dtypes
    from tierckpt.format.layout import data_key as key
    from tierckpt.format.metadata import ItemRecord as record

    assert (DTYPES, ItemRecord, data_key) == (dtypes, record, key)


def test_old_names_of_packages_that_kept_their_path():
    """``tierckpt.save`` (was one rank's job record) warns for its old names; ``tierckpt.catalog``
    and ``tierckpt.config`` are the old names' homes and serve them without a warning."""
    import tierckpt.capture.ranksave as ranksave
    import tierckpt.catalog
    import tierckpt.catalog.listing as listing
    import tierckpt.config
    import tierckpt.config.sections as sections
    import tierckpt.save

    with pytest.warns(DeprecationWarning, match="tierckpt.capture.ranksave.RankSave"):
        assert tierckpt.save.RankSave is ranksave.RankSave
    with pytest.raises(AttributeError):
        tierckpt.save.no_such_name  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tierckpt.catalog.find_latest is listing.find_latest
        assert tierckpt.config.S3_MAX_PART == sections.S3_MAX_PART
        assert tierckpt.config.Config is sections.Config


def test_old_path_in_a_fresh_process():
    """As a user's script meets it: the warning points at the importing line, the module works."""
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "import tierckpt.replicate as r, tierckpt.chain.replicate as n\n"
        "assert r is n and r.Replicator is n.Replicator\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (
        "<string>:2: DeprecationWarning: old import path tierckpt.replicate: use tierckpt.chain.replicate" in out.stderr
    )
