"""Lint, format and type check, as CI runs them (the rules are in pyproject.toml).

``ruff check`` and ``ruff format --check`` cover ``tierckpt/``, ``restore/``, ``tools/`` and
``tests/``; ``mypy`` (non-strict, third-party libraries without stubs are ``Any``) covers
``tierckpt/`` and ``restore/``. Each runs as a subprocess from the repository root and the test
fails with its output. The tools come with the ``test`` extra; where one is missing its test skips.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINTED = ["tierckpt", "restore", "tools", "tests"]


def _run(tool: str, *args: str, timeout: float = 600) -> None:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{tool} {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"


def test_ruff_check():
    _run("ruff", "check", "--no-cache", *LINTED)


def test_ruff_format():
    _run("ruff", "format", "--check", "--no-cache", *LINTED)


def test_mypy():
    _run("mypy")  # files and options: [tool.mypy] in pyproject.toml
