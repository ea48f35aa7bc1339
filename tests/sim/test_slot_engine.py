"""A simulated engine with llama.cpp's slot-scoped cache, served on a loopback port and driven by
the OpenAI SDK: a conversation's next turn finds its history cached in its slot, a fifth prompt
through four slots takes the least recently used one, and ``sim`` takes free ports as a list."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest

from loadtests.sim import build_engine_app
from loadtests.sim.cli import register
from tests.servers import serve_in_thread

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def _cached(client: openai.OpenAI, messages: list[dict[str, str]]) -> tuple[int, str]:
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert answer.usage is not None
    details = answer.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0, answer.choices[0].message.content or ""


def test_a_conversation_finds_its_history_in_its_slot_until_the_slot_is_reused() -> None:
    app = build_engine_app("llama-3.1-8b-h100", time_scale=0.05, cache_scope="slots", max_num_seqs=2)
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        first = [{"role": "system", "content": _words("s", 300)}, {"role": "user", "content": "hello"}]
        cached, reply = _cached(client, first)
        assert cached == 0
        second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
        cached, _ = _cached(client, second)
        assert cached >= 300, "the next turn reuses the slot that ran the first"
        for tag in ("x", "y"):  # two other prompts take both slots (the least recently used first)
            _cached(client, [{"role": "user", "content": _words(tag, 300)}])
        cached, _ = _cached(client, second)
        assert cached < 10, "a prefix is gone once its slot ran another prompt (the template's first tokens stay)"
        probe = httpx.post(url + "/debug/prefix_cache", json={"model": MODEL, "messages": second}).json()
        assert probe["cached_tokens"] > 300, "the repeat is in a slot again"


def test_the_pool_scope_keeps_a_prefix_past_its_slot() -> None:
    app = build_engine_app("llama-3.1-8b-h100", time_scale=0.05, max_num_seqs=2)
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        first = [{"role": "user", "content": _words("s", 300)}]
        _cached(client, first)
        for tag in ("x", "y"):
            _cached(client, [{"role": "user", "content": _words(tag, 300)}])
        cached, _ = _cached(client, first)
        assert cached >= 288


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["sim", "--profile", "llama-3.1-8b-h100", *argv])


def test_sim_takes_a_list_of_ports_and_a_cache_scope() -> None:
    args = _parse(["--ports", "40001,40007", "--cache-scope", "slots", "--max-num-seqs", "4"])
    assert (args.ports, args.cache_scope, args.max_num_seqs) == ([40001, 40007], "slots", 4)
    with pytest.raises(SystemExit):
        _parse(["--ports", "40001,x"])
    with pytest.raises(SystemExit):
        _parse(["--port", "40001", "--ports", "40002"])
