"""The supervisor of ``serve --workers N``: N gateway processes that behave as one gateway.

The rules, in the order of a supervisor's life:

1. **Start.** The policy is validated and every socket bound before any worker runs
   (``sockets.py``: the API port as one ``SO_REUSEPORT`` socket per worker, each worker's
   operator listener on loopback, and the public operator listener), so a bad file or a taken
   port fails once, with exit status 1. Then N workers start (``child.py``, each a whole gateway
   with its ``Settings.worker_index``), and the supervisor waits until each answers its
   ``/healthz``. A worker that exits before that fails the start: the others are stopped and the
   supervisor exits 1, as a single gateway refuses to start. Then it logs ``listening: API on
   ..., operator on ...`` and serves the operator listener (``operator.py``).
2. **Restarts.** A worker that exits while the set is not draining is restarted, counted
   (``gateway_worker_restarts_total``) and logged: at once the first time, then after
   ``restart_delay`` (1, 2, 4, ... up to 30 s) while it keeps exiting within ``STABLE_S`` of its
   start. While a restart waits, the worker's API socket is out of the group (``sockets.py``).
3. **Signals.** Only the supervisor gets the terminal's and the orchestrator's signals (each
   worker runs in its own session), and it forwards them: SIGTERM and SIGINT to every worker,
   which drains as a single gateway does (``gateway/server/lifecycle.py``; a second signal cuts the
   drains); SIGHUP, on which every worker reloads its policy file. From the first SIGTERM or
   SIGINT on, the set is draining: the supervisor's ``/readyz`` fails, no worker is restarted,
   each worker's API socket leaves the group when the worker exits, and the supervisor exits 0
   once every worker has. A worker still running ``drain_timeout_s`` + ``STOP_GRACE_S`` after
   the first signal is killed.
4. **Orphans.** A worker whose supervisor was killed drains and exits on its own (the lifeline,
   ``child.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx
import uvicorn

from gateway.policy.loader import PolicyError
from gateway.policy.snapshot import PolicySnapshot
from gateway.server.connections import ConnectionLimits, GuardedHttpToolsProtocol, Listener, Listeners
from gateway.server.serve import OPERATOR, base_url, listen_on
from gateway.service import load_policy
from gateway.settings import Settings
from gateway.workers.operator import SupervisorApp
from gateway.workers.sockets import WorkerSockets
from gateway.workers.spec import DRAINED, SPEC_ENV, WorkerSpec, worker_settings

log = logging.getLogger(__name__)

STABLE_S = 30.0
"""A worker that ran this long before exiting is restarted at once, however often it did before."""
MAX_RESTART_DELAY_S = 30.0
STOP_GRACE_S = 60.0
"""After a drain's timeout: uvicorn's own shutdown (up to 30 s, ``gateway/server/serve.py``) and margin."""


def restart_delay(quick_exits: int) -> float:
    """Seconds before restarting a worker that exited ``quick_exits`` times in a row within
    ``STABLE_S`` of its start: 0 the first time, then 1, 2, 4, ... up to ``MAX_RESTART_DELAY_S``."""
    if quick_exits <= 1:
        return 0.0
    return min(MAX_RESTART_DELAY_S, 2.0 ** (quick_exits - 2))


@dataclass
class Worker:
    """One worker slot: its current process (replaced on restart), and its history."""

    index: int
    process: asyncio.subprocess.Process | None = None
    lifeline: socket.socket | None = None
    drained: bool = False
    started_at: float = 0.0
    restarts: int = 0
    quick_exits: int = 0
    started: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None


class Supervisor:
    """Runs the set (module docstring): ``await Supervisor(settings, snapshot, sockets, operator).run()``."""

    def __init__(
        self, settings: Settings, snapshot: PolicySnapshot, sockets: WorkerSockets, operator: socket.socket
    ) -> None:
        self.settings = settings
        self.snapshot = snapshot
        self.sockets = sockets
        self.operator_socket = operator
        self.count = settings.workers
        self.draining = False
        self._workers: list[Worker] = []
        self._drain = asyncio.Event()
        self._backstop: asyncio.TimerHandle | None = None

    # What the operator endpoints read (``operator.WorkerSet``)

    def operator_url(self, index: int) -> str:
        return self.sockets.admin_url(index)

    def alive(self) -> Sequence[bool]:
        return [w.alive for w in self._workers]

    def restarts(self) -> Sequence[int]:
        return [w.restarts for w in self._workers]

    # The set's life

    async def run(self) -> int:
        """Start, serve, drain; the exit status (0 after a drain, 1 when the set could not start)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self.on_signal, sig)
        self._workers = [Worker(i) for i in range(self.count)]
        keepers = [loop.create_task(self._keep(w), name=f"worker-{w.index}") for w in self._workers]
        async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as http:
            status = 0
            for starting in asyncio.as_completed([w.started for w in self._workers]):
                if not await starting and not self.draining:
                    log.error("a worker could not start: stopping the others")
                    self.on_signal(signal.SIGTERM)
                    status = 1
            server = self._operator_server(http)
            serving = None if self.draining else loop.create_task(server.serve(sockets=[self.operator_socket]))
            if serving is not None:
                await self._announce(server, serving)
            await self._drain.wait()
            await asyncio.gather(*keepers)
            if serving is not None:
                server.should_exit = True
                if not await _served(serving):
                    status = 1
        if self._backstop is not None:
            self._backstop.cancel()
        log.warning("every worker has exited")
        return status

    def _operator_server(self, http: httpx.AsyncClient) -> _OperatorServer:
        settings = self.settings
        limits = ConnectionLimits(
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            keepalive_timeout_s=settings.keepalive_timeout_s,
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
            max_connections=settings.admin_max_connections,
        )
        listeners = Listeners()
        listeners.add(Listener("admin", limits, operator=True), self.operator_socket.getsockname())
        config = uvicorn.Config(
            SupervisorApp(self, http),
            http=GuardedHttpToolsProtocol.bound_to(listeners),
            ws="none",
            lifespan="off",
            log_level=settings.log_level,
            log_config=None,
            access_log=False,
            proxy_headers=False,
            timeout_graceful_shutdown=5,
        )
        return _OperatorServer(config)

    async def _announce(self, server: _OperatorServer, serving: asyncio.Task[None]) -> None:
        """The line ``serve`` logs once it listens (``gateway/server/serve.py``), for the whole set."""
        listening = asyncio.ensure_future(server.listening.wait())
        await asyncio.wait({listening, serving}, return_when=asyncio.FIRST_COMPLETED)
        listening.cancel()
        if server.listening.is_set():
            host, port = self.operator_socket.getsockname()[:2]
            api = base_url(self.settings.host, self.sockets.port)
            log.info("listening: API on %s, operator on %s (%d workers)", api, base_url(host, port), self.count)
        else:
            log.error("the operator listener could not start: stopping the workers")
            self.on_signal(signal.SIGTERM)

    def on_signal(self, sig: int) -> None:
        """Forward ``sig`` to every worker; SIGTERM and SIGINT also begin (or cut) the drain."""
        name = signal.Signals(sig).name
        if sig == signal.SIGHUP:
            log.warning("%s: every worker reloads its policy", name)
        elif not self.draining:
            log.warning("%s: draining every worker", name)
            self.draining = True
            self._drain.set()
            self._backstop = asyncio.get_running_loop().call_later(self._stop_deadline_s(), self._kill_all)
        else:
            log.warning("%s again: every worker cuts its drain", name)
        for worker in self._workers:
            if worker.alive and worker.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(sig)

    def _stop_deadline_s(self) -> float:
        """The longest drain a worker may be running (the policy it started with, or one reloaded
        since), plus ``STOP_GRACE_S``."""
        timeouts = [self.snapshot.policy.lifecycle.drain_timeout_s]
        with contextlib.suppress(PolicyError):
            timeouts.append(load_policy(self.settings.policy_path).policy.lifecycle.drain_timeout_s)
        return max(timeouts) + STOP_GRACE_S

    def _kill_all(self) -> None:
        for worker in self._workers:
            if worker.alive and worker.process is not None:
                log.error("worker %d is still running long after its drain: killed", worker.index)
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()

    async def _keep(self, worker: Worker) -> None:
        """Run worker ``worker.index`` until the set drains, restarting it (module docstring, 2)."""
        try:
            while not self.draining:
                try:
                    process = await self._spawn(worker)
                except OSError as exc:  # no process at all (fork refused): as a worker that died at once
                    if not worker.started.done():
                        log.error("worker %d could not be started: %s", worker.index, exc)
                        return
                    await self._restart_after(worker, f"could not be started ({exc})")
                    continue
                if not worker.started.done():
                    worker.started.set_result(await self._started(worker, process))
                    if not worker.started.result():
                        await process.wait()
                        return
                code = await process.wait()
                self._exited(worker)
                if self.draining:
                    return
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                await self._restart_after(worker, how)
        finally:
            if not worker.started.done():
                worker.started.set_result(False)
            if worker.process is not None:
                await worker.process.wait()
            self._exited(worker)
            self.sockets.close_api(worker.index)

    async def _spawn(self, worker: Worker) -> asyncio.subprocess.Process:
        index = worker.index
        api, admin = self.sockets.api(index), self.sockets.admin(index)
        ours, theirs = socket.socketpair()
        spec = WorkerSpec(
            settings=worker_settings(self.settings, index, port=self.sockets.port, admin_port=admin.getsockname()[1]),
            api_fd=api.fileno(),
            admin_fd=admin.fileno(),
            lifeline_fd=theirs.fileno(),
        )
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "gateway.workers.child",
                str(index),
                stdin=subprocess.DEVNULL,
                pass_fds=(api.fileno(), admin.fileno(), theirs.fileno()),
                env={**os.environ, SPEC_ENV: spec.encode()},
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        asyncio.get_running_loop().add_reader(ours.fileno(), self._heard, worker)
        worker.process, worker.lifeline, worker.started_at, worker.drained = process, ours, time.monotonic(), False
        log.info("worker %d started (pid %d)", index, process.pid)
        return process

    async def _started(self, worker: Worker, process: asyncio.subprocess.Process) -> bool:
        """Whether the worker answers its ``/healthz`` before it exits (or the set drains)."""
        url = self.sockets.admin_url(worker.index) + "/healthz"
        exited = asyncio.ensure_future(process.wait())
        drained = asyncio.ensure_future(self._drain.wait())
        healthy = asyncio.ensure_future(_answers(url))
        try:
            await asyncio.wait({exited, drained, healthy}, return_when=asyncio.FIRST_COMPLETED)
            return healthy.done() and not exited.done()
        finally:
            for task in (exited, drained, healthy):
                task.cancel()

    def _heard(self, worker: Worker) -> None:
        """The worker wrote on its lifeline (it has drained), or closed it (it exited).

        A worker that drained while the set does not (someone sent it alone a SIGTERM) is
        released at once: it exits, and is restarted like any worker that exits."""
        lifeline = worker.lifeline
        if lifeline is None:
            return
        try:
            said = lifeline.recv(64)
        except BlockingIOError:
            return
        except OSError:
            said = b""
        if not said:
            self._exited(worker)
        elif DRAINED in said:
            worker.drained = True
            if not self.draining:
                log.warning("worker %d drained on its own: releasing it", worker.index)
                self._close_lifeline(worker)
            self._release_if_drained()

    def _exited(self, worker: Worker) -> None:
        """The worker's process is gone (or going); the set may have drained with it."""
        self._close_lifeline(worker)
        self._release_if_drained()

    def _release_if_drained(self) -> None:
        """Once every worker of a draining set has drained (or exited), close every lifeline: each
        worker then stops listening and exits (``gateway/server/lifecycle.py``, ``after_drain``)."""
        if not self.draining or any(w.lifeline is not None and not w.drained for w in self._workers):
            return
        for worker in self._workers:
            self._close_lifeline(worker)

    def _close_lifeline(self, worker: Worker) -> None:
        if worker.lifeline is not None:
            asyncio.get_running_loop().remove_reader(worker.lifeline.fileno())
            worker.lifeline.close()
            worker.lifeline = None

    async def _restart_after(self, worker: Worker, how: str) -> None:
        """Restart the worker that exited (``how``), after its delay (module docstring, 2)."""
        if time.monotonic() - worker.started_at >= STABLE_S:
            worker.quick_exits = 0
        worker.quick_exits += 1
        worker.restarts += 1
        delay = restart_delay(worker.quick_exits)
        log.error("worker %d %s; restarting it in %.0fs (restart %d)", worker.index, how, delay, worker.restarts)
        if delay > 0:
            self.sockets.close_api(worker.index)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drain.wait(), delay)


async def _served(serving: asyncio.Task[None]) -> bool:
    """Whether the operator listener served and stopped cleanly; its failure is one line, never a
    traceback (``_announce`` has stopped the workers already)."""
    try:
        await serving
    except OSError as exc:
        log.error("the operator listener failed: %s", exc)
        return False
    return True


async def _answers(url: str) -> None:
    """Return once ``url`` answers 200 (the worker's own listener, bound before it started)."""
    async with httpx.AsyncClient(timeout=5.0) as http:
        while True:
            try:
                if (await http.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)


def share_cache_salt_secret(snapshot: PolicySnapshot) -> None:
    """Give every worker the same cache-salt secret, so that the set shares the engines' prefix
    caches as one gateway does (``gateway/routing/isolation.py``): when the policy's variable is
    unset, the supervisor draws one for its workers (each drawing its own would split every
    tenant's cache N ways). Replicas still need it set, to the same value on each."""
    name = snapshot.policy.cache_isolation.secret_env
    if not os.environ.get(name):
        log.warning(
            "%s is not set: the workers share a random secret of this supervisor's; replicas will not "
            "share engine prefix caches (set it to the same secret on every replica)",
            name,
        )
        os.environ[name] = secrets.token_hex(32)


class _OperatorServer(uvicorn.Server):
    """uvicorn for the supervisor's operator listener: the supervisor handles the signals itself,
    and learns when it listens (``listening``)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.listening.set()


def supervise(settings: Settings, snapshot: PolicySnapshot) -> int:
    """``serve --workers N``: bind every socket, run the set until it has drained; the exit status."""
    share_cache_salt_secret(snapshot)
    if snapshot.policy.state.backend == "memory":
        log.warning(
            "state.backend is memory: each of the %d workers enforces every tenant limit on its own "
            "(up to %d x each limit); share them through Redis (state: {backend: redis}) as replicas do",
            settings.workers,
            settings.workers,
        )
    try:
        sockets = WorkerSockets(settings.host, settings.port, settings.workers)
    except OSError as exc:
        print(f"cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        operator = listen_on(OPERATOR, settings.admin_host, settings.admin_port)
    except OSError as exc:
        sockets.close()
        print(f"cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(Supervisor(settings, snapshot, sockets, operator).run())
    finally:
        operator.close()
        sockets.close()
