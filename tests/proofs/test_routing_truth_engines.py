"""The engine-truth bench's engines (``loadtests/proofs/routing_truth_engines.py``): the tokenizer the
engines and the gateway share, and how every engine is started. No engine is started here."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from loadtests.proofs.routing_truth import _syllables
from loadtests.proofs.routing_truth_engines import CHAT_TEMPLATE, UNKNOWN, Engines, main, write_tokenizer
from loadtests.sim.tokenizer import count_tokens, output_text


@pytest.fixture
def tokenizer(tmp_path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(write_tokenizer(tmp_path / "tokenizer.json")))


def test_the_bench_tokenizer_counts_a_prompt_as_the_simulator_does_one_word_one_token(tokenizer: Tokenizer) -> None:
    prompt = _syllables("seed", 500)
    encoding = tokenizer.encode(prompt)
    assert len(encoding.ids) == count_tokens(prompt) == 500
    assert UNKNOWN not in encoding.tokens


def test_the_simulators_replies_sent_back_as_history_are_words_it_knows(tokenizer: Tokenizer) -> None:
    reply = "".join(output_text(i) for i in range(60))
    encoding = tokenizer.encode(reply)
    assert len(encoding.ids) == count_tokens(reply) == 60
    assert UNKNOWN not in encoding.tokens


def test_chatml_markers_are_one_token_each_even_against_a_role_word(tokenizer: Tokenizer) -> None:
    encoding = tokenizer.encode("<|im_start|>system\nbab cad<|im_end|>\n<|im_start|>assistant\n")
    assert encoding.tokens == ["<|im_start|>", "system", "bab", "cad", "<|im_end|>", "<|im_start|>", "assistant"]


def test_a_word_outside_the_vocabulary_is_unknown_so_a_typo_in_the_bench_would_show(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("bab zzzz").tokens == ["bab", UNKNOWN]


def test_every_engine_counts_with_the_bench_tokenizer_and_publishes_its_events_on_ports_of_its_own(
    tmp_path: Path,
) -> None:
    engines = Engines.of(3, tmp_path / "tokenizer.json")
    options = [engines.options(i, 0.26, 4.0) for i in range(3)]
    for o in options:
        assert o[o.index("--tokenizer") + 1] == str(tmp_path / "tokenizer.json")
        assert o[o.index("--chat-template") + 1] == str(CHAT_TEMPLATE)
        assert o[o.index("--hash-seed") + 1] == "0"
        assert o[o.index("--hash-algo") + 1] == "sha256_cbor"  # not the simulator's default (vLLM's sha256)
    sockets = [o[o.index(flag) + 1] for o in options for flag in ("--kv-events", "--kv-events-replay")]
    assert len(set(sockets)) == 6


def test_the_tokenizer_is_written_where_asked_for_a_simulator_started_by_hand(tmp_path: Path) -> None:
    assert main([str(tmp_path / "t.json")]) == 0
    assert Tokenizer.from_file(str(tmp_path / "t.json")).encode("bab").tokens == ["bab"]
