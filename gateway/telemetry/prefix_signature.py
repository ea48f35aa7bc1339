"""A request's prefix signature as a trace holds it: block hashes and a size, never a word of the prompt.

Why in telemetry: the signature is what the trace log (``gateway/telemetry/tracelog.py``) and the
load generator's records write of a prompt, so its value and its fields live in the stage that
writes them. Computing one needs the routing rule's block chain, the cache-salt secret and the
request's dialect, all of stages above this one: that is routing's
(``gateway/routing/prefix_signature.py``, whose docstring says what the hashes are and what they
disclose), and the recorder hands the result to the trace log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PrefixSignature:
    """A prompt's chain (``hashes``, 16 hex digits each) of ``block_tokens``-token blocks, and the
    gateway's estimate of its size in tokens (``prompt_tokens_est``, the whole prompt's)."""

    block_tokens: int
    hashes: tuple[str, ...]
    prompt_tokens_est: int

    def fields(self) -> dict[str, Any]:
        """The signature's fields of a load-generator record, named as a trace-log line names them
        (``TraceLine``'s ``prefix_block_tokens``, ``prefix_hashes``, ``prompt_tokens_est``)."""
        return {
            "prefix_block_tokens": self.block_tokens,
            "prefix_hashes": list(self.hashes),
            "prompt_tokens_est": self.prompt_tokens_est,
        }
