"""The request body names a policy may or may not grant: the fields the gateway owns, the tensor parts.

Why in ``policy``: they are the policy's syntax as much as the request's rule. The policy load
refuses an owned field in ``limits.extra_body_fields`` and any part type but these in a tenant's
``allow_content_parts`` (``gateway/policy/model.py``), and screening applies the same names to
every body (``gateway/request/body_fields.py``, rule 2; ``gateway/dialects/allowlists.py``). Kept
here, at the lowest stage that needs them, the policy never imports the request stage.
"""

from __future__ import annotations

from collections.abc import Mapping

STRIPPED_FIELDS: Mapping[str, str] = {
    "priority": "the scheduling priority comes from the tenant's class",
    "service_tier": "the service tier comes from the tenant's class",
    "cache_salt": "the prefix-cache salt is derived from the tenant's cache scope",
    "extra_key": "the prefix-cache key is derived from the tenant's cache scope (SGLang)",
    "cache_prompt": "prompt caching is the gateway's per-backend decision (llama.cpp)",
    "request_id": "the request id is the gateway's x-request-id",
    "rid": "the request id is the gateway's x-request-id (SGLang)",
}
"""Owned fields dropped from a client's body; the gateway sets its own where it applies."""

REFUSED_FIELDS: Mapping[str, str] = {
    "kv_transfer_params": "it tells the engine to move KV cache to or from other hosts",
    "bootstrap_host": "it points the engine at a prefill server (SGLang disaggregation)",
    "bootstrap_port": "it points the engine at a prefill server (SGLang disaggregation)",
    "bootstrap_room": "it joins a prefill transfer (SGLang disaggregation)",
    "data_parallel_rank": "it pins the request to an engine rank",
    "id_slot": "it pins the request to a llama.cpp slot and its cache",
    "vllm_xargs": "it passes arguments to the engine's extensions",
    "custom_logit_processor": "it ships code for the engine to run (SGLang)",
    "lora_path": "it makes the engine load an adapter from a path (SGLang)",
    "session_params": "it continues an engine-side session (SGLang)",
    "chat_template": "a request may not bring its own template; the model's applies",
}
"""Owned fields refused with 400: they steer the engine beyond the client's own request."""

OWNED_FIELDS = frozenset(STRIPPED_FIELDS) | frozenset(REFUSED_FIELDS)

TENSOR_PART_TYPES: Mapping[str, str] = {
    "image_embeds": "precomputed image embeddings",
    "audio_embeds": "precomputed audio embeddings",
    "prompt_embeds": "precomputed prompt embeddings",
}
"""Content-part types that hand the engine raw tensors (vLLM's ``image_embeds``, ``audio_embeds``,
``prompt_embeds`` parts), by what they carry. An engine loads them as they come: a tensor of the
wrong shape or type can crash it, and vLLM says to enable them for trusted users only. So they are
refused unless a tenant's policy opts in (``tenants[].allow_content_parts``,
``gateway/dialects/allowlists.py``)."""


def owned_field_reason(name: str) -> str | None:
    """Why ``name`` is the gateway's (None when it is not): what a policy may never allow."""
    return STRIPPED_FIELDS.get(name) or REFUSED_FIELDS.get(name)
