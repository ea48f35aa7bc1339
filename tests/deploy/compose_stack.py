"""The processes of ``deploy/compose.yaml``'s stack, started without Docker (``run_stack``).

Each is the container's command line (``Stack.argv``) run here: the binary from this machine
(Debian's ``redis-server`` and ``prometheus``, the virtualenv's ``inference-gateway``), its
listen address moved to a free loopback port, and what it reads from a bind mount taken from
the repository, with the container addresses in it (``sim-a:8000``) mapped to the loopback ones
(``localize``). ``Running.addresses`` maps each (service, container port) to where it runs here.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import redis
import yaml

from gateway.policy.model import Policy
from gateway.service import load_policy
from tests.deploy.compose_file import Stack, flag_value, set_flag
from tests.deploy.conftest import binary
from tests.deploy.prometheus import Prometheus, logged_process, run_prometheus
from tests.servers import ChildServer, free_port, serve_in_process, wait_until

BIN = Path(sys.executable).parent
"""The virtualenv's scripts: ``inference-gateway`` here is the image's."""


@dataclass
class Running:
    """The stack's processes on loopback: container address (service, port) -> host:port."""

    addresses: dict[tuple[str, int], str]
    gateway: ChildServer
    prometheus: Prometheus
    redis_password: str
    logs: Path

    def url(self, service: str, port: int) -> str:
        return f"http://{self.addresses[(service, port)]}"


@contextmanager
def run_stack(stack: Stack, tmp: Path) -> Iterator[Running]:
    """The services in the order Compose starts them, each waited for as its dependents wait
    (healthy: Redis answers PING with the password, an engine /health, the gateway /readyz);
    stopped at the end of the block. Grafana is not run."""
    addresses: dict[tuple[str, int], str] = {}
    started: dict[str, Any] = {}
    with ExitStack() as stop:
        for name in stack.start_order():
            if name == "redis":
                started[name] = _start_redis(stack, addresses, tmp, stop)
            elif name.startswith("sim-"):
                _start_sim(stack, name, addresses, tmp, stop)
            elif name == "gateway":
                started[name] = _start_gateway(stack, addresses, tmp, stop)
            elif name == "prometheus":
                started[name] = _start_prometheus(stack, addresses, tmp, stop)
            else:
                assert name == "grafana", f"{name}: a service the test does not run"
        yield Running(addresses, started["gateway"], started["prometheus"], started["redis"], tmp)


def _start_redis(stack: Stack, addresses: dict[tuple[str, int], str], tmp: Path, stop: ExitStack) -> str:
    """A Redis of its own (never the shared one on 6379) with the stack's password."""
    argv = stack.argv("redis")
    port = free_port()
    addresses[("redis", int(flag_value(argv, "--port") or 6379))] = f"127.0.0.1:{port}"
    argv = set_flag(set_flag(argv, "--port", str(port)), "--bind", "127.0.0.1")
    stop.enter_context(logged_process([binary(argv[0], "redis-server"), *argv[1:]], tmp / "redis.log"))
    password = flag_value(argv, "--requirepass") or ""
    client = redis.Redis(port=port, password=password, socket_timeout=1)
    stop.callback(client.close)
    wait_until(lambda: _pings(client), timeout=15, what=f"redis-server (log: {tmp / 'redis.log'})")
    return password


def _start_sim(stack: Stack, name: str, addresses: dict[tuple[str, int], str], tmp: Path, stop: ExitStack) -> None:
    argv = stack.argv(name)
    port = free_port()
    addresses[(name, int(flag_value(argv, "--port") or 0))] = f"127.0.0.1:{port}"
    argv = set_flag(set_flag(argv, "--host", "127.0.0.1"), "--port", str(port))
    log = tmp / f"{name}.log"
    stop.enter_context(logged_process([str(BIN / argv[0]), *argv[1:]], log))
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/health"), timeout=30, what=f"{name} (log: {log})")


def _start_gateway(stack: Stack, addresses: dict[tuple[str, int], str], tmp: Path, stop: ExitStack) -> ChildServer:
    """The entrypoint and command, on port 0 (the child picks and logs its ports), the policy
    directory copied with the engines' addresses mapped to loopback."""
    argv = stack.argv("gateway")
    policy = flag_value(argv, "--policy")
    assert policy is not None
    mounted = stack.host_path("gateway", str(Path(policy).parent))
    copy = tmp / "policy"
    copy.mkdir()
    for file in mounted.iterdir():
        (copy / file.name).write_text(localize(file.read_text(), addresses))
    api_port, admin_port = int(flag_value(argv, "--port") or 0), int(flag_value(argv, "--admin-port") or 0)
    for flag, value in (("--host", "127.0.0.1"), ("--admin-host", "127.0.0.1"), ("--port", "0")):
        argv = set_flag(argv, flag, value)
    argv = set_flag(set_flag(argv, "--admin-port", "0"), "--policy", str(copy / Path(policy).name))
    argv = set_flag(argv, "--log-level", "info")  # serve_in_process reads the ports from the log
    env = {name: localize(value, addresses) for name, value in stack.environment("gateway").items()}
    with pytest.MonkeyPatch.context() as patch:  # the child's environment only
        for name, value in env.items():
            patch.setenv(name, value)
        child = stop.enter_context(serve_in_process([str(BIN / argv[0]), *argv[1:]]))
    addresses[("gateway", api_port)] = urlsplit(child.url).netloc
    addresses[("gateway", admin_port)] = urlsplit(child.admin_url).netloc
    wait_until(lambda: answers(child.url + "/readyz"), timeout=30, what="the gateway to be ready")
    return child


def _start_prometheus(stack: Stack, addresses: dict[tuple[str, int], str], tmp: Path, stop: ExitStack) -> Prometheus:
    """Debian's Prometheus with the command's flags: the config with its targets mapped to
    loopback and its rule files to the mounted ones; a temporary data directory."""
    argv = stack.argv("prometheus")
    config = prometheus_config(stack)
    config["rule_files"] = [str(stack.host_path("prometheus", rule)) for rule in config["rule_files"]]
    (tmp / "prometheus.yml").write_text(localize(yaml.safe_dump(config), addresses))
    argv = set_flag(argv, "--config.file", str(tmp / "prometheus.yml"))
    argv = set_flag(argv, "--storage.tsdb.path", str(tmp / "prometheus-data"))
    prometheus = stop.enter_context(run_prometheus(argv[1:], tmp / "prometheus.log"))
    addresses[("prometheus", 9090)] = urlsplit(prometheus.url).netloc  # the image's default listen port
    wait_until(lambda: answers(prometheus.url + "/-/ready"), timeout=30, what=f"Prometheus ({prometheus.log})")
    return prometheus


def localize(text: str, addresses: dict[tuple[str, int], str]) -> str:
    """``text`` with every container address ``service:port`` replaced by its loopback one."""
    for (service, port), address in addresses.items():
        text = re.sub(rf"(?<![\w.-]){re.escape(service)}:{port}(?!\d)", address, text)
    return text


def gateway_policy(stack: Stack) -> Policy:
    """The gateway's policy, as mounted."""
    path = flag_value(stack.argv("gateway"), "--policy")
    assert path is not None
    return load_policy(stack.host_path("gateway", path)).policy


def listen_port(stack: Stack, service: str) -> int:
    """The port ``service``'s process listens on (its --port)."""
    return int(flag_value(stack.argv(service), "--port") or 0)


def prometheus_config(stack: Stack) -> dict[str, Any]:
    """Prometheus's config file, as mounted."""
    path = flag_value(stack.argv("prometheus"), "--config.file")
    assert path is not None
    config: dict[str, Any] = yaml.safe_load(stack.host_path("prometheus", path).read_text())
    return config


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
