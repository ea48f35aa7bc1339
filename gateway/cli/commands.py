"""The gateway's own sub-commands: serve, policy validate (``--live``: against the engines), policy
explain, keys hash.

The bench's commands (``demo``, ``sim``, ``loadtest``, ``report``) live under ``loadtests/`` and
join the command line through the ``inference_gateway.commands`` entry points (``gateway/cli/main.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from gateway.app import build_server
from gateway.dispatch.capacity_check import live_check
from gateway.policy.loader import PolicyError
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.keys import hash_api_key
from gateway.server.serve import GatewayServer
from gateway.service import load_policy
from gateway.settings import DEFAULT_ADMIN_PORT, Settings
from gateway.workers.supervisor import supervise


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the gateway's own sub-commands."""
    serve = subparsers.add_parser("serve", help="run the gateway")
    serve.add_argument("--policy", required=True, help="policy file (YAML)")
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        help="gateway processes serving the one API port, under a supervisor (GATEWAY_WORKERS; default 1: one process)",
    )
    _add_listen_args(serve)
    serve.set_defaults(func=_serve)

    policy = subparsers.add_parser("policy", help="policy file tools").add_subparsers(
        dest="policy_command", required=True
    )
    validate = policy.add_parser(
        "validate",
        help="exit 0 when every file is valid, else print errors (exit 1)",
        description=(
            "Exit 0 when every file is valid, 1 when one is not (errors on stderr). With --live, each "
            "backend's engine is asked for its own limits too: declared against engine figures per "
            f"backend, the disagreements the gateway would log, unreachable engines; exit {LIVE_DISAGREES} "
            "on a disagreement or a capacity: auto the engine does not give (an invalid file still exits 1)."
        ),
    )
    validate.add_argument("paths", nargs="+")
    validate.add_argument(
        "--strict", action="store_true", help="fail on warnings too (with --live: on unreachable engines too)"
    )
    validate.add_argument(
        "--live", action="store_true", help="read every backend's own limits from its engine and compare"
    )
    validate.add_argument(
        "--timeout", dest="timeout_s", type=float, default=2.0, help="seconds per engine read with --live (2)"
    )
    validate.set_defaults(func=_validate)
    explain = policy.add_parser("explain", help="which class, queue and backend a request would get, and why")
    explain.add_argument("--policy", required=True, help="policy file (YAML)")
    explain.add_argument("--api-key-file", required=True, help="file holding the tenant's API key")
    explain.add_argument("--request", required=True, help="request body (JSON) of any served API")
    explain.add_argument("--backend-state", default=None, help="JSON: per backend, load and recently served bodies")
    explain.add_argument("--priority", default=None, help="as the x-priority header")
    explain.add_argument("--session-id", default=None, help="as the x-session-id header")
    explain.add_argument(
        "--rollout-dir",
        default=os.environ.get("GATEWAY_ROLLOUT_DIR", ".gateway-state/rollouts"),
        help="where rollouts keep their state without Redis (as the gateway's GATEWAY_ROLLOUT_DIR)",
    )
    explain.set_defaults(func=_explain)

    keys = subparsers.add_parser("keys", help="API key tools").add_subparsers(dest="keys_command", required=True)
    key_hash = keys.add_parser("hash", help="read a key on stdin, print the hash a policy stores")
    key_hash.set_defaults(func=_hash_key)


def _add_listen_args(parser: argparse.ArgumentParser) -> None:
    """Listener flags; each also reads ``GATEWAY_<NAME>`` (see ``gateway/settings.py``), the flag wins."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--log-level", default="warning")
    operator = parser.add_argument_group("operator listener (/metrics, /admin/*, /healthz, /readyz)")
    operator.add_argument("--admin-host", default=None, help="default 127.0.0.1")
    operator.add_argument(
        "--admin-port", type=int, default=None, help=f"default {DEFAULT_ADMIN_PORT}; 0 picks a free one"
    )
    guards = parser.add_argument_group("client connection guards")
    guards.add_argument("--header-timeout", dest="header_timeout_s", type=float, default=None, help="seconds (10)")
    guards.add_argument("--body-timeout", dest="body_timeout_s", type=float, default=None, help="seconds (30)")
    guards.add_argument(
        "--keepalive-timeout", dest="keepalive_timeout_s", type=float, default=None, help="seconds (75)"
    )
    guards.add_argument("--max-header-bytes", type=int, default=None, help="request line + headers (65536)")
    guards.add_argument("--max-headers", type=int, default=None, help="header lines per request (100)")
    guards.add_argument("--max-connections", type=int, default=None, help="open on the API listener (10000)")


_LISTEN_SETTINGS = (
    "admin_host",
    "admin_port",
    "header_timeout_s",
    "body_timeout_s",
    "keepalive_timeout_s",
    "max_header_bytes",
    "max_headers",
    "max_connections",
)


def load_or_report(path: str) -> PolicySnapshot | None:
    try:
        return load_policy(path)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return None


def settings_or_report(**settings: object) -> Settings | None:
    """``Settings`` from the environment and ``settings``; None, reported, when they are invalid."""
    try:
        return Settings.from_env(**settings)
    except ValueError as exc:
        print(f"cannot start: {exc}", file=sys.stderr)
        return None


def build_or_report(snapshot: PolicySnapshot, **settings: object) -> GatewayServer | None:
    """The server from the environment and ``settings``; None, reported, on bad settings or a taken port."""
    try:
        return build_server(Settings.from_env(**settings), snapshot)
    except (ValueError, OSError) as exc:
        print(f"cannot start: {exc}", file=sys.stderr)
        return None


def _missing_policy(path: str) -> str | None:
    """Why the gateway cannot start when no file is at ``path``; None when there is a file. An
    absolute path is a mount point (the image's is /etc/inference-gateway/policy/policy.yaml: it
    ships no policy, the operator mounts one): the message says how to mount a directory there,
    rather than the file, so that an update (Kubernetes' symlink swap, an editor's new inode)
    reaches the container and the gateway reloads it."""
    target = Path(path)
    if target.exists():
        return None
    missing = f"cannot start: no policy file at {target.absolute()}"
    if not target.is_absolute():
        return missing
    folder, name = target.parent, target.name
    return (
        f"{missing}; mount a directory holding {name} at {folder}/ (Kubernetes: a ConfigMap volume with "
        f'the key {name}; docker run -v "$PWD/policy:{folder}:ro" ...) or name another file with --policy'
    )


def _serve(args: argparse.Namespace) -> int:
    """One gateway process, or (``--workers N``) a supervisor and N of them (``gateway/workers/``)."""
    missing = _missing_policy(args.policy)
    if missing is not None:
        print(missing, file=sys.stderr)
        return 1
    snapshot = load_or_report(args.policy)
    if snapshot is None:
        return 1
    listen = {name: getattr(args, name) for name in _LISTEN_SETTINGS}
    listen.update(policy_path=args.policy, host=args.host, port=args.port, log_level=args.log_level)
    settings = settings_or_report(workers=args.workers, **listen)
    if settings is None:
        return 1
    role = " [supervisor]" if settings.workers > 1 else ""
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s{role} %(name)s %(message)s")
    if settings.workers > 1:
        return supervise(settings, snapshot)
    built = build_or_report(snapshot, workers=1, **listen)
    if built is None:
        return 1
    built.run()
    return 0 if built.server.started else 1


LIVE_DISAGREES = 3
"""``policy validate --live``'s exit status when an engine disagrees with its backend's declared
capacity, or does not give a figure its ``capacity: auto`` takes. Not 1, which stays an invalid
file (as without ``--live``: a script's check keeps its meaning), nor 2, argparse's usage error."""


def _validate(args: argparse.Namespace) -> int:
    """Errors and warnings on stderr, ``file:line:column: [warning: ]path: problem``; warnings fail
    only ``--strict``. ``--live``: then each engine's limits against the declared (``_live``)."""
    invalid = disagrees = False
    for path in args.paths:
        snapshot = load_or_report(path)
        if snapshot is None:
            invalid = True
            continue
        print(f"{path}: valid (version {snapshot.version}, digest {snapshot.digest})")
        for warning in snapshot.warnings:
            print(warning, file=sys.stderr)
        invalid = invalid or bool(args.strict and snapshot.warnings)
        if args.live:
            disagrees = not asyncio.run(_live(snapshot, args.timeout_s, args.strict)) or disagrees
    return 1 if invalid else LIVE_DISAGREES if disagrees else 0


async def _live(snapshot: PolicySnapshot, timeout_s: float, strict: bool) -> bool:
    """Print each backend's declared capacity against its engine's, read now, and the WARNINGs the
    gateway would log (on stderr); True when all agree (and, ``strict``, every engine answered)."""
    async with httpx.AsyncClient() as client:
        reports = await live_check(snapshot.policy.backends, client, timeout_s)
    for report in reports:
        print(report.summary())
        for line in report.problems():
            print(line, file=sys.stderr)
    return all(r.agrees and not (strict and r.unreachable) for r in reports)


def _explain(args: argparse.Namespace) -> int:
    from gateway.errors import GatewayError
    from gateway.routing.explain import explain

    snapshot = load_or_report(args.policy)
    if snapshot is None:
        return 1
    try:
        key = Path(args.api_key_file).read_text()
        body = json.loads(Path(args.request).read_text())
        state = json.loads(Path(args.backend_state).read_text()) if args.backend_state else None
    except (OSError, ValueError) as exc:
        print(f"cannot read the inputs: {exc}", file=sys.stderr)
        return 1
    if not isinstance(body, dict):
        print(f"{args.request}: the request body must be a JSON object", file=sys.stderr)
        return 1
    rollouts = asyncio.run(_stored_rollouts(snapshot, Path(args.rollout_dir)))
    try:
        lines = explain(
            snapshot, key, body, state, priority=args.priority, session_id=args.session_id, rollouts=rollouts
        )
    except GatewayError as error:
        print(f"the gateway would answer {error.status} {error.code}: {error.message}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


async def _stored_rollouts(snapshot: PolicySnapshot, directory: Path) -> dict[str, tuple[float, str]]:
    """Each group's rollout as the gateway would read it: from Redis or from ``directory``."""
    from gateway.rollout.controller import stored_rollouts
    from gateway.rollout.store import open_rollout_store
    from gateway.shared.store import SharedStore

    if not any(group.rollout for group in snapshot.groups.values()):
        return {}
    state = snapshot.policy.state
    shared = SharedStore.from_state(state)
    store = open_rollout_store(state.backend, shared.client, state.key_prefix, directory, timeout_s=1.0)
    try:
        return await stored_rollouts(snapshot, store)
    finally:
        await store.aclose()
        await shared.aclose()


def _hash_key(args: argparse.Namespace) -> int:
    key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline()
    key = key.strip()
    if not key:
        print("no key on stdin", file=sys.stderr)
        return 1
    print(hash_api_key(key))
    return 0
