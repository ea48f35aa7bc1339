"""The gateway's floor plan in figures: files at the top, import chain, circles between stages.

Usage::

    python -m loadtests.proofs.architecture [ROOT]        # ROOT: a checkout (default: this one)

Prints the modules of ``gateway/`` and their lines, the files at the top of ``gateway/`` (a
stage folder is not one), the longest import chain (its length is the import graph's number of
layers) and the chain itself, the circles between stages when each top-level module and each
folder counts as one node (a stage order exists only without them), and how many modules have a
test named after them (anywhere, and at the mirrored path). Every import counts, as in
``tests/test_import_graph.py``: at module level, under ``TYPE_CHECKING`` or inside a function.
Issue 29 asks for these before and after (run it on two checkouts: ``git worktree add /tmp/base
<commit>``).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path

PACKAGE = "gateway"


def modules(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``root`` by dotted name."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        found[".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def imported(path: Path) -> Iterator[str]:
    """Every dotted name ``path`` imports (``from a.b import c`` yields ``a.b`` and ``a.b.c``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def stage(module: str) -> str:
    """A module's stage: its folder under ``gateway/``, or itself at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                    found.append(sorted(component))
    return found


def stage_graph(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """The import graph with each stage one node (a stage's imports of itself left out)."""
    edges: dict[str, set[str]] = {}
    for source, targets in graph.items():
        edges.setdefault(stage(source), set()).update(stage(t) for t in targets if stage(t) != stage(source))
        for target in targets:
            edges.setdefault(stage(target), set())
    return edges


def stage_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles between stages: ``circles`` of the graph with each stage one node."""
    return circles(stage_graph(graph))


def longest_chain(graph: Mapping[str, set[str]]) -> list[str]:
    """The longest import chain of a graph without circles, from its top: its length is the layers."""

    @cache
    def depth(name: str) -> int:
        return 1 + max((depth(t) for t in graph[name]), default=0)

    chain = [max(graph, key=depth)]
    while graph[chain[-1]]:
        chain.append(max(graph[chain[-1]], key=depth))
    return chain


def report(root: Path) -> list[str]:
    found = modules(root)
    graph = {name: {t for t in imported(path) if t in found and t != name} for name, path in found.items()}

    chain = longest_chain(graph)
    top = [p for p in (root / PACKAGE).glob("*.py")]
    tests = {p.name for p in (root / "tests").rglob("test_*.py")}
    named = [p for p in found.values() if not p.name.startswith("__")]
    circles = stage_circles(graph)
    stage_lines: list[str] = []
    if not circles:
        path = longest_chain(stage_graph(graph))
        stage_lines = [f"layers with each stage one node: {len(path)}", "  " + " -> ".join(path)]
    return [
        f"modules: {len(found)}, {sum(len(p.read_text().splitlines()) for p in found.values()):,} lines",
        f"files at the top of gateway/: {len(top)}, {sum(len(p.read_text().splitlines()) for p in top):,} lines",
        f"longest import chain (layers): {len(chain)}",
        "  " + " -> ".join(m.removeprefix(f"{PACKAGE}.") for m in chain),
        "circles between stages: "
        + ("none" if not circles else "; ".join(f"{len(c)} stages: {', '.join(c)}" for c in circles)),
        *stage_lines,
        f"modules with a test named after them: {sum(f'test_{p.stem}.py' in tests for p in named)} of {len(named)}",
        f"modules with a test at the mirrored path: {sum(mirrored(root, p).exists() for p in named)} of {len(named)}",
    ]


def mirrored(root: Path, module: Path) -> Path:
    """Where a module's test lives when tests mirror the code: ``gateway/<stage>/<m>.py`` has
    ``tests/<stage>/test_<m>.py``, a module at the top ``tests/test_<m>.py``."""
    inside = module.relative_to(root / PACKAGE)
    return root / "tests" / inside.parent / f"test_{inside.name}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[2]))
    args = parser.parse_args(argv)
    sys.setrecursionlimit(10_000)
    print("\n".join(report(Path(args.root))))


if __name__ == "__main__":
    main()
