"""What routing on an engine's KV events costs per request: the engine's token ids and block hashes.

Usage::

    python -m loadtests.proofs.engine_keys_cost --tokenizer PATH/tokenizer.json [--chat-template FILE]
        [--algorithms sha256,sha256_cbor] [--repeats 200] [--out loadtests/results/routing-truth/keys_cost.txt]

To route on an engine's own index (``gateway/routing/engine_view.py``) the gateway computes, once
per request, what the engine computes: the chat template rendered (``gateway/request/chat_template.py``),
the text tokenized (Hugging Face ``tokenizers``, Rust), and the chain of block hashes
(``gateway/kv_events/engine_hashes.py``, vLLM's algorithm). This measures each step, in one
process on the event loop's thread as the gateway runs it, for chat prompts of several sizes
(a system prompt and a conversation of user and assistant turns, prose-like text), and prints
the median and P99 per request. "next turn (cached)" is what the gateway pays: the same prompt's
ids through ``SegmentEncoder`` once the turn before (all but its last message) was seen, so only
the new message is tokenized (``gateway/request/segment_encoder.py``; its first
``VERIFY_FIRST`` texts, also encoded whole to check it, are spent before measuring). Without
``--chat-template`` Llama 3's template is used (``LLAMA3_TEMPLATE``, its header and end-of-turn
tokens being the Llama 3 tokenizer's added tokens); with the simulator's ChatML template and a
tokenizer that does not know ``<|im_start|>``, nothing splits and nothing is cached. The figures
are a property of the tokenizer and template: pass the model's own.

(With ``loadtests/proofs/overhead.py --tokenizer PATH`` the character estimate's replacement by
the tokenizer is measured through a running gateway; this is the part that routing on events adds.)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from gateway.kv_events.engine_hashes import EngineBlockHasher, EngineHashing, HashAlgorithm
from gateway.request.chat_template import ChatTemplate
from gateway.request.engine_tokens import EngineTokenizer, engine_prompt_ids
from gateway.request.segment_encoder import VERIFY_FIRST, SegmentEncoder

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama 3.1's chat template, without its tool and date preamble."""
WORDS = [
    "the",
    "order",
    "was",
    "shipped",
    "on",
    "monday",
    "and",
    "should",
    "arrive",
    "within",
    "three",
    "working",
    "days",
    "unless",
    "the",
    "carrier",
    "reports",
    "a",
    "delay",
    "at",
    "the",
    "regional",
    "depot",
    "where",
    "parcels",
    "are",
    "sorted",
    "before",
    "the",
    "last",
    "mile",
    "delivery",
    "customers",
    "may",
    "ask",
    "for",
    "a",
    "refund",
    "when",
    "the",
    "parcel",
    "is",
    "lost",
    "or",
    "damaged",
    "and",
    "support",
    "answers",
    "politely",
]


def conversation(tokens_wanted: int, seed: int) -> list[dict[str, str]]:
    """A system prompt and turns of about ``tokens_wanted`` tokens in all (~1.3 tokens a word)."""
    rng = random.Random(seed)
    words = max(8, int(tokens_wanted / 1.3))

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."

    messages = [{"role": "system", "content": text(words // 3)}]
    turns = max(1, (words - words // 3) // 120)
    for turn in range(turns):
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": text(120)})
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": text(20)})
    return messages


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    engine_tokenizer: EngineTokenizer, hashers: dict[str, EngineBlockHasher], size: int, repeats: int
) -> dict[str, Any]:
    template = engine_tokenizer.template
    assert template is not None
    render_s, tokenize_s, ids_s, next_turn_s = [], [], [], []
    encoder = SegmentEncoder(engine_tokenizer.tokenizer)
    for i in range(VERIFY_FIRST):  # past the encoder's first checks, as a gateway is after its first requests
        encoder.encode(f"<|start_header_id|>user<|end_header_id|>\n\nwarm up {i}<|eot_id|>")
    cached = EngineTokenizer(engine_tokenizer.tokenizer, template, encoder)
    hash_s: dict[str, list[float]] = {name: [] for name in hashers}
    tokens = 0
    for i in range(repeats):
        messages = conversation(size, i)
        body: dict[str, Any] = {"model": "m", "messages": messages}
        t0 = time.perf_counter()
        text = template.render(messages)
        t1 = time.perf_counter()
        engine_tokenizer.tokenizer.encode(text, add_special_tokens=False)
        t2 = time.perf_counter()
        ids = engine_prompt_ids(body, "chat", engine_tokenizer)
        t3 = time.perf_counter()
        assert ids is not None
        tokens += len(ids)
        previous = {"model": "m", "messages": [*messages[:-1], {"role": "user", "content": "Hello."}]}
        engine_prompt_ids(previous, "chat", cached)  # the turn before: its messages' pieces cached
        t5 = time.perf_counter()
        again = engine_prompt_ids(body, "chat", cached)
        next_turn_s.append(time.perf_counter() - t5)
        assert again == ids
        render_s.append(t1 - t0)
        tokenize_s.append(t2 - t1)
        ids_s.append(t3 - t2)
        for name, hasher in hashers.items():
            t4 = time.perf_counter()
            hasher.block_hashes(ids, cache_salt="0123456789abcdef0123456789abcdef")
            hash_s[name].append(time.perf_counter() - t4)
    row: dict[str, Any] = {
        "tokens": tokens // repeats,
        "render": render_s,
        "tokenize": tokenize_s,
        "ids (render + tokenize)": ids_s,
        "ids, next turn (cached)": next_turn_s,
    }
    for name, values in hash_s.items():
        row[f"hash {name}"] = values
        row[f"per request {name}"] = [a + b for a, b in zip(next_turn_s, values, strict=True)]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    parser.add_argument("--chat-template", default=None, help="a .jinja file or tokenizer_config.json")
    parser.add_argument("--algorithms", default="sha256,sha256_cbor")
    parser.add_argument("--sizes", default="1000,4000,16000", help="prompt sizes in tokens, about")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    tokenizer = Tokenizer.from_file(args.tokenizer)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    template = (
        ChatTemplate.from_file(args.chat_template)
        if args.chat_template
        else ChatTemplate(LLAMA3_TEMPLATE, source="llama3", special_tokens={"bos_token": "<|begin_of_text|>"})
    )
    engine_tokenizer = EngineTokenizer(tokenizer, template)
    hashers = {
        name: EngineBlockHasher(EngineHashing(algorithm=HashAlgorithm(name), seed="0", block_size=16))
        for name in args.algorithms.split(",")
    }
    lines = [
        f"# python -m loadtests.proofs.engine_keys_cost {' '.join(sys.argv[1:] if argv is None else argv)}",
        f"tokenizer {Path(args.tokenizer).name} ({tokenizer.get_vocab_size()} ids), template "
        f"{Path(args.chat_template).name if args.chat_template else 'Llama 3'}, {args.repeats} prompts a size; "
        "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "",
        f"{'step':<28}{'tokens':>8}{'P50 ms':>10}{'P99 ms':>10}{'us/1k tokens (P50)':>22}",
    ]
    for size in (int(s) for s in args.sizes.split(",")):
        row = measure(engine_tokenizer, hashers, size, args.repeats)
        tokens = row.pop("tokens")
        for step, values in row.items():
            p50 = statistics.median(values)
            lines.append(
                f"{step:<28}{tokens:>8}{p50 * 1e3:>10.3f}{percentile(values, 0.99) * 1e3:>10.3f}"
                f"{p50 * 1e6 / tokens * 1000:>22.1f}"
            )
        lines.append("")
    lines.append("load average at the end " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
