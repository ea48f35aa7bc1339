"""What a request with thousands of tiny headers costs the gateway, against a normal refusal.

Usage::

    python -m loadtests.proofs.header_flood [--requests 300] [--rounds 5] [--baseline 427bc03]
                                     [--baseline-tree DIR] [--out loadtests/results/header_flood]

Issue 27: 5,000 tiny headers fit under the 64 KiB header bound, and each cost a Python call in
uvicorn and more in the application, so one unauthenticated request cost 1.75 ms of CPU, 35
times a normal refusal. The gateway now refuses the 101st header line with 431 and stops
parsing there (``gateway/server/connections.py``, ``Settings.max_headers``).

Three requests, each unauthenticated, each on a connection of its own (a 431 closes it, so
every kind pays the same connect and close), sent one at a time from a raw socket:

* ``refusal``: a chat request as an SDK sends it (a dozen headers) without a key: 401;
* ``100_headers``: the same with 100 header lines in all, the bound: still 401;
* ``5000_headers``: the same with 5,000 tiny ``X-Hnnnn: v`` lines (about 60 KiB): 431 now.

The gateway's CPU (user + system, from /proc) is read around each phase of ``--requests``
requests of one kind; the figure is CPU per request, and its ratio to ``refusal`` in the same
run. Phases alternate kinds (and gateways, with ``--baseline REV``: that revision served from a
checkout, for a before/after in the same conditions; ``--baseline-tree DIR``: the gateway of
another source tree, e.g. this one without a change), each gateway pinned alone to core 1 and
this client to core 0. The machine's load average at start and end is reported: it is shared,
so read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from contextlib import ExitStack
from pathlib import Path

from loadtests.harness.processes import GATEWAY, admin_args, checkout, cpu_seconds, free_port, pin, policy_file, process

POLICY = """
version: header-flood-bench
classes:
  interactive: {rank: 0, slo: {ttft_ms: 500, itl_ms: 30, e2e_ms: 60000}}
models:
  - {name: m, max_prompt_tokens: 1024, max_output_tokens: 64}
backends:
  - {name: b, url: "http://127.0.0.1:9", kind: sim, models: [m]}
tenants:
  - {name: t, key_hashes: ["sha256:0000000000000000000000000000000000000000000000000000000000000000"],
     models: ["*"], default_class: interactive}
health_checks: {interval_s: 300, timeout_s: 1}
"""
BODY = b'{"model":"m","messages":[{"role":"user","content":"Hi"}],"max_tokens":8}'
SDK_HEADERS = (
    b"Host: 127.0.0.1\r\nAccept: application/json\r\nAccept-Encoding: gzip, deflate\r\n"
    b"Content-Type: application/json\r\nUser-Agent: OpenAI/Python 2.0.0\r\nX-Stainless-Lang: python\r\n"
    b"X-Stainless-Package-Version: 2.0.0\r\nX-Stainless-OS: Linux\r\nX-Stainless-Arch: x64\r\n"
    b"X-Stainless-Runtime: CPython\r\nX-Stainless-Runtime-Version: 3.11.9\r\nX-Stainless-Retry-Count: 0\r\n"
)
SDK_LINES = SDK_HEADERS.count(b"\n") + 2  # with Content-Length and Connection


def request(header_lines: int) -> bytes:
    """An unauthenticated chat request with ``header_lines`` header lines in all."""
    padding = b"".join(b"X-H%d: v\r\n" % i for i in range(max(header_lines - SDK_LINES, 0)))
    head = b"POST /v1/chat/completions HTTP/1.1\r\n" + SDK_HEADERS + padding
    return head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(BODY) + BODY


KINDS = {"refusal": request(SDK_LINES), "100_headers": request(100), "5000_headers": request(5000)}


def exchange(port: int, raw: bytes) -> int:
    """Send ``raw`` on a new connection, read until the gateway closes it; the status (0: none
    read, the connection was reset first)."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(raw)
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionError:
            pass
    return int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/1.1 ") else 0


def phase(port: int, pid: int, raw: bytes, requests: int) -> tuple[float, set[int]]:
    """CPU seconds of the gateway for ``requests`` exchanges of ``raw``, and the statuses seen."""
    statuses = set()
    before = cpu_seconds(pid)
    for _ in range(requests):
        statuses.add(exchange(port, raw))
    return cpu_seconds(pid) - before, statuses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="requests per phase")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", help="a git revision to measure beside this tree (before/after)")
    parser.add_argument("--baseline-tree", help="a source tree to measure beside this one (a change alone)")
    parser.add_argument("--out", help="a folder for results.json and results.txt")
    args = parser.parse_args()
    if len(pin(0)):
        os.sched_setaffinity(0, {0})
    load_start = os.getloadavg()
    with ExitStack() as stack, policy_file(POLICY) as path:
        trees: dict[str, tuple[list[str], dict[str, str]]] = {"this tree": (GATEWAY, dict(os.environ))}
        if args.baseline:
            folder = stack.enter_context(checkout(args.baseline))
            env = {**os.environ, "PYTHONPATH": str(folder)}
            trees[args.baseline] = ([sys.executable, "-P", "-m", "gateway"], env)  # -P: not this tree
        if args.baseline_tree:
            env = {**os.environ, "PYTHONPATH": args.baseline_tree}
            trees[args.baseline_tree] = ([sys.executable, "-P", "-m", "gateway"], env)
        gateways: dict[str, tuple[int, int]] = {}
        for name, (exe, env) in trees.items():
            port = free_port()
            argv = [*pin(1), *exe, "serve", "--policy", str(path), "--port", str(port), *admin_args(port)]
            proc = stack.enter_context(process(argv, f"http://127.0.0.1:{port}/healthz", env=env))
            gateways[name] = (port, proc.pid)
        cpu = {(g, k): 0.0 for g in gateways for k in KINDS}
        seen: dict[tuple[str, str], set[int]] = {(g, k): set() for g in gateways for k in KINDS}
        for round_no in range(args.rounds):
            order = list(KINDS)[round_no % len(KINDS) :] + list(KINDS)[: round_no % len(KINDS)]
            for name, (port, pid) in gateways.items():
                for kind in order:
                    used, statuses = phase(port, pid, KINDS[kind], args.requests)
                    cpu[name, kind] += used
                    seen[name, kind] |= statuses
    load_end = os.getloadavg()
    sent = args.requests * args.rounds
    report = {
        "requests_per_kind": sent,
        "header_lines": {k: raw.split(b"\r\n\r\n")[0].count(b"\r\n") for k, raw in KINDS.items()},
        "head_bytes": {k: len(raw.split(b"\r\n\r\n")[0]) + 4 for k, raw in KINDS.items()},
        "gateways": {
            g: {
                k: {
                    "cpu_us_per_request": cpu[g, k] / sent * 1e6,
                    "ratio_to_refusal": cpu[g, k] / cpu[g, "refusal"] if cpu[g, "refusal"] else None,
                    "statuses": sorted(seen[g, k]),
                }
                for k in KINDS
            }
            for g in gateways
        },
        "load_average": {"start": load_start, "end": load_end},
        "cpus": os.cpu_count(),
    }
    text = render(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=2))
        (out / "results.txt").write_text(text + "\n")
    return 0


def render(report: dict[str, object]) -> str:
    lines = [f"header flood: {report['requests_per_kind']} requests per kind, each on its own connection"]
    lines.append(f"head lines {report['header_lines']}, head bytes {report['head_bytes']}")
    gateways = report["gateways"]
    assert isinstance(gateways, dict)
    for name, kinds in gateways.items():
        lines.append(f"gateway from {name}:")
        for kind, figures in kinds.items():
            ratio = figures["ratio_to_refusal"]
            lines.append(
                f"  {kind:>13}: {figures['cpu_us_per_request']:8.0f} us CPU per request, "
                f"{ratio:5.2f}x the refusal, statuses {figures['statuses']}"
            )
    load = report["load_average"]
    assert isinstance(load, dict)
    lines.append(f"load average (1, 5, 15 min): start {load['start']}, end {load['end']} on {report['cpus']} cpus")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
