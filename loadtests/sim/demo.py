"""``inference-gateway demo``: the gateway and two simulated engines in one process.

What a newcomer runs first: nothing to install but the package, no GPU, a request answered
at once. The engines are this package's simulator, which is why this command lives here, in the
bench, and joins the CLI through an entry point (``gateway/cli/main.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway.cli.commands import build_or_report, load_or_report
from gateway.policy.timescale import scale_policy_time
from gateway.server.serve import GatewayServer
from gateway.settings import DEFAULT_ADMIN_PORT
from loadtests.sim import serve_engines

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_POLICY = REPO_ROOT / "policies" / "demo.yaml"


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``demo`` sub-command."""
    demo = subparsers.add_parser("demo", help="gateway + two simulated backends in one process")
    demo.add_argument("--port", type=int, default=8080)
    demo.add_argument("--admin-port", type=int, default=None, help=f"operator endpoints (default {DEFAULT_ADMIN_PORT})")
    demo.add_argument("--policy", default=str(DEMO_POLICY))
    demo.add_argument("--profile", default="llama-3.1-8b-h100", help="simulated engine profile (see `sim --help`)")
    demo.add_argument("--time-scale", type=float, default=1.0, help="multiply every simulated duration by K")
    demo.add_argument("--ttft-ms", type=float, default=None, help="with --profile fixed: time to first token")
    demo.add_argument("--itl-ms", type=float, default=None, help="with --profile fixed: inter-token delay")
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    snapshot = load_or_report(args.policy)
    if snapshot is None:
        return 1
    snapshot = scale_policy_time(snapshot, args.time_scale)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    ports = [urlsplit(b.url).port or 80 for b in snapshot.policy.backends]
    built = build_or_report(
        snapshot,
        policy_path=args.policy,
        host="127.0.0.1",
        port=args.port,
        admin_port=args.admin_port,
        log_level="warning",
    )
    if built is None:
        return 1
    model = snapshot.policy.models[0].name

    async def run() -> None:
        engines = asyncio.create_task(
            serve_engines(
                args.profile,
                host="127.0.0.1",
                ports=ports,
                model=model,
                time_scale=args.time_scale,
                ttft_ms=args.ttft_ms,
                itl_ms=args.itl_ms,
            )
        )
        await _wait_for_ports(ports, engines)
        print(_demo_banner(built, args.policy, model, ports), flush=True)
        try:
            await built.serve()
        finally:
            engines.cancel()
            await asyncio.gather(engines, return_exceptions=True)

    try:
        import uvloop

        uvloop.run(run())
    except KeyboardInterrupt:
        pass
    return 0


async def _wait_for_ports(ports: list[int], task: asyncio.Task[None], timeout_s: float = 30.0) -> None:
    """Return once every port accepts connections, so the gateway's first health check passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = list(ports)
    while pending:
        if task.done():
            task.result()
            raise RuntimeError("the simulated engines stopped during start-up")
        if loop.time() > deadline:
            raise RuntimeError(f"simulated engines on ports {pending} did not start in {timeout_s}s")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", pending[0])
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        pending.pop(0)


def _demo_banner(built: GatewayServer, policy: str, model: str, ports: list[int]) -> str:
    base = built.api_url
    tenants = " (tenants 'acme' with key demo-key-acme, 'globex' with key demo-key-globex)"
    if Path(policy).resolve() != DEMO_POLICY:
        tenants = ""  # another policy: its tenants and keys are the operator's own
    return f"""
inference-gateway demo: gateway on {base}, simulated backends on ports {", ".join(map(str, ports))}
Policy: {policy}{tenants}

Try it with curl:
  curl -N {base}/v1/chat/completions -H 'Authorization: Bearer demo-key-acme' \\
       -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "stream": true, "max_tokens": 16,
            "messages": [{{"role": "user", "content": "Hello"}}]}}'

Or with the openai SDK:
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="demo-key-acme")
  for chunk in client.chat.completions.create(model="{model}", stream=True, max_tokens=16,
                                              messages=[{{"role": "user", "content": "Hello"}}]):
      print(chunk.choices[0].delta.content or "", end="", flush=True) if chunk.choices else None

Metrics: {built.admin_url}/metrics   Readiness: {base}/readyz   Stop: Ctrl-C
"""
