"""Stored responses: where a response an engine keeps lives, for the request that continues it.

Owns response affinity (``affinity.py``: per tenant, bounded), sealed response ids that carry
their holder (``ids.py``), and the shared map in Redis for ids that are not sealed
(``sharing.py`` and its ``sharing_*.lua`` scripts).

May import the shared store, the clock and the errors.
"""
