"""Fixtures of the what-if tests: a policy for simulated engines, traces, and free loopback ports.

``whatif_policy(**sections)`` is a small policy as YAML text (``tests.policy_builder``): model
``sim-model``, backends ``sim-a`` and ``sim-b`` (their URLs are placeholders: a stage replaces
them by its engines), tenants ``acme`` (interactive) and ``globex`` (batch by default), classes
``interactive`` and ``batch``; each keyword edits one section as ``build_policy`` does.

``ports()`` gives the first of a block of free consecutive ports in this suite's range
(19100-19299), the block's operator ports (+1000) free as well: a stage puts its gateway on the
first and its engines on the next ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from loadtests.whatif.model import ReplayRequest
from loadtests.whatif.stage import free_port_base
from tests.policy_builder import NOWHERE, OMIT, backend, build_policy, model, tenant

MODEL = "sim-model"
PORT_RANGE = range(19100, 19300)
BLOCK_TOKENS = 16
SLOS = {
    "interactive": {"ttft_ms": 500, "itl_ms": 50, "e2e_ms": 30000},
    "batch": {"ttft_ms": 5000, "itl_ms": 200, "e2e_ms": 300000},
}


def whatif_policy(**sections: Any) -> str:
    """The what-if tests' policy (module docstring)."""
    base: dict[str, Any] = {
        "version": "whatif-test",
        "classes": {
            "interactive": {"rank": 0, "slo": SLOS["interactive"], "queue": {"max_depth": 64, "max_wait_s": 10}},
            "batch": {"rank": 1, "slo": SLOS["batch"], "queue": {"max_depth": 64, "max_wait_s": 60}},
        },
        "models": [model(MODEL, max_prompt_tokens=4096, max_output_tokens=256, routing={"strategy": "least_load"})],
        "backends": [
            backend(name, NOWHERE, [MODEL], kind="sim", price_per_gpu_hour=2.0, gpus=1) for name in ("sim-a", "sim-b")
        ],
        "tenants": [
            tenant("acme", "unused-a", limits={"rpm": 6000}),
            tenant("globex", "unused-g", default_class="batch"),
        ],
        "health_checks": {"interval_s": 0.2, "timeout_s": 1},
        "scrape": {"interval_s": 0.2, "timeout_s": 1},
        "limits": OMIT,
    }
    return build_policy(NOWHERE, base, **sections)


@pytest.fixture
def write_policy(tmp_path: Path) -> Callable[..., Path]:
    """``write_policy(**sections)``: ``whatif_policy(**sections)`` written to a file."""
    counter = iter(range(1000))

    def write(**sections: Any) -> Path:
        path = tmp_path / f"policy-{next(counter)}.yaml"
        path.write_text(whatif_policy(**sections))
        return path

    return write


def request(
    offset_s: float,
    *,
    tenant: str = "acme",
    class_name: str | None = None,
    stream: bool = True,
    prompt_tokens: int = 64,
    output_tokens: int = 8,
    hashes: Sequence[str] = (),
    session: str | None = None,
    think_s: float | None = None,
) -> ReplayRequest:
    """A trace request of ``MODEL`` with ``BLOCK_TOKENS``-token blocks."""
    return ReplayRequest(
        offset_s=offset_s,
        tenant=tenant,
        class_name=class_name,
        model=MODEL,
        stream=stream,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        block_tokens=BLOCK_TOKENS,
        prefix_hashes=tuple(hashes),
        session=session,
        think_s=think_s,
    )


@pytest.fixture
def ports() -> Callable[[int], int]:
    """``ports(count)``: the first of ``count`` free consecutive ports, never one handed out before
    in the same test (two stages started together must not pick the same block)."""
    given: list[int] = []

    def pick(count: int) -> int:
        first = free_port_base(count, PORT_RANGE, taken=given)
        given.extend(range(first, first + count))
        return first

    return pick
