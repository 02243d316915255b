"""The package's import graph, read from the source (every import, a function's lazy ones included): no module
imports a module that imports it, directly or through others, and the top level stays small."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "fedlowrank"


def modules() -> dict[str, Path]:
    """``{"fedlowrank.x.y": file}`` for every module; a package is its ``__init__.py``."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports (``from a import b`` counts ``a`` and ``a.b`` when it is one)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            targets = [module, *(f"{module}.{a.name}" for a in node.names)]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_no_module_imports_a_module_that_imports_it():
    mods = modules()
    graph = {name: imported(name, path, set(mods)) for name, path in mods.items()}
    assert len(graph) > 100 and sum(map(len, graph.values())) > 200  # the graph was read
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_at_most_twelve_top_level_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top


def test_run_directories_and_the_runner_choice_import_no_runner_and_no_torch():
    """``fedlowrank.runtime`` (where runners are chosen) and its run directories load no runner and no torch."""
    code = ("import sys, fedlowrank.runtime, fedlowrank.runtime.rundir\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('fedlowrank.')))")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "['fedlowrank.runtime', 'fedlowrank.runtime.rundir']", res.stdout + res.stderr
