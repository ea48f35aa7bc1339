"""Engines' KV-cache events: what each engine says its prefix cache holds (issue 30, item 3).

* ``wire``: vLLM's event batches and frames, decoded into frozen values (every layout vLLM has
  published);
* ``subscriber``: one ZeroMQ feed per backend, in sequence (gaps replayed) or not live, with a
  ``KvEventSink`` for the batches and a ``KvFeedObserver`` for the feed's state;
* ``block_index``: the exact per-backend index of held block hashes the batches build.

Imports nothing of the gateway: the routing stage reads the index, the composition root builds
the subscribers.
"""
