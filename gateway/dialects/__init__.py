"""Per API: one dialect per inference API the gateway serves (chat, completions, embeddings,
Responses, Messages, token counting, the tokenizer, rerank and score).

The stage owns everything that differs by API: the body rules, the stream format, the shape of
a whole answer, the state an engine keeps for a later request, and the translation to another
API a backend serves (``base.py``: the ``Dialect`` protocol, split into the roles the stages
read; ``defaults.py``: the OpenAI defaults each dialect overrides; ``registry.py``: the dialects
by path). The request path asks a request's dialect and never tests which API it is.

It imports the policy model, the engine table (``gateway/engines.py``), the errors, and the
request checks its rules apply (``body_fields``, ``media``, ``tokens``, ``output_length``,
``field_limits``); ``gateway/types.py`` (the request holds its dialect), admission and the
pipeline's stations (attempt, relay, upstream) import it, never the reverse.
"""
