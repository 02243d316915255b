"""The README and docs/ as a newcomer reads them: every fenced Python block that follows a line ``<!-- runnable -->``
runs as written in a fresh process (from an empty working directory, offline, leaving nothing there); the README
stays within 250 lines, and its methods table lists exactly the registered methods."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedlowrank.methods import available_methods

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def marked_blocks() -> list[tuple[str, str]]:
    """``(file:line, code)`` of every block after a :data:`MARKER` line; a marker not followed by a ```python fence is
    a block whose code says so (the test fails on it)."""
    found = []
    for path in DOCUMENTS:
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARKER:
                continue
            where = f"{path.relative_to(ROOT)}:{i + 1}"
            if i + 1 >= len(lines) or lines[i + 1].strip() != "```python":
                found.append((where, f"raise SystemExit('{MARKER} is not followed by a ```python fence')"))
                continue
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
            found.append((where, "\n".join(lines[i + 2:end])))
    return found


BLOCKS = marked_blocks()


def test_the_readme_and_its_add_a_method_example_are_marked_runnable():
    assert [w for w, _ in BLOCKS if w.startswith("README.md")] and any("@register" in c for _, c in BLOCKS)


@pytest.mark.parametrize("where, code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_a_runnable_block_runs_as_written(where, code, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{where}:\n{proc.stderr[-3000:]}"
    assert not list(tmp_path.iterdir()), f"{where} left {sorted(p.name for p in tmp_path.iterdir())}"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_the_readme_methods_table_lists_every_registered_method():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = re.findall(r"^\| (?:\*\*)?`([a-z0-9-]+)`(?:\*\*)? \|", text, re.M)
    assert sorted(table) == sorted(available_methods())
