"""The gateway's import graph has no circle, its stages import only downwards (but for a shrinking
list), and the product never imports its bench.

Why a test: a circle between modules is how the request path's shape tangled before (app,
proxy, cost meter and admin importing each other), and a product that imports its bench
ships the simulator and matplotlib. Every import counts, at module level, under
``TYPE_CHECKING`` or inside a function: a circle in types is a circle in design.

The stage order (``STAGE_ORDER``) is issue 29's walls: ``UPWARD_TODAY`` lists the imports that
still climb, each a wall to build, and may only shrink.

Run it alone (``pytest tests/test_import_graph.py``) or as a script
(``python -m tests.test_import_graph``) to print the graph's circles.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from loadtests.proofs.architecture import circles, imported, stage
from loadtests.proofs.architecture import modules as package_modules

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = "gateway"
BENCH = "loadtests"


def modules(package: str) -> dict[str, Path]:
    """Every module of ``package`` by dotted name."""
    return package_modules(ROOT, package)


def import_graph(package: str) -> dict[str, set[str]]:
    """Module to the modules of the same package it imports."""
    found = modules(package)
    return {
        name: {target for target in imported(path) if target in found and target != name}
        for name, path in found.items()
    }


def test_the_gateway_s_modules_import_each_other_without_a_circle() -> None:
    assert circles(import_graph(PRODUCT)) == []


def test_the_gateway_never_imports_the_bench() -> None:
    offenders = {
        name: sorted(t for t in imported(path) if t == BENCH or t.startswith(BENCH + "."))
        for name, path in modules(PRODUCT).items()
    }
    assert {name: targets for name, targets in offenders.items() if targets} == {}


def test_the_table_of_engine_kinds_imports_only_the_kinds_enum() -> None:
    """Every stage reads ``gateway/engines.py``; importing more than ``BackendKind`` would make
    it a stage of its own, and a circle waiting to happen."""
    assert set(import_graph(PRODUCT)["gateway.engines"]) == {"gateway.policy.model"}


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


# The stages, bottom to top: a module may import its own stage and the ones below it. A stage is a
# folder of gateway/, or a module at its top (issue 29). ``gateway`` is the package itself.
STAGE_ORDER = (
    "gateway",
    "errors",
    "clock",
    "settings",
    "policy",
    "engines",
    "kv_events",
    "shared",
    "limitstore",
    "telemetry",
    "request",
    "dialects",
    "types",
    "admission",
    "dispatch",
    "routing",
    "fleet",
    "upstream",
    "responses",
    "runtime",
    "pipeline",
    "shadow",
    "rollout",
    "server",
    "service",
    "app",
    "workers",
    "cli",
    "__main__",
)
UPWARD_TODAY: frozenset[tuple[str, str]] = frozenset()
"""The upward imports there still are (module, imported module; without ``gateway.``): each is a
wall still to build (a value type to move down, a check to move up). A new one fails the test; so
does an entry that is gone, so that the list only shrinks."""


def upward_imports() -> set[tuple[str, str]]:
    found = modules(PRODUCT)
    rank = {name: i for i, name in enumerate(STAGE_ORDER)}
    return {
        (name.removeprefix(f"{PRODUCT}."), target.removeprefix(f"{PRODUCT}."))
        for name, path in found.items()
        for target in imported(path)
        if target in found and stage(target) != stage(name) and rank[stage(target)] > rank[stage(name)]
    }


def test_every_stage_has_its_place_in_the_order() -> None:
    stages = {stage(name) for name in modules(PRODUCT)}
    assert stages - set(STAGE_ORDER) == set(), "a new stage: give it its place in STAGE_ORDER"


def test_no_module_imports_a_stage_above_its_own_but_the_ones_listed() -> None:
    upward = upward_imports()
    assert sorted(upward - UPWARD_TODAY) == [], "an import up the stages: move the value down or the check up"
    assert sorted(UPWARD_TODAY - upward) == [], "an upward import is gone: take it off UPWARD_TODAY"


def test_the_gateway_s_own_commands_load_no_bench_module() -> None:
    """``serve`` and ``policy`` run without the bench (the runtime image ships without it)."""
    script = (
        "import sys; from gateway.cli import main; "
        "code = main(['policy', 'validate', 'policies/demo.yaml']); "
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'loadtests'); "
        "print(loaded); sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


if __name__ == "__main__":
    for circle in circles(import_graph(PRODUCT)):
        print(" -> ".join(circle))
