"""``inference-gateway sim --answer-format ... --no-prompt-tokens-details``: the flags parse, and a
simulator started by the command line in a process of its own answers in the format asked for
(the formats themselves: ``test_usage_formats.py``)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtests.sim import SIM_MODEL_NAME
from loadtests.sim.cli import register
from tests.servers import free_port, wait_until

BODY = {"model": SIM_MODEL_NAME, "prompt": list(range(1000, 1100)), "max_tokens": 2}
CACHED = 96  # 100 prompt tokens seen before: 6 whole blocks of 16 before the last token


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["sim", "--profile", "fixed", "--port", "40001", *argv])


def test_the_default_is_vllm_with_prompt_tokens_details() -> None:
    args = _parse([])
    assert (args.answer_format, args.prompt_tokens_details) == ("vllm", True)
    args = _parse(["--answer-format", "llamacpp-legacy", "--no-prompt-tokens-details"])
    assert (args.answer_format, args.prompt_tokens_details) == ("llamacpp-legacy", False)
    with pytest.raises(SystemExit):
        _parse(["--answer-format", "sglang"])


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def _sim(*flags: str) -> Iterator[str]:
    """``python -m gateway sim`` with ``flags`` on a free port, until the block ends."""
    port = free_port()
    argv = [sys.executable, "-m", "gateway", "sim", "--profile", "fixed", "--ttft-ms", "1", "--itl-ms", "1"]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a child never blocks writing to it
        proc = subprocess.Popen([*argv, "--port", str(port), *flags], stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_until(lambda: _health(url) or proc.poll() is not None, 30, what="the simulator to answer")
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"the simulator exited {proc.returncode}: {log.read().decode(errors='replace')}")
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)


def _twice(url: str) -> dict[str, Any]:
    """The answer to a prompt sent a second time (a prefix hit)."""
    for _ in range(2):
        response = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_the_command_line_without_prompt_tokens_details_answers_as_vllm_without_the_flag() -> None:
    with _sim("--no-prompt-tokens-details") as url:
        answer = _twice(url)
    assert answer["usage"]["prompt_tokens_details"] is None
    assert "timings" not in answer


def test_the_command_line_answers_as_legacy_llamacpp() -> None:
    with _sim("--answer-format", "llamacpp-legacy") as url:
        answer = _twice(url)
    assert answer["usage"] == {"completion_tokens": 2, "prompt_tokens": 100, "total_tokens": 102}
    assert answer["timings"]["cache_n"] == CACHED


def test_the_command_line_answers_as_llamacpp() -> None:
    with _sim("--answer-format", "llamacpp") as url:
        answer = _twice(url)
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED}
    assert (answer["timings"]["cache_n"], answer["timings"]["prompt_n"]) == (CACHED, 100 - CACHED)


def test_llamacpp_has_no_prompt_tokens_details_switch() -> None:
    argv = [sys.executable, "-m", "gateway", "sim", "--profile", "fixed", "--port", str(free_port())]
    done = subprocess.run(
        [*argv, "--answer-format", "llamacpp", "--no-prompt-tokens-details"], capture_output=True, timeout=60
    )
    assert done.returncode != 0
    assert b"--no-prompt-tokens-details is vLLM's switch" in done.stderr
