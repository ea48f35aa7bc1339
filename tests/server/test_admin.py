"""The admin endpoints parse as strictly as the data plane, on the real operator listener.

A gateway with an admin key and a model group under a rollout (two simulated engines) serves
each test; an admin call that was accepted before (the first of two ``Authorization`` lines,
the last of two ``action`` keys, a reason that forged a log line, a body of any size) is now
refused with the data plane's error, and a well-formed one still forces its verdict.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from loadtests.sim import build_engine_app
from tests.conftest import StartGateway
from tests.policy_builder import KEY_ACME, admin_keys, backend, build_policy, model, tenant
from tests.servers import admin_url, serve_in_thread

ADMIN_KEY = "admin-key-bounds"
GROUP = "llama"
AUTH = (b"authorization", f"Bearer {ADMIN_KEY}".encode())
BODY_LIMIT = 65_536
"""What an admin body may hold (``gateway.server.admin.MAX_BODY_BYTES``)."""
FORGED = "2026-01-01 00:00:00 WARNING gateway.rollout.controller rollout of llama: promote by operator:ceo"


@pytest.fixture
def admin(start_gateway: StartGateway, tmp_path: Path) -> Iterator[str]:
    """The operator listener of a gateway whose group ``llama`` is under a rollout."""
    with ExitStack() as stack:
        urls = [
            stack.enter_context(serve_in_thread(build_engine_app("fixed", model=f"served-{n}", ttft_ms=1, itl_ms=1)))
            for n in "ab"
        ]
        text = build_policy(
            version="admin-bounds",
            models=[model("v1", upstream_name="served-a"), model("v2", upstream_name="served-b")],
            backends=[
                backend("engine-a", urls[0], ["v1"], kind="sim"),
                backend("engine-b", urls[1], ["v2"], kind="sim"),
            ],
            model_groups=[
                {
                    "name": GROUP,
                    "targets": [{"model": "v1"}, {"model": "v2"}],
                    "rollout": {"baseline": "v1", "candidate": "v2", "steps": [20, 100], "interval_s": 60},
                }
            ],
            tenants=[tenant("acme", KEY_ACME)],
            admin=admin_keys(ADMIN_KEY),
        )
        url = stack.enter_context(start_gateway(text, health_checks=False, rollout_dir=str(tmp_path)))
        yield admin_url(url)


def order(url: str, content: bytes | Any, headers: list[tuple[bytes, bytes]] | None = None) -> httpx.Response:
    """``POST /admin/rollout`` with ``content`` as the body, raw."""
    sent = [AUTH, (b"content-type", b"application/json"), *(headers or [])]
    return httpx.post(f"{url}/admin/rollout", content=content, headers=sent, timeout=10)


def refused(answer: httpx.Response, status: int, code: str, param: str | None) -> None:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert error["message"]


def test_a_second_authorization_line_is_refused_as_the_data_plane_refuses_it(admin: str) -> None:
    for second in (f"Bearer {ADMIN_KEY}-not", f"Bearer {ADMIN_KEY}"):
        answer = httpx.get(f"{admin}/admin/policy", headers=[AUTH, (b"authorization", second.encode())])
        refused(answer, 400, "duplicate_header", "authorization")


def test_a_key_repeated_in_the_body_is_refused_not_the_last_one_applied(admin: str) -> None:
    body = b'{"group": "llama", "action": "hold", "action": "rollback"}'
    refused(order(admin, body), 400, "duplicate_key", None)
    status = httpx.get(f"{admin}/admin/rollout", headers=[AUTH]).json()["rollouts"][0]
    assert status["state"]["status"] == "progressing"  # neither hold nor rollback happened


@pytest.mark.parametrize(
    ("fields", "headers", "param"),
    [
        pytest.param({"reason": f"pager\n{FORGED}"}, [], "reason", id="a line break in the reason"),
        pytest.param({"reason": f"pager\r{FORGED}"}, [], "reason", id="a carriage return in the reason"),
        pytest.param({"reason": "pager \x1b[2K\x1b[1Fall good"}, [], "reason", id="a terminal escape in the reason"),
        pytest.param({"reason": f"pager\u2028{FORGED}"}, [], "reason", id="a Unicode line separator in the reason"),
        pytest.param({"reason": "r" * 501}, [], "reason", id="a reason over 500 characters"),
        pytest.param({}, [(b"x-operator", b"sre\x85" + FORGED.encode())], "x-operator", id="a C1 line break as name"),
        pytest.param({}, [(b"x-operator", b"o" * 65)], "x-operator", id="a name over 64 characters"),
        pytest.param({}, [(b"x-operator", b"sre"), (b"x-operator", b"ceo")], "x-operator", id="two names"),
    ],
)
def test_what_would_reach_the_log_line_must_be_one_short_printable_line(
    admin: str,
    caplog: pytest.LogCaptureFixture,
    fields: dict[str, str],
    headers: list[tuple[bytes, bytes]],
    param: str,
) -> None:
    answer = order(admin, orjson.dumps({"group": GROUP, "action": "hold", **fields}), headers)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert not [r for r in caplog.records if r.name.startswith("gateway.rollout")]


@pytest.mark.parametrize(
    "chunked",
    [pytest.param(False, id="declared in its Content-Length"), pytest.param(True, id="sent chunked")],
)
def test_a_body_over_64_kib_is_refused_with_413_while_it_is_read(admin: str, chunked: bool) -> None:
    body = b'{"group": "llama", "action": "hold"}' + b" " * (4 * BODY_LIMIT)  # JSON may end in spaces
    content = iter([body[i : i + 16384] for i in range(0, len(body), 16384)]) if chunked else body
    refused(order(admin, content), 413, "request_too_large", None)


def test_a_well_formed_order_still_forces_its_verdict_and_logs_one_line(
    admin: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.rollout"):
        answer = order(admin, b'{"group": "llama", "action": "hold", "reason": "p99 up"}', [(b"x-operator", b"sre-1")])
    assert answer.status_code == 200, answer.text
    assert answer.json()["state"]["status"] == "holding"
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith("gateway.rollout")]
    assert "by operator:sre-1" in line
    assert line.endswith("by sre-1: p99 up")
