"""Request bodies: prompts of the workload's lengths with its shared-prefix structure.

Text is made of pseudo-words without punctuation, so one word is one token for the simulator's
word tokenizer and a length in the workload is a length on the wire. Each request is laid out as
the engine's prefix cache sees it, most shared first:

    [tenant system prompt] [tenant few-shot template] [conversation history] [new user turn]

The system prompt and the templates are derived from (seed, tenant), so two runs with one seed
send identical prefixes and two tenants never share one. A conversation's next turn resends
the previous turns and the assistant's replies; the replies are synthetic (see
`workload.Conversation`) so a turn never waits for the previous response.

`RequestFactory.plan(i)` is called by the runner just before request i is due: the body is
built ahead of its send time, and the memory held is that of the open conversations only.

Each planned request also carries what a what-if replay needs of it (``trace_fields``, written
to the record's extras under the names of the gateway's trace log): its prefix signature,
computed with the gateway's own function on the body sent (``gateway/routing/prefix_signature.py``)
under the tenant's private scope, ``max_tokens``, the API, and for a multi-turn workload its
conversation's id as ``session`` (hashed per tenant, as the gateway hashes ``x-session-id``).
The private scope is the gateway's scope of every tenant that shares no cache scope, and a
replay only compares chains inside one trace, so the records and the gateway's log agree
whenever the policy keeps tenants private. Cost: one rendering, the estimate and one xxh64 per
256 bytes of prompt: for ``workloads/multiturn.yaml`` (13 kB prompts) about as much again as
planning the request, some tens of microseconds, spent before the request is due.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.dialects.registry import DIALECTS
from gateway.routing.prefix_signature import DEFAULT_BLOCK_TOKENS, body_signature, private_scope, session_hash
from loadtests.loadgen.workload import Fixed, Length, LogNormal, Normal, Uniform, Workload

_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
WORDS: tuple[str, ...] = tuple(a + b for a, b in itertools.product(_SYLLABLES, repeat=2))
"""4,900 two-syllable words: enough that 16 random words never repeat across a run."""

Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """A request ready to send: its body is final, its headers carry tenant, class and deadline."""

    request_id: str
    class_name: str
    tenant: str
    body: bytes
    headers: Mapping[str, str]
    max_tokens: int
    trace_fields: Mapping[str, Any] = field(default_factory=dict)
    """``api``, ``max_tokens``, ``session`` and the prefix signature, as the gateway's trace log names them."""


def sample_length(length: Length, rng: random.Random) -> int:
    if isinstance(length, Fixed):
        return length.value
    if isinstance(length, Uniform):
        return rng.randint(length.min, length.max)
    if isinstance(length, Normal):
        value = round(rng.gauss(length.mean, length.std))
    else:
        assert isinstance(length, LogNormal)
        value = round(rng.lognormvariate(length.mu, length.sigma))
    value = max(value, length.min)
    return value if length.max is None else min(value, length.max)


def _pick(names: list[str], cumulative: list[float], rng: random.Random) -> str:
    """`random.choices` for one item, at a third of its cost (it is called twice per request)."""
    if len(names) == 1:
        return names[0]
    return names[min(bisect.bisect(cumulative, rng.random() * cumulative[-1]), len(names) - 1)]


def words(count: int, rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=count))


@dataclass(slots=True)
class _Conversation:
    id: str
    remaining: int
    history: list[Message] = field(default_factory=list)


class RequestFactory:
    """Plans request i: picks its class and tenant by share, then builds its body and headers."""

    def __init__(
        self,
        workload: Workload,
        *,
        seed: int,
        run_id: str,
        time_scale: float = 1.0,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ) -> None:
        self._w = workload
        self._block_tokens = block_tokens
        self._dialect = DIALECTS[self.path]
        self._opened = 0
        self._rng = random.Random(seed)
        self._run_id = run_id
        self._time_scale = time_scale
        self._class_names = list(workload.classes)
        self._class_weights = list(itertools.accumulate(c.share for c in workload.classes.values()))
        self._tenant_names = list(workload.tenants)
        self._tenant_weights = list(itertools.accumulate(t.share for t in workload.tenants.values()))
        self._prefix = {name: self._tenant_prefix(name, seed) for name in workload.tenants}
        self._templates = {name: self._tenant_templates(name, seed) for name in workload.tenants}
        self._keys = {name: tenant.resolve_key() for name, tenant in workload.tenants.items()}
        self._conversations: dict[tuple[str, str], list[_Conversation]] = {}

    def plan(self, index: int) -> PlannedRequest:
        rng = self._rng
        class_name = _pick(self._class_names, self._class_weights, rng)
        tenant = _pick(self._tenant_names, self._tenant_weights, rng)
        cls = self._w.classes[class_name]
        prompt_len = sample_length(cls.prompt_tokens or self._w.prompt_tokens, rng)
        max_tokens = max(1, sample_length(cls.output_tokens or self._w.output_tokens, rng))
        user: Message = {"role": "user", "content": words(prompt_len, rng)}
        messages = [*self._prefix[tenant], *rng.choice(self._templates[tenant])]
        turns, conversation = self._converse(tenant, class_name, user, max_tokens)
        request_id = f"{self._run_id}-{index:07d}"
        body = self._body(messages + turns, max_tokens)
        return PlannedRequest(
            request_id=request_id,
            class_name=class_name,
            tenant=tenant,
            body=orjson.dumps(body),
            headers=self._headers(tenant, class_name, request_id),
            max_tokens=max_tokens,
            trace_fields=self._trace_fields(tenant, body, conversation),
        )

    def _trace_fields(self, tenant: str, body: dict[str, Any], conversation: str | None) -> dict[str, Any]:
        """What a replay needs of the request (module docstring), never its text."""
        signature = body_signature(self._dialect, body, scope=private_scope(tenant), block_tokens=self._block_tokens)
        return {
            "api": self._dialect.name,
            "max_tokens": body["max_tokens"],
            "session": None if conversation is None else session_hash(tenant, conversation),
            **signature.fields(),
        }

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self._w.api == "chat" else "/v1/completions"

    def _converse(
        self, tenant: str, class_name: str, user: Message, max_tokens: int
    ) -> tuple[list[Message], str | None]:
        """The turns to send (the history, then ``user``) and the conversation's id (None without
        conversations); records the turn and a synthetic reply for the next."""
        spec = self._w.conversation
        if spec is None:
            return [user], None
        rng = self._rng
        pool = self._conversations.setdefault((tenant, class_name), [])
        if len(pool) < spec.active_per_tenant:
            self._opened += 1
            conversation_id = f"{self._run_id}-c{self._opened}"
            pool.append(_Conversation(conversation_id, remaining=max(1, sample_length(spec.turns, rng))))
        slot = rng.randrange(len(pool))
        conversation = pool[slot]
        sent = [*conversation.history, user]
        conversation.remaining -= 1
        if conversation.remaining == 0:
            pool.pop(slot)
        else:
            reply: Message = {"role": "assistant", "content": words(max_tokens, rng)}
            conversation.history = [*sent, reply]
        return sent, conversation.id

    def _body(self, messages: list[Message], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self._w.model, "max_tokens": max_tokens, "stream": self._w.stream}
        if self._w.api == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = "\n\n".join(m["content"] for m in messages)
        if self._w.stream:
            body["stream_options"] = {"include_usage": True}
        if self._w.ignore_eos:
            body["ignore_eos"] = True
        return body

    def _headers(self, tenant: str, class_name: str, request_id: str) -> dict[str, str]:
        cls = self._w.classes[class_name]
        headers = {
            "authorization": f"Bearer {self._keys[tenant]}",
            "content-type": "application/json",
            "x-priority": cls.priority,
            "x-request-id": request_id,
        }
        if cls.deadline_s is not None:
            headers["x-request-timeout"] = f"{cls.deadline_s * self._time_scale:g}"
        return headers

    def _tenant_prefix(self, tenant: str, seed: int) -> list[Message]:
        count = self._w.prefix.system_prompt_tokens
        if count == 0:
            return []
        return [{"role": "system", "content": words(count, random.Random(f"system:{seed}:{tenant}"))}]

    def _tenant_templates(self, tenant: str, seed: int) -> list[list[Message]]:
        spec = self._w.fewshot
        if spec is None:
            return [[]]
        templates = []
        for t in range(spec.templates_per_tenant):
            rng = random.Random(f"fewshot:{seed}:{tenant}:{t}")
            template: list[Message] = []
            for _ in range(spec.examples):
                n = sample_length(spec.example_tokens, rng)
                template.append({"role": "user", "content": words(max(1, n // 2), rng)})
                template.append({"role": "assistant", "content": words(max(1, n - n // 2), rng)})
            templates.append(template)
        return templates
