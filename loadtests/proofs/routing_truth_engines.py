"""The engines of the engine-truth bench: simulated engines that count with the bench's tokenizer and
publish their KV events, one process each so that one restarts alone.

Usage (the bench's tokenizer, e.g. to start a simulator by hand as the bench does)::

    python -m loadtests.proofs.routing_truth_engines tokenizer.json
    inference-gateway sim --profile llama-3.1-8b-h100 --tokenizer tokenizer.json \\
        --chat-template loadtests/sim/chat_template.jinja --hash-algo sha256_cbor --hash-seed 0 \\
        --kv-events tcp://127.0.0.1:5557 --kv-events-replay tcp://127.0.0.1:5558

Every mode of ``routing_truth`` runs on engines started alike (``Engines.options``): with the
bench's ``tokenizer.json`` (``write_tokenizer``), the simulator's ChatML template, ``sha256_cbor``
block hashes seeded ``"0"`` and their KV-event sockets, so that what differs between modes is the
gateway's policy alone.
The events mode's gateway is given the same tokenizer and template and each engine's sockets and
hashing (``Engines.kv_events``): it computes a request's block hashes as the engine does.

The tokenizer is a Hugging Face word-level model over the bench's words only: the syllables its
prompts are made of, the simulator's output words (replies come back as history), the ChatML
markers and roles, ``[UNK]`` for anything else (none of the bench's text). After a whitespace split
one word is one token, as the simulator's own tokenizer counts the same text, so the engines' load
is the one the first results (on the simulator's tokenizer) measured.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tokenizers import Tokenizer, models, pre_tokenizers

from loadtests.harness.processes import GATEWAY, free_port, stop, stop_all, wait_ready
from loadtests.proofs.routing_system import PROFILE
from loadtests.sim.profiles import BLOCK_SIZE
from loadtests.sim.tokenizer import _WORDS as SIM_WORDS

CHAT_TEMPLATE = Path(__file__).resolve().parents[1] / "sim" / "chat_template.jinja"
"""The simulator's ChatML template (``sim --chat-template``), which the gateway renders too."""
HASH_ALGORITHM = "sha256_cbor"
"""The engines' ``--hash-algo`` (vLLM's ``--prefix-caching-hash-algo``; its default is ``sha256``):
the reproducible one, which the events mode's policy names."""
HASH_SEED = "0"
"""The engines' ``--hash-seed`` (vLLM's ``PYTHONHASHSEED``): what lets the gateway compute their hashes."""
SYLLABLES = tuple(a + b + c for a in "bcdfghjklmnprstvz" for b in "aeiou" for c in "bdgklmnprst")
"""Three-letter words: one token each to the bench's tokenizer and the simulator's, and four
characters with the space, one token to the gateway's estimate (``prefix_keys.CHARS_PER_TOKEN``):
the index is sized in the engine's tokens, so that what it gets wrong is what it cannot see, not a
tokenizer's ratio."""
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant")
UNKNOWN = "[UNK]"


def vocabulary() -> list[str]:
    """The bench tokenizer's words in id order: ``[UNK]``, the ChatML markers and roles, the
    syllables of the prompts, the simulator's output words (the replies sent back as history)."""
    return list(dict.fromkeys([UNKNOWN, *SPECIAL_TOKENS, *ROLES, *SYLLABLES, *SIM_WORDS]))


def write_tokenizer(path: Path) -> Path:
    """Write the bench's ``tokenizer.json`` (Hugging Face ``tokenizers``): a word-level model over
    ``vocabulary()`` after a whitespace split, the ChatML markers as special tokens (split out
    wherever they stand, ``<|im_start|>system`` is two tokens). One word, one token: the count the
    simulator's own tokenizer gives the bench's text, so the engines' load does not change."""
    words = vocabulary()
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path))
    return path


class SimFleet:
    """Simulated engines, one process each (so that one restarts alone), each logging to a file;
    ``options(i)``: engine ``i``'s command-line options besides its port."""

    def __init__(self, ports: Sequence[int], options: Sequence[Sequence[str]], logs: Path) -> None:
        self.ports = list(ports)
        self._options = [list(o) for o in options]
        self._logs = logs
        self._procs: list[subprocess.Popen[bytes]] = []
        self._stack = ExitStack()

    def __enter__(self) -> SimFleet:
        try:
            started = [self._spawn(i, "") for i in range(len(self.ports))]
            self._procs = [proc for proc, _ in started]
            for i, (proc, log) in enumerate(started):
                wait_ready(proc, f"http://127.0.0.1:{self.ports[i]}/health", log, 60.0)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_all(self._procs)
        self._stack.close()

    def restart(self, i: int) -> float:
        """Stop engine ``i`` and start a fresh one (an empty cache) on its port, with the same
        options (its KV-event sockets too); the epoch seconds at which the fresh one answers."""
        stop(self._procs[i])
        self._procs[i], log = self._spawn(i, "-restarted")
        wait_ready(self._procs[i], f"http://127.0.0.1:{self.ports[i]}/health", log, 60.0)
        return time.time()

    def _spawn(self, i: int, suffix: str) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
        log = self._stack.enter_context((self._logs / f"engine-{i}{suffix}.log").open("w+b"))
        argv = [*GATEWAY, "sim", *self._options[i], "--port", str(self.ports[i])]
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log), log


@dataclass(frozen=True, slots=True)
class Engines:
    """How a run's engines start: ``tokenizer`` the bench's ``tokenizer.json`` (None: the
    simulator's own, and no KV events), ``events`` each engine's (PUB, replay) ports."""

    tokenizer: Path | None
    events: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, count: int, tokenizer: Path | None) -> Engines:
        return cls(tokenizer, tuple((free_port(), free_port()) for _ in range(count)) if tokenizer else ())

    def options(self, i: int, gpu_memory_utilization: float, k: float) -> list[str]:
        """Engine ``i``'s options besides its port (``--time-scale`` ``k``)."""
        base = ["--profile", PROFILE, "--gpu-memory-utilization", str(gpu_memory_utilization)]
        base += ["--time-scale", str(k)]
        if self.tokenizer is None:
            return base
        pub, replay = self.events[i]
        return [
            *base,
            *("--tokenizer", str(self.tokenizer), "--chat-template", str(CHAT_TEMPLATE)),
            *("--hash-algo", HASH_ALGORITHM, "--hash-seed", HASH_SEED),
            *("--kv-events", f"tcp://127.0.0.1:{pub}", "--kv-events-replay", f"tcp://127.0.0.1:{replay}"),
        ]

    def kv_events(self, i: int) -> str:
        """Engine ``i``'s ``kv_events`` in the policy (the events mode's)."""
        pub, replay = self.events[i]
        hashing = f'{{algorithm: {HASH_ALGORITHM}, seed: "{HASH_SEED}", block_size: {BLOCK_SIZE}}}'
        return (
            f'kv_events: {{endpoint: "tcp://127.0.0.1:{pub}", replay_endpoint: "tcp://127.0.0.1:{replay}", '
            f"hashing: {hashing}}}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the engine-truth bench's tokenizer.json")
    parser.add_argument("path", type=Path)
    print(write_tokenizer(parser.parse_args(argv).path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
