"""The alert rules are valid, and each alert fires on the synthetic series of its unit test."""

from __future__ import annotations

import subprocess

import yaml

from tests.deploy.conftest import ALERTS, ALERTS_TEST, binary


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=ALERTS.parent, check=False
    )


def test_promtool_accepts_the_rules() -> None:
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_fires_in_the_promtool_unit_tests() -> None:
    result = promtool("test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_that_expects_it_to_fire() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    alerts = {r["alert"] for group in rules["groups"] for r in group["rules"] if "alert" in r}
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    fired = {c["alertname"] for t in tests for c in t.get("alert_rule_test", ()) if c["exp_alerts"]}
    assert alerts - fired == set(), "alerts without a firing test case"
    assert {"GatewaySLOFastBurn", "GatewaySLOSlowBurn", "GatewayQueueSaturated", "GatewayBreakerOpen"} <= alerts
    assert {"GatewayModelDown", "GatewayRedisUnreachable"} <= alerts
