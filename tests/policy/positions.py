"""A policy written out line by line, for the tests about where a problem is reported.

``tests/policy_builder.py`` dumps YAML whose line numbers a reader cannot see; when the position
of a problem is the subject, the text is here instead, and each test edits it by one
substitution (``edited``). Lines: 5 interactive's slo (flow), 8-11 batch's slo (block), 13/15/16
the models, 19-22 backend gpu-a, 24-26 model group assistant, 28-32 tenant acme (32 its
limits), 33-36 tenant globex.
"""

from __future__ import annotations

from gateway.request.keys import hash_api_key
from tests.policy_builder import KEY_ACME, KEY_GLOBEX

SOURCE = "policies/prod.yaml"

POLICY = f"""\
version: positions-1
classes:
  interactive:
    rank: 0
    slo: {{ttft_ms: 500, itl_ms: 30, e2e_ms: 60000}}
  batch:
    rank: 1
    slo:
      ttft_ms: 5000
      itl_ms: 100
      e2e_ms: 600000
models:
  - name: chat-v1
    max_output_tokens: 64
  - name: chat-v2
  - name: big
    routing: {{strategy: prefix_affinity}}
backends:
  - name: gpu-a
    url: http://127.0.0.1:1
    kind: vllm
    models: [chat-v1, chat-v2, big]
model_groups:
  - name: assistant
    targets: [{{model: chat-v1, weight: 9}}, {{model: chat-v2, weight: 1}}]
    fallbacks: [big]
tenants:
  - name: acme
    key_hashes: ["{hash_api_key(KEY_ACME)}"]
    models: ["*"]
    default_class: interactive
    limits: {{rpm: 60, tpm: 100000, max_concurrent: 4}}
  - name: globex
    key_hashes: ["{hash_api_key(KEY_GLOBEX)}"]
    models: [assistant]
    default_class: batch
"""


def edited(old: str, new: str) -> str:
    assert POLICY.count(old) == 1, old
    return POLICY.replace(old, new)
