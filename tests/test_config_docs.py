"""docs/configuration.md is generated from the configuration dataclasses and must not drift; the
relative links of the README and docs/ must resolve.

The page is regenerated in memory by ``tools/gen_config_docs.py`` and compared with the committed
file; every key of every section must have a description; ``tools/check_links.py`` checks every
relative link and anchor. Each failure says how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", REPO / "tools" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_config_docs", mod)
    spec.loader.exec_module(mod)
    return mod


def test_every_key_has_a_description() -> None:
    gen = _generator()
    missing = gen.missing_descriptions()
    assert not missing, (
        f"config keys without a description: {', '.join(missing)}. Document each in its section "
        f"dataclass's 'Attributes:' docstring block (or EXTRA_DOCS in tools/gen_config_docs.py), "
        f"then run `{gen.REGENERATE}`"
    )


def test_every_section_and_key_is_on_the_page() -> None:
    gen = _generator()
    text = gen.render()
    names = [name for name, _ in gen.sections()]
    assert {"host", "local", "s3", "job", "peer"} <= set(names)
    for name, cls in gen.sections():
        assert f"### `[{name}]`" in text
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"[{name}] {f.name} missing from the generated page"


def test_required_and_size_keys_come_from_the_loader() -> None:
    gen = _generator()
    secs = dict(gen.sections())
    assert gen.required_keys("local", secs["local"]) == ["path"]
    assert gen.required_keys("s3", secs["s3"]) == ["bucket"]
    assert gen.required_keys("job", secs["job"]) == []
    assert gen.size_keys("host", secs["host"], []) == {"buffer_size", "chunk_size"}
    assert gen.size_keys("s3", secs["s3"], ["bucket"]) == {"part_size"}


def test_committed_page_matches_the_dataclasses() -> None:
    gen = _generator()
    want = gen.render()
    path = REPO / "docs" / "configuration.md"
    have = path.read_text() if path.exists() else ""
    if have != want:
        diff = "".join(
            list(
                difflib.unified_diff(have.splitlines(True), want.splitlines(True), "docs/configuration.md", "generated")
            )[:60]
        )
        raise AssertionError(
            f"docs/configuration.md is stale; regenerate it with `{gen.REGENERATE}` and commit it.\n{diff}"
        )


def test_relative_links_in_readme_and_docs_resolve() -> None:
    spec = importlib.util.spec_from_file_location("check_links", REPO / "tools" / "check_links.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bad = mod.broken_links(REPO)
    assert not bad, "broken relative links (run `python tools/check_links.py`):\n" + "\n".join(bad)
