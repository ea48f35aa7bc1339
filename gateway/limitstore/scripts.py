"""The Lua scripts of the Redis limit store: one atomic step each (``limitstore/redis.py``).

The scripts are the ``.lua`` files beside this module, read once at import (``gateway/shared/lua.py``):
``sync.lua`` and ``in_use.lua``, each preceded by ``clock.lua`` and ``purge.lua``.

Every script takes the clock first (``ARGV[1]``, ``ARGV[2]``: an injected clock's seconds and
microseconds, or ``""`` for the server's ``TIME``), so that buckets refill on one clock
whichever replica runs them. All the keys of one call belong to one scope (a tenant) and share
its hash tag: one Redis Cluster slot per call, and no script ever spans two tenants.

**What Redis keeps per tenant** (``limitstore/lease.py`` says what a process does with it):

* ``{t}:leases``, a sorted set ``replica -> lease expiry``: a replica that stops renewing
  loses everything it holds ``ttl`` later (its slots freed, its tokens counted as spent);
* ``{t}:held``, a hash: ``<replica>`` the concurrency slots it holds, ``<replica>|<bucket>``
  the tokens of that bucket leased to it and not yet reported spent; ``|slots`` and
  ``|<bucket>`` the totals over replicas, ``|names`` the buckets ever leased (for the purge),
  ``|wanted`` when an ask was last refused (a replica that learns it gives back its spare);
* ``{t}:<bucket>``, a hash ``{level, s, us}``: the bucket's level, refilled lazily, never
  above ``capacity - leased`` (below).

**The bound, at every instant**: a bucket's level plus every token leased out never exceeds
its capacity (the level's ceiling is ``capacity - leased``), and the slots held never exceed
the limit. A grant moves tokens from the level to a lease; a report of tokens spent removes
them from the lease (lifting the ceiling, from which the level refills at its rate, never at
once); what a replica gives back returns to the level. So the tokens spent fleet-wide in any
window of ``w`` seconds are at most ``capacity + rate * w`` (plus what was given back), the
bound of one token bucket, however the leases are spread. The level is never deleted while
tokens are leased (its key lives at least the lease ``ttl``): a missing level reads as full,
which is true only once every lease is gone and the refill had time to reach the capacity.
"""

from __future__ import annotations

from gateway.shared.lua import lua_script

SYNC = lua_script("gateway.limitstore", "clock.lua", "purge.lua", "sync.lua")
"""One step of one replica for one tenant: report, give back, adjust, ask, renew (``sync.lua``
says its ``KEYS``, ``ARGV`` and reply). ``clock.lua`` and ``purge.lua`` come first: Redis has no
``require``."""

IN_USE = lua_script("gateway.limitstore", "clock.lua", "purge.lua", "in_use.lua")
"""The slots held fleet-wide: running, and spare in some replica's lease (``in_use.lua``)."""
