"""Every metric the dashboard and the alerts use is on a running gateway's /metrics, or pending.

``deploy/metrics.md`` lists each name with a status. A name used by the dashboard or the alerts
must be exposed by the gateway or listed as ``pending``; an ``implemented`` row must be exposed;
a ``pending`` row that the gateway already exposes must be flipped to ``implemented``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import yaml

from tests.conftest import BackendServer, run_gateway
from tests.deploy.conftest import ALERTS, DASHBOARD, METRICS_DOC
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix
from tests.policy_builder import redis_state, session_policy
from tests.servers import metric_types

# A metric name, not part of a recording rule's level:name:operations.
_NAME = re.compile(r"(?<![\w:])(gateway_[a-z0-9_]+)(?![\w:])")
_ROW = re.compile(r"^\| `(gateway_[a-z0-9_]+)` \| (counter|gauge|histogram) \| [^|]* \| (implemented|pending) \|")
_HISTOGRAM_SUFFIXES = ("", "_bucket", "_sum", "_count", "_created")


def documented() -> dict[str, tuple[str, str]]:
    """name -> (type, status) from the table of ``deploy/metrics.md``."""
    rows = {}
    for line in METRICS_DOC.read_text().splitlines():
        if match := _ROW.match(line):
            rows[match[1]] = (match[2], match[3])
    return rows


def series_names(name: str, kind: str) -> set[str]:
    """The sample names a documented metric puts on /metrics."""
    if kind == "histogram":
        return {name + s for s in _HISTOGRAM_SUFFIXES}
    return {name}


def exposed(types: Mapping[str, str]) -> set[str]:
    """Sample names of every family on /metrics, from its type (so no traffic is needed)."""
    names = set()
    for family, kind in types.items():
        if kind == "counter":  # the parser names it without _total
            names.add(family.removesuffix("_total") + "_total")
        else:
            names |= series_names(family, kind)
    return names


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def dashboard_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return {n for s in _strings([dashboard["panels"], dashboard["templating"]]) for n in _NAME.findall(s)}


def alert_names() -> set[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {n for g in groups for rule in g["rules"] for n in _NAME.findall(rule["expr"])}


@pytest.fixture(scope="module")
def on_metrics(backend_server: BackendServer, backend_credential: str) -> Iterator[set[str]]:
    """/metrics of the test gateway with its limits in Redis: only such a gateway exports the
    Redis metrics (one without Redis has no ``gateway_redis_up`` for an alert to fire on)."""
    prefix = unique_prefix()
    with run_gateway(session_policy(backend_server.url, state=redis_state(REDIS_URL, prefix))) as url:
        yield exposed(metric_types(url))
    drop_keys(REDIS_URL, prefix)


@pytest.mark.parametrize("used", [dashboard_names, alert_names], ids=["the dashboard's metrics", "the alerts' metrics"])
def test_every_metric_used_is_exposed_or_pending(used: Any, on_metrics: set[str]) -> None:
    names = used()
    assert names, "no gateway_ metric found: is the extraction broken?"
    rows = documented()
    pending = {s for n, (kind, status) in rows.items() if status == "pending" for s in series_names(n, kind)}
    listed = {s for n, (kind, _) in rows.items() for s in series_names(n, kind)}
    assert names - on_metrics - pending == set(), "used, but neither on /metrics nor pending in deploy/metrics.md"
    assert names - listed == set(), "used, but not listed in deploy/metrics.md"


def test_every_implemented_metric_is_on_metrics(on_metrics: set[str]) -> None:
    implemented = {n: kind for n, (kind, status) in documented().items() if status == "implemented"}
    assert implemented, "deploy/metrics.md has no implemented row: is its table format broken?"
    missing = {n for n, kind in implemented.items() if not series_names(n, kind) <= on_metrics}
    assert missing == set(), "marked implemented in deploy/metrics.md but not on the gateway's /metrics"


def test_a_pending_metric_the_gateway_exposes_is_flipped_to_implemented(on_metrics: set[str]) -> None:
    pending = {n for n, (kind, status) in documented().items() if status == "pending" and n in on_metrics}
    assert pending == set(), "on /metrics already: flip these rows of deploy/metrics.md to implemented"
