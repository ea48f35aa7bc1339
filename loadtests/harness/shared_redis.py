"""The shared Redis on 127.0.0.1:6379, and how a run tidies its keys out of it.

The tests and the benches that need a Redis they never kill share this one server; each works
under a key prefix of its own, so that runs sharing it never see each other's keys, and drops
that prefix's keys when it ends (``drop_keys``). A bench that takes Redis away runs its own
(``private_redis.py``). Here, not in ``tests/``, because a proof may not import the tests
(``tests/loadtests/test_layout.py``); ``tests/limitstore/redis_server.py`` re-exports both.
"""

from __future__ import annotations

import redis

REDIS_URL = "redis://127.0.0.1:6379/0"


def drop_keys(url: str, prefix: str) -> None:
    """Delete every key under ``prefix`` (tidy up the shared Redis after a test or a run)."""
    with redis.Redis.from_url(url, socket_timeout=2) as client:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
