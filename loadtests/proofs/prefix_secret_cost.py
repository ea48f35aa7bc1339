"""What keying the prefix hashes costs (``gateway/routing/prefix_secret.py``), each part beside its
unkeyed baseline in the same run.

Usage::

    taskset -c 1 python -m loadtests.proofs.prefix_secret_cost [--blocks 80] [--repeat 5]

Four lines, nanoseconds a call (best of ``--repeat`` runs):

* **prefix_affinity pick**: ``loadtests/proofs/routing_pick_cost.py``'s workload (16 chats of 10 turns
  after a 2k-token system prompt, the router's ``ChainMemo`` on), its routers keyed with a
  ``PrefixSecret`` against the same routers with the unkeyed roots of before
  (``scope_root``), alternating;

* **root**: ``PrefixSecret.root`` (memoised HMAC; every request, on the hot path) against the
  unkeyed ``scope_root`` (one xxh64 of scope and model) it replaces;
* **trace hashes**: ``PrefixSecret.trace_hashes`` of a chain of ``--blocks`` blocks (only with a
  trace log, at the end of a request) against hashing the chain itself (``chain``, which a trace
  line already pays when the router's keys cannot be reused), per block;
* **seal + unseal**: a fleet stream entry's blocks sealed by the publisher and opened by one
  reader, per block (the background flush), against packing them (``array``), as before.
"""

from __future__ import annotations

import argparse
import os
import random
import timeit
from array import array
from collections.abc import Callable

from gateway.routing.prefix_keys import CHARS_PER_TOKEN, chain, scope_root
from gateway.routing.prefix_secret import PrefixSecret
from loadtests.loadgen.prompts import words
from loadtests.proofs import routing_pick_cost

BLOCK_TOKENS = 64


class UnkeyedRoots(PrefixSecret):
    """The roots before keying (``scope_root``): the pick's baseline."""

    __slots__ = ()

    def root(self, scope: str, model: str) -> int:
        return scope_root(scope, model)


def pick_ns(repeat: int) -> tuple[float, float]:
    """Nanoseconds a ``prefix_affinity`` pick, keyed and unkeyed, best of ``repeat`` alternations."""
    rng = random.Random(1)
    system, turns = words(2048, rng), 10
    chats = [[words(384 if i % 2 == 0 else 192, rng) for i in range(2 * turns)] for _ in range(16)]
    keyed, unkeyed = PrefixSecret(os.urandom(32)), UnkeyedRoots(b"unused")
    runs: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeat):
        for is_keyed, secret in ((True, keyed), (False, unkeyed)):
            runs[is_keyed].append(routing_pick_cost.run("prefix_affinity", chats, system, turns, secret=secret))
    return min(runs[True]) * 1e9, min(runs[False]) * 1e9


def best_ns(call: Callable[[], object], number: int, repeat: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--blocks", type=int, default=80, help="blocks of a prompt (80: about 5,000 tokens)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    secret = PrefixSecret(os.urandom(32))
    size = CHARS_PER_TOKEN * BLOCK_TOKENS
    data = os.urandom(size * args.blocks)
    blocks = chain(data, size, secret.root("tenant:acme", "m"))
    packed = array("Q", blocks).tobytes()
    n, r = 20_000, args.repeat
    rows = [
        ("prefix_affinity pick", *pick_ns(r), 1),
        (
            "root (per request)",
            best_ns(lambda: secret.root("tenant:acme", "m"), n * 10, r),
            best_ns(lambda: scope_root("tenant:acme", "m"), n * 10, r),
            1,
        ),
        (
            "trace hashes (per block)",
            best_ns(lambda: secret.trace_hashes(blocks), n // 20, r),
            best_ns(lambda: chain(data, size, 1), n // 20, r),
            args.blocks,
        ),
        (
            "seal + unseal (per block)",
            best_ns(lambda: secret.unseal(secret.seal(packed)), n // 20, r),
            best_ns(lambda: array("Q", blocks).tobytes(), n // 20, r),
            args.blocks,
        ),
    ]
    print(f"{'':28} {'keyed':>10} {'baseline':>10} {'ratio':>7}   (ns; baseline: unkeyed roots, chain, packing)")
    for name, keyed, base, per in rows:
        print(f"{name:28} {keyed / per:10.1f} {base / per:10.1f} {keyed / base:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
