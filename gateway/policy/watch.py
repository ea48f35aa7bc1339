"""Policy hot reload: validate the new file, swap one reference, keep the last good one on error.

A ``PolicySource`` holds the snapshot in force. ``reload(reason)`` reads the file and validates
it with the loader it was given (``PolicyLoader.parse``, with every check: the composition
root's ``POLICY_LOADER``) before anything
changes: an invalid file is logged, counted and reported, and the old snapshot stays; a file
whose bytes have the digest of the snapshot in force is ``unchanged``. A valid new file is
first handed to the ``install`` callable (the gateway builds everything the new policy needs
there, and installs it in one step, see ``gateway/runtime.py``); if that raises
``ReloadRefused`` (a backend whose credential is missing, ...) nothing changes and the reload
is ``refused`` with the reason, like an invalid file. Only then does the new snapshot replace
``current()``, and every subscribed listener is called with it, in subscription order. A
listener that raises is logged and counted; the swap stands.

Three triggers call ``reload``: ``watch(interval_s)`` polls the file (``poll()`` is one step:
``stat`` for inode, mtime and size, and the content digest when those changed), a SIGHUP
handler (``install_sighup``), and the admin endpoint. Each content change is validated once:
a bad file is reported once, not on every poll. Like git's "racily clean" index entries, a
file whose mtime was within ``RACY_S`` of the moment it was read is read again on the next
poll, so that a second write within the file system's timestamp granularity is not missed.

Requests keep the snapshot they started with: a request reads ``current()`` once, at intake,
and uses that object to the end; snapshots are frozen, so a reload never changes a request
in flight. Everything here runs on the event loop (the file is small; reading it is cheap).

The snapshot's ``warnings`` (allowed but probably not meant, e.g. an unsalted engine shared by
tenants of different cache scopes) are logged when a policy comes into force: at start and at
each reload.

Counters for telemetry are plain attributes: ``reloads_ok``, ``reloads_invalid``,
``reloads_refused``, ``reloads_unchanged``, ``listener_errors``; ``last_result`` and ``last_error`` feed
``/admin/policy``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from gateway.policy.loader import PolicyError, PolicyLoader
from gateway.policy.snapshot import PolicySnapshot, content_digest

log = logging.getLogger(__name__)

RACY_S = 2.0
Listener = Callable[[PolicySnapshot], None]


class ReloadRefused(Exception):
    """A valid policy that cannot be applied (a missing credential, ...); nothing was changed."""


class ReloadOutcome(StrEnum):
    """The result of one reload attempt; the values are the ``result`` metric label."""

    OK = "ok"
    INVALID = "invalid"
    REFUSED = "refused"
    UNCHANGED = "unchanged"


@dataclass(frozen=True, slots=True)
class ReloadResult:
    """What a reload did, and the policy in force afterwards (``version``, ``digest``)."""

    outcome: ReloadOutcome
    reason: str
    version: str
    digest: str
    error: str | None = None


def log_warnings(snapshot: PolicySnapshot) -> None:
    """One log line per warning of the policy coming into force; each warning names its file,
    line, column and path already (``gateway/policy/loader.py``)."""
    for warning in snapshot.warnings:
        log.warning("policy version %s: %s", snapshot.version, warning)


class PolicySource:
    """The policy in force, reloaded from ``path`` (see the module docstring).

    Usage::

        source = PolicySource("policies/prod.yaml", POLICY_LOADER, install=gateway.install)  # PolicyError if invalid
        source.subscribe(on_swapped)                     # told after each swap (tests, tools)
        source.install_sighup(asyncio.get_running_loop())
        task = asyncio.create_task(source.watch(1.0))   # owned by the lifespan
        snapshot = source.current()                      # once per request
    """

    def __init__(
        self,
        path: str | Path,
        loader: PolicyLoader,
        *,
        initial: PolicySnapshot | None = None,
        install: Listener | None = None,
    ) -> None:
        """``loader`` reads the file at start (without ``initial``) and at each reload;
        ``install(snapshot)`` applies a new policy before it becomes ``current()``; it may raise
        ``ReloadRefused``, and must change nothing when it does."""
        self.path = Path(path)
        self._loader = loader
        self._current = initial if initial is not None else loader.load(self.path)
        self._install = install
        self._listeners: list[Listener] = []
        self._seen_stat: tuple[int, int, int] | None = None
        self._seen_digest = self._current.digest
        self._racy = True
        self.reloads_ok = 0
        self.reloads_invalid = 0
        self.reloads_refused = 0
        self.reloads_unchanged = 0
        self.listener_errors = 0
        self.last_result: ReloadResult | None = None
        self.last_error: str | None = None
        log_warnings(self._current)

    def current(self) -> PolicySnapshot:
        return self._current

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(snapshot)`` after each successful swap; returns the unsubscribe."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def reload(self, reason: str) -> ReloadResult:
        """Read, validate and (if valid and new) swap in the file; never raises PolicyError."""
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            return self._reject(reason, PolicyError(str(self.path), [f"cannot read: {exc.strerror or exc}"]))
        return self._apply(data, reason)

    def poll(self) -> ReloadResult | None:
        """One watch step: reload if the file's content changed since last seen, else None."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            log.debug("policy %s: cannot stat (%s); keeping the policy in force", self.path, exc)
            return None
        fingerprint = (st.st_ino, st.st_mtime_ns, st.st_size)
        if fingerprint == self._seen_stat and not self._racy:
            return None
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            log.debug("policy %s: cannot read (%s); keeping the policy in force", self.path, exc)
            return None
        self._seen_stat = fingerprint
        self._racy = time.time() - st.st_mtime < RACY_S
        if content_digest(data) == self._seen_digest:
            return None
        return self._apply(data, "file changed")

    async def watch(self, interval_s: float = 1.0) -> None:
        """Poll the file every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.poll()

    def install_sighup(self, loop: asyncio.AbstractEventLoop) -> None:
        """Reload on SIGHUP (Unix, main thread); undo with ``remove_sighup``."""
        loop.add_signal_handler(signal.SIGHUP, self.reload, "SIGHUP")

    def remove_sighup(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_signal_handler(signal.SIGHUP)

    def _apply(self, data: bytes, reason: str) -> ReloadResult:
        digest = content_digest(data)
        self._seen_digest = digest
        if digest == self._current.digest:
            self.reloads_unchanged += 1
            self.last_error = None
            return self._result(ReloadOutcome.UNCHANGED, reason)
        try:
            snapshot = self._loader.parse(data, str(self.path))
        except PolicyError as exc:
            return self._reject(reason, exc)
        if self._install is not None:
            try:
                self._install(snapshot)
            except ReloadRefused as exc:
                return self._refuse(reason, snapshot, exc)
        previous, self._current = self._current, snapshot
        self.reloads_ok += 1
        self.last_error = None
        log.info(
            "policy reloaded (%s): version %s (%s) replaces %s (%s)",
            reason,
            snapshot.version,
            snapshot.digest,
            previous.version,
            previous.digest,
        )
        log_warnings(snapshot)
        self._notify(snapshot)
        return self._result(ReloadOutcome.OK, reason)

    def _reject(self, reason: str, error: PolicyError) -> ReloadResult:
        self.reloads_invalid += 1
        self.last_error = str(error)
        log.error("policy reload (%s) rejected; keeping version %s:\n%s", reason, self._current.version, error)
        return self._result(ReloadOutcome.INVALID, reason, self.last_error)

    def _refuse(self, reason: str, snapshot: PolicySnapshot, error: ReloadRefused) -> ReloadResult:
        self.reloads_refused += 1
        self.last_error = f"{self.path}: version {snapshot.version} is valid but cannot be applied: {error}"
        log.error("policy reload (%s) refused; keeping version %s: %s", reason, self._current.version, self.last_error)
        return self._result(ReloadOutcome.REFUSED, reason, self.last_error)

    def _notify(self, snapshot: PolicySnapshot) -> None:
        for listener in list(self._listeners):
            try:
                listener(snapshot)
            except Exception:  # the swap stands; one failing listener must not starve the others
                self.listener_errors += 1
                log.exception("policy listener %r failed on version %s", listener, snapshot.version)

    def _result(self, outcome: ReloadOutcome, reason: str, error: str | None = None) -> ReloadResult:
        result = ReloadResult(outcome, reason, self._current.version, self._current.digest, error)
        self.last_result = result
        return result

    def __repr__(self) -> str:
        return f"PolicySource({str(self.path)!r}, version={self._current.version!r})"
