"""Policy hot reload on real files: validate first, swap once, keep the last good policy.

Each test writes the session gateway's policy (``tests/policy_builder.py``) to ``tmp_path`` and
edits it; the watch loop is exercised one step at a time through ``poll()``, and once for real.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from gateway.policy.loader import PolicyError
from gateway.policy.snapshot import PolicySnapshot, content_digest
from gateway.policy.watch import PolicySource, ReloadOutcome
from gateway.service import POLICY_LOADER, load_policy
from tests.policy_builder import session_policy

VALID = session_policy()
NEXT = session_policy(version="test-2")
INVALID = session_policy(version="test-3", surprise=1)
UNREADABLE = VALID.replace("version: test-1", "version: [")  # a write cut short


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(VALID)
    return path


def write(path: Path, text: str, *, mtime_ns: int | None = None) -> None:
    path.write_text(text)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


async def eventually(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5.0
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize(
    ("text", "outcome", "version", "error"),
    [
        (NEXT, ReloadOutcome.OK, "test-2", None),
        (VALID, ReloadOutcome.UNCHANGED, "test-1", None),
        (INVALID, ReloadOutcome.INVALID, "test-1", r"policy\.yaml:\d+:1: surprise: unknown key"),
        (UNREADABLE, ReloadOutcome.INVALID, "test-1", r"policy\.yaml:\d+:\d+: not valid YAML"),
        (None, ReloadOutcome.INVALID, "test-1", r"policy\.yaml: cannot read: No such file or directory"),
    ],
    ids=[
        "a valid new policy is swapped in",
        "the same bytes are unchanged",
        "an invalid policy is rejected and the old one stays",
        "broken YAML is rejected and the old one stays",
        "a missing file is rejected and the old one stays",
    ],
)
def test_reload(policy_file: Path, text: str | None, outcome: ReloadOutcome, version: str, error: str | None) -> None:
    source = PolicySource(policy_file, POLICY_LOADER)
    before = source.current()
    swapped: list[PolicySnapshot] = []
    source.subscribe(swapped.append)
    if text is None:
        policy_file.unlink()
    else:
        write(policy_file, text)
    result = source.reload("test")
    assert (result.outcome, result.version, result.reason) == (outcome, version, "test")
    assert result.digest == source.current().digest
    assert (result.error is None) == (error is None)
    if error is not None:
        assert result.error is not None
        assert re.search(error, result.error), result.error
        assert source.current() is before
    assert swapped == ([source.current()] if outcome is ReloadOutcome.OK else [])
    counts = (source.reloads_ok, source.reloads_invalid, source.reloads_unchanged)
    assert counts == {"ok": (1, 0, 0), "invalid": (0, 1, 0), "unchanged": (0, 0, 1)}[outcome.value]
    assert source.last_result == result


def test_a_request_keeps_the_snapshot_it_started_with(policy_file: Path) -> None:
    source = PolicySource(policy_file, POLICY_LOADER)
    in_flight = source.current()
    write(policy_file, NEXT)
    source.reload("test")
    assert (in_flight.version, source.current().version) == ("test-1", "test-2")


def test_an_invalid_initial_policy_refuses_to_start(policy_file: Path) -> None:
    write(policy_file, INVALID)
    with pytest.raises(PolicyError, match="surprise: unknown key"):
        PolicySource(policy_file, POLICY_LOADER)


def test_digests_match_the_loaders(policy_file: Path) -> None:
    assert content_digest(policy_file.read_bytes()) == load_policy(policy_file).digest


def test_poll_reloads_each_change_once(policy_file: Path) -> None:
    source = PolicySource(policy_file, POLICY_LOADER)
    assert source.poll() is None  # nothing changed since the load
    write(policy_file, NEXT)
    result = source.poll()
    assert result is not None
    assert result.outcome is ReloadOutcome.OK
    assert source.poll() is None
    write(policy_file, INVALID)
    result = source.poll()
    assert result is not None
    assert result.outcome is ReloadOutcome.INVALID
    assert source.poll() is None  # a bad file is reported once, not every second
    assert source.last_error is not None
    write(policy_file, NEXT)
    result = source.poll()
    assert result is not None
    assert result.outcome is ReloadOutcome.UNCHANGED
    assert source.last_error is None
    assert (source.reloads_ok, source.reloads_invalid, source.reloads_unchanged) == (1, 1, 1)


@pytest.mark.parametrize(
    ("age_s", "noticed"),
    [(0.0, True), (10.0, False)],
    ids=[
        "a same-size rewrite within the same timestamp is noticed while the file is young",
        "an old file whose stat did not change is not read again",
    ],
)
def test_poll_rereads_racily_clean_files(policy_file: Path, age_s: float, noticed: bool) -> None:
    mtime_ns = time.time_ns() - int(age_s * 1e9)
    write(policy_file, VALID, mtime_ns=mtime_ns)
    source = PolicySource(policy_file, POLICY_LOADER)
    assert source.poll() is None
    write(policy_file, session_policy(version="test-9"), mtime_ns=mtime_ns)  # same size, same mtime
    result = source.poll()
    assert (result is not None and result.outcome is ReloadOutcome.OK) is noticed


def test_listeners_run_in_order_and_a_failing_one_does_not_stop_the_swap(policy_file: Path) -> None:
    source = PolicySource(policy_file, POLICY_LOADER)
    calls: list[str] = []

    def broken(snapshot: PolicySnapshot) -> None:
        calls.append("broken")
        raise RuntimeError("boom")

    source.subscribe(broken)
    unsubscribe = source.subscribe(lambda s: calls.append(s.version))
    write(policy_file, NEXT)
    assert source.reload("test").outcome is ReloadOutcome.OK
    assert calls == ["broken", "test-2"]
    assert source.listener_errors == 1
    unsubscribe()
    write(policy_file, VALID)
    source.reload("test")
    assert calls == ["broken", "test-2", "broken"]


async def run_until(task: Awaitable[None], done: Callable[[], bool]) -> None:
    running = asyncio.ensure_future(task)
    try:
        await eventually(done)
    finally:
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running


async def test_watch_picks_up_a_change(policy_file: Path) -> None:
    source = PolicySource(policy_file, POLICY_LOADER)
    write(policy_file, NEXT)
    await run_until(source.watch(0.01), lambda: source.reloads_ok == 1)
    assert source.current().version == "test-2"


async def test_sighup_reloads(policy_file: Path) -> None:
    source = PolicySource(policy_file, POLICY_LOADER)
    loop = asyncio.get_running_loop()
    source.install_sighup(loop)
    try:
        write(policy_file, NEXT)
        os.kill(os.getpid(), signal.SIGHUP)
        await eventually(lambda: source.reloads_ok == 1)
    finally:
        source.remove_sighup(loop)
    assert source.last_result is not None
    assert source.last_result.reason == "SIGHUP"
    assert repr(source) == f"PolicySource({str(policy_file)!r}, version='test-2')"


SHARED_LLAMA = session_policy(backends={"fake": {"kind": "llamacpp"}})
"""The test policy with its backend an unsalted engine that both tenants reach: one warning."""


@pytest.mark.parametrize(
    ("first", "then", "logged"),
    [
        pytest.param(SHARED_LLAMA, NEXT, [("test-1", "backends[fake]: 'fake' (llamacpp)")], id="at start"),
        pytest.param(
            VALID,
            session_policy(version="test-2", backends={"fake": {"kind": "llamacpp"}}),
            [("test-2", "backends[fake]: 'fake' (llamacpp)")],
            id="at a reload",
        ),
        pytest.param(VALID, NEXT, [], id="never for a policy without any"),
    ],
)
def test_the_warnings_of_a_policy_are_logged_when_it_comes_into_force(
    policy_file: Path, caplog: pytest.LogCaptureFixture, first: str, then: str, logged: list[tuple[str, str]]
) -> None:
    write(policy_file, first)
    with caplog.at_level("WARNING", logger="gateway.policy.watch"):
        source = PolicySource(policy_file, POLICY_LOADER)
        write(policy_file, then)
        assert source.reload("test").outcome is ReloadOutcome.OK
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(lines) == len(logged)
    for line, (version, start) in zip(lines, logged, strict=True):
        at = rf"policy version {version}: {re.escape(str(policy_file))}:\d+:\d+: warning: "
        assert re.match(rf"{at}{re.escape(start)} cannot salt its prefix cache", line), line
