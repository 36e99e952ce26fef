"""The tree's layer rules, checked on the source (no import is executed): stages form layers, no
module imports a module of a stage above its own (or of a peer stage at its level), no two
modules import each other through any chain of imports, and no module is over 500 lines.

What counts as an import of module A by module B: every ``import``/``from ... import`` statement in
B's source, wherever it stands -- at the top, inside a function (a lazy import still runs, later,
and a cycle through it still breaks when the timing changes), or under ``if TYPE_CHECKING:`` (a
module whose annotations name another depends on its design). ``from pkg import name`` counts as an
import of ``pkg.name`` when that is a module, else of ``pkg``. The package roots are an exception:
``from tierckpt import X`` counts as an import of the module that defines ``X`` (``_LAZY`` in
``tierckpt/__init__.py``), and the implicit import of a parent package (Python imports ``pkg``
before ``pkg.mod``) is no edge; neither is ``from .. import __version__`` (a constant of the root).

The stages, lowest first (the same order each package's ``__init__`` docstring states, and
ARCHITECTURE's picture): a module may import modules of its own stage and of every lower one.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tierckpt", "restore")
MAX_LINES = 500

LAYERS: list[tuple[str, ...]] = [
    # stages of one level may not import each other
    ("base",),  # tierckpt/errors.py, checksum.py, background.py, lazyexports.py, moved.py, loading.py
    ("config",),
    ("tiers",),
    ("format",),
    ("codec",),
    ("catalog",),
    ("telemetry",),
    ("capture",),
    ("chain",),
    ("save", "load"),
    ("api",),  # the package root: tierckpt/__init__.py
    ("integrations", "testing", "restore"),
]
BASE = {
    "tierckpt.errors",
    "tierckpt.checksum",
    "tierckpt.background",
    "tierckpt.lazyexports",
    "tierckpt.moved",
    "tierckpt.loading",
    "tierckpt.logsetup",  # the stderr handler for the tierckpt logger (imported by the package root)
}
LEVEL = {stage: level for level, stages in enumerate(LAYERS) for stage in stages}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


def modules() -> dict[str, Module]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            out[name] = Module(name, path, is_package)
    return out


def stage_of(name: str) -> str:
    if name == "tierckpt":
        return "api"
    if name in BASE:
        return "base"
    parts = name.split(".")
    if parts[0] == "restore":
        return "restore"
    if len(parts) > 2 or (len(parts) == 2 and (ROOT / "tierckpt" / parts[1]).is_dir()):
        return parts[1]
    raise AssertionError(f"{name} belongs to no stage: add it to a stage package (or to BASE)")


def _lazy_table() -> dict[str, str]:
    """The package root's public names -> their modules (its ``_LAZY`` literal)."""
    tree = ast.parse((ROOT / "tierckpt" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "_LAZY":
            table = ast.literal_eval(node.value)
            return {k: "tierckpt" + v for k, v in table.items()}
    raise AssertionError("tierckpt/__init__.py has no _LAZY table")


def imports(mod: Module, known: dict[str, Module], lazy: dict[str, str]) -> dict[str, int]:
    """The modules of ``known`` that ``mod`` imports -> the first line doing so."""
    tree = ast.parse(mod.path.read_text(), filename=str(mod.path))
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != mod.name and target not in PACKAGES:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.name.split(".")[: len(mod.name.split(".")) - (node.level - (1 if mod.is_package else 0))]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in known:
                    add(full, node.lineno)
                elif source == "tierckpt" and alias.name in lazy:
                    add(lazy[alias.name], node.lineno)
                else:
                    add(source, node.lineno)
    return found


def graph() -> tuple[dict[str, Module], dict[str, dict[str, int]]]:
    known = modules()
    lazy = _lazy_table()
    return known, {name: imports(mod, known, lazy) for name, mod in known.items()}


def find_cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (as a path a -> b -> ... -> a) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan, recursive: the graph is small
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:
        start = min(comp)
        prev: dict[str, str] = {}
        todo = [start]
        while todo:  # breadth first from start back to start, inside the component
            v = todo.pop(0)
            for w in sorted(edges[v]):
                if w in comp and w not in prev:
                    prev[w] = v
                    todo.append(w)
        path = [start]
        v = prev[start]
        while v != start:
            path.append(v)
            v = prev[v]
        path.append(start)
        cycles.append(list(reversed(path)))
    return cycles


def test_every_module_has_a_stage():
    known, _ = graph()
    for name in known:
        stage_of(name)


def test_no_upward_import():
    known, edges = graph()
    bad = []
    for name, targets in edges.items():
        here = stage_of(name)
        for target, line in targets.items():
            there = stage_of(target)
            if there != here and LEVEL[there] >= LEVEL[here]:
                bad.append(f"{known[name].path.relative_to(ROOT)}:{line}: {name} ({here}) imports {target} ({there})")
    assert not bad, "imports against the layer order " + repr(LAYERS) + ":\n" + "\n".join(bad)


def test_no_import_cycle():
    known, edges = graph()
    cycles = find_cycles(edges)
    lines = []
    for cycle in cycles:
        steps = [f"{a} -> {b} (line {edges[a][b]})" for a, b in zip(cycle, cycle[1:])]
        lines.append("cycle: " + " -> ".join(cycle) + "\n    " + "\n    ".join(steps))
    assert not cycles, "\n".join(lines)


def test_find_cycles_reports_the_path():
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycles(edges) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_module_over_500_lines(pkg):
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split by responsibility): {long}"


def test_every_stage_states_its_rules():
    """Each stage package's docstring says what it may import and what may import it."""
    missing = []
    for stage in LEVEL:
        if stage in ("base", "api", "restore"):
            continue
        doc = " ".join(
            (ast.get_docstring(ast.parse((ROOT / "tierckpt" / stage / "__init__.py").read_text())) or "").split()
        )
        if "May import" not in doc or "May be imported by" not in doc:
            missing.append(stage)
    assert not missing, f"stage packages whose __init__ docstring lacks 'May import' / 'May be imported by': {missing}"
