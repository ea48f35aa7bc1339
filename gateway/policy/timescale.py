"""Scale a policy's objectives and waits for simulated engines running ``--time-scale K``.

A simulator run with time scale K makes every duration K times longer, so the policy the
gateway runs with must stretch its SLOs, queue waits and deadlines by the same K, or every
request would miss its objectives by construction. Intervals that are about the gateway's
own work (health checks, scrapes, connect timeouts) stay as they are. Prices per GPU-hour are
divided by K: a simulated second lasts K real seconds, and cost attribution charges real time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from gateway.policy.loader import PolicyLoader
from gateway.policy.snapshot import PolicySnapshot


def scale_policy_time(snapshot: PolicySnapshot, k: float) -> PolicySnapshot:
    """``snapshot`` with every class's SLOs, ``max_wait_s`` and ``deadline_s``, and every backend's
    first-byte and between-chunk timeouts, multiplied by ``k``; prices divided by ``k``. Loaded again
    with the checks ``snapshot`` passed (``PolicySnapshot.checks``)."""
    if k == 1:
        return snapshot
    data: dict[str, Any] = snapshot.policy.model_dump(mode="json", exclude_none=True)
    for section in data["classes"].values():
        section["slo"] = {name: value * k if name.endswith("_ms") else value for name, value in section["slo"].items()}
        if "max_wait_s" in section.get("queue", {}):
            section["queue"]["max_wait_s"] *= k
        section["deadline_s"] = section.get("deadline_s", 600.0) * k
    for backend in data["backends"]:
        timeouts = backend.setdefault("timeouts", {})
        for name in ("first_byte_s", "between_chunks_s"):
            if name in timeouts:
                timeouts[name] *= k
        if backend.get("price_per_gpu_hour"):
            backend["price_per_gpu_hour"] /= k
    scaled = PolicyLoader(snapshot.checks).parse(yaml.safe_dump(data), f"{snapshot.source} (time scale {k:g})")
    # The file's digest, not the scaled text's: the hot-reload watcher compares digests and must
    # not take the scaling for an edit of the file (it would load the unscaled policy).
    return dataclasses.replace(scaled, digest=snapshot.digest)
