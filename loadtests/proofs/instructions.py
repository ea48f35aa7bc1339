"""Instructions the gateway executes per request, counted by callgrind: a figure noise cannot move.

Usage::

    python -m loadtests.proofs.instructions [--revisions 2d257f3,HEAD] [--requests 400] [--stream]
                                     [--out loadtests/results/instructions/NAME]

Why: on this shared 2-core machine, CPU time per request moves by 20% from one run to the next,
so a change of 5% cannot be seen in seconds. ``valgrind --tool=callgrind`` counts the
instructions the process executes, the same total twice for the same code and inputs whatever
else the machine does. For each revision (a git revision checked out into a temporary folder,
or ``.`` for this working tree) the gateway runs under callgrind
in front of a zero-delay simulated engine, with instrumentation off while it starts and warms up
(50 requests), on for ``--requests`` requests sent two at a time, then the total is divided by
the count. Startup, imports and idle time are not counted; background loops (health checks,
scrapes) over the measured seconds are, as they are in production.

The figure to read is the ratio between revisions in the same run; absolute counts depend on the
Python build. Valgrind slows the gateway about 50x, so a run of 400 requests takes ~30 s a revision.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from loadtests.harness.processes import checkout, pin, process, stop, wait_ready
from loadtests.proofs.overhead import API_KEY, CHAT_BODY, MODEL, _policy

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def tree(revision: str) -> Iterator[Path]:
    """The source tree of ``revision``: this working tree for ``.``, else a temporary checkout."""
    if revision == ".":
        yield ROOT
    else:
        with checkout(revision) as folder:
            yield folder


def gateway_argv(folder: Path, policy: str, port: int, out: str) -> list[str]:
    argv = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--policy",
        policy,
        "--port",
        str(port),
    ]
    if (folder / "gateway" / "server.py").exists():
        argv += ["--admin-port", str(port + 1000)]
    return argv


async def send(url: str, count: int, stream: bool) -> None:
    """``count`` requests, two at a time, each read to its end; any failure stops the run."""
    body = {**CHAT_BODY, "stream": True, "max_tokens": 64} if stream else CHAT_BODY
    payload = json.dumps(body).encode()
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker(n: int) -> None:
            for _ in range(n):
                async with session.post(url, data=payload, headers=headers) as response:
                    text = await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}: {text[:200]!r}")

        await asyncio.gather(worker(count // 2), worker(count - count // 2))


def callgrind(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def measure(revision: str, backend_url: str, requests: int, stream: bool, port: int) -> float:
    """Instructions per request of the gateway of ``revision``."""
    with tree(revision) as folder, tempfile.TemporaryDirectory() as scratch:
        policy = Path(scratch) / "policy.yaml"
        policy.write_text(_policy(backend_url))
        out = str(Path(scratch) / "callgrind.out")
        env = {**os.environ, "PYTHONPATH": str(folder)}
        argv = [*pin(1), *gateway_argv(folder, str(policy), port, out)]
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=folder)
            try:
                wait_ready(proc, f"http://127.0.0.1:{port}/healthz", log, 300.0)
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                asyncio.run(send(url, 50, stream))  # warm: caches, connection pools, first-call paths
                callgrind(proc.pid, "-i", "on")
                asyncio.run(send(url, requests, stream))
                callgrind(proc.pid, "-i", "off")
                callgrind(proc.pid, "-d")
                time.sleep(1.0)  # the dump is written by the process itself
            finally:
                stop(proc)
        total = 0
        for dump in Path(scratch).glob("callgrind.out*"):
            for line in dump.read_text().splitlines():
                if line.startswith("totals:"):
                    total += int(line.split()[1])
        return total / requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--revisions", default=".", help="comma-separated git revisions; '.' is this working tree")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--stream", action="store_true", help="64-token streams instead of short answers")
    parser.add_argument("--backend-port", type=int, default=18801)
    parser.add_argument("--gateway-port", type=int, default=18800)
    parser.add_argument("--out", default=None, help="write the figures as JSON to OUT.json")
    args = parser.parse_args(argv)
    backend = f"http://127.0.0.1:{args.backend_port}"
    sim = [*pin(0), sys.executable, "-m", "gateway", "sim", "--profile", "instant", "--model", MODEL]
    sim += ["--port", str(args.backend_port)]
    figures: dict[str, float] = {}
    kind = "64-token streams" if args.stream else "short answers"
    print(f"instructions per request ({kind}, {args.requests} requests, callgrind)", flush=True)
    with process(sim, backend + "/health"):
        for revision in args.revisions.split(","):
            figures[revision] = measure(revision, backend, args.requests, args.stream, args.gateway_port)
            base = next(iter(figures.values()))
            print(f"{revision:>12}: {figures[revision] / 1e6:7.3f} M  ({figures[revision] / base:.3f}x the first)")
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps({"kind": kind, "per_request": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
