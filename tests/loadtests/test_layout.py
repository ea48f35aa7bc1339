"""The bench's three layers (``loadtests/__init__.py``): proofs on the harness on the commands.

Why a test: the commands (``sim/``, ``loadgen/``, ``whatif/``) ship with the ``bench`` extra and run
from an installation, where a proof's or the harness's imports (a bench's private Redis) have no
business; and a harness that imports a proof ties every test using a proxy to one bench's setup.
No module of the bench, whatever its layer, imports the test suite (``tests``): a proof that did
ran only from a checkout with the suite's fixtures (and pytest) importable, and a proof's driver
run in a baseline tree found that tree's suite, not this one's. What a proof and a test both need
lives in the harness, and the tests import it from there. Every import counts, as in
``tests/test_import_graph.py``: at module level or in a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

from loadtests.proofs.architecture import imported, modules

ROOT = Path(__file__).resolve().parents[2]
BENCH = "loadtests"
COMMANDS = ("sim", "loadgen", "whatif")
FORBIDDEN = {"command": ("proofs", "harness"), "harness": ("proofs",), "proof": ()}
"""What each layer may not import (folders of ``loadtests/``)."""
SUITE = "tests"
"""What no module of the bench may import, in any layer: the test suite."""


def layer(module: str) -> str:
    """``proof``, ``harness`` or ``command``; ``top`` for a module beside the folders."""
    parts = module.split(".")
    folder = parts[1] if len(parts) > 1 else ""
    return {"proofs": "proof", "harness": "harness"}.get(folder, "command" if folder in COMMANDS else "top")


def offences(root: Path) -> dict[str, list[str]]:
    """Each module of ``root``'s bench that imports a layer it may not, or the tests, with what it imports."""
    found = {}
    for name, path in modules(root, BENCH).items():
        if name == BENCH:
            continue
        banned = (*(f"{BENCH}.{folder}" for folder in FORBIDDEN.get(layer(name), ())), SUITE)
        bad = sorted({t for t in imported(path) if any(t == b or t.startswith(b + ".") for b in banned)})
        if bad:
            found[name] = bad
    return found


def test_no_module_stays_beside_the_layers() -> None:
    top = sorted(name for name in modules(ROOT, BENCH) if name != BENCH and layer(name) == "top")
    assert top == [], "a bench module belongs in proofs/, harness/ or a command's package"


def test_commands_import_neither_the_harness_nor_a_proof_the_harness_no_proof_and_none_the_tests() -> None:
    assert offences(ROOT) == {}


def test_an_import_across_the_layers_is_found(tmp_path: Path) -> None:
    (tmp_path / BENCH / "whatif").mkdir(parents=True)
    (tmp_path / BENCH / "harness").mkdir()
    (tmp_path / BENCH / "proofs").mkdir()
    (tmp_path / BENCH / "whatif" / "stage.py").write_text("from loadtests.harness.processes import process\n")
    (tmp_path / BENCH / "harness" / "proxy.py").write_text("def f():\n    from loadtests import proofs\n")
    (tmp_path / BENCH / "proofs" / "bench.py").write_text("import loadtests.harness.proxy\nimport loadtests.whatif\n")
    # the tests, from any layer, at module level or in a function; a name that only starts so is no offence
    (tmp_path / BENCH / "proofs" / "outage.py").write_text("from tests.servers import wait_until\nimport testsuite\n")
    (tmp_path / BENCH / "harness" / "redis.py").write_text("def f():\n    import tests.limitstore.redis_server\n")
    (tmp_path / BENCH / "whatif" / "replay.py").write_text("from tests import policy_builder\n")
    assert offences(tmp_path) == {
        "loadtests.whatif.stage": ["loadtests.harness.processes", "loadtests.harness.processes.process"],
        "loadtests.harness.proxy": ["loadtests.proofs"],
        "loadtests.proofs.outage": ["tests.servers", "tests.servers.wait_until"],
        "loadtests.harness.redis": ["tests.limitstore.redis_server"],
        "loadtests.whatif.replay": ["tests", "tests.policy_builder"],
    }


def test_every_proof_runs_as_a_module() -> None:
    """A proof is what ``python -m loadtests.proofs.<name>`` runs: each has its ``__main__`` block."""
    proofs = {name: path for name, path in modules(ROOT, BENCH).items() if layer(name) == "proof"}
    assert proofs, "no proof found: the layout changed under this test"
    silent = sorted(name for name, path in proofs.items() if not path.name.startswith("__") and not _runs(path))
    assert silent == []


def _runs(path: Path) -> bool:
    return any(
        isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in ast.parse(path.read_text()).body
    )
