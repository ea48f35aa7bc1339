"""A policy mounted from a ConfigMap is reloaded when Kubernetes updates the ConfigMap.

The kubelet writes a ConfigMap volume as its ``AtomicWriter`` does (``pkg/volume/util/atomic_writer.go``):
the files in a hidden directory named after the time, ``..data`` a symlink to that directory, and
each key a symlink into it (``policy.yaml -> ..data/policy.yaml``). An update writes a new
directory, points a new symlink ``..data_tmp`` at it, renames ``..data_tmp`` over ``..data`` (the
one atomic step) and removes the old directory. So the path the gateway was given is never
written: what changes is the file it resolves to, a new inode. ``deploy/kubernetes`` mounts the
policy this way (a directory, never ``subPath``, which is a copy that never changes) and relies on
the gateway seeing it; these tests make that layout and swap under a real gateway, in the same
order, and wait (with a deadline) for ``/metrics`` to report the policy in force.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.policy.watch import PolicySource, ReloadOutcome
from gateway.service import POLICY_LOADER, parse_policy
from gateway.settings import Settings
from tests.policy_builder import session_policy
from tests.servers import admin_url, metric, serve_gateway_in_thread, wait_until

KEY = "policy.yaml"
WATCH = {"watch_interval_s": 0.02}
FIRST = session_policy(version="cm-1", lifecycle=WATCH)
SECOND = session_policy(version="cm-2", lifecycle=WATCH)
THIRD = session_policy(version="cm-3", lifecycle=WATCH)
INVALID = session_policy(version="cm-x", lifecycle=WATCH, surprise=1)


@dataclass
class ConfigMapVolume:
    """A directory laid out and updated as the kubelet does a ConfigMap volume with one key."""

    root: Path
    updates: int = 0

    def write(self, text: str, *, mtime_ns: int | None = None) -> None:
        """The kubelet's update: new timestamped directory, ``..data_tmp``, rename over ``..data``,
        the key's symlink if missing, then the old directory removed."""
        self.updates += 1
        stamp = time.strftime("%Y_%m_%d_%H_%M_%S", time.gmtime())
        payload = self.root / f"..{stamp}.{self.updates:09d}"
        payload.mkdir()
        (payload / KEY).write_text(text)
        if mtime_ns is not None:
            os.utime(payload / KEY, ns=(mtime_ns, mtime_ns))
        data = self.root / "..data"
        old = data.resolve() if data.is_symlink() else None
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(payload.name)
        os.rename(tmp, data)
        key = self.root / KEY
        if not key.is_symlink():
            key.symlink_to(f"..data/{KEY}")
        if old is not None:
            (old / KEY).unlink()
            old.rmdir()

    @property
    def path(self) -> Path:
        return self.root / KEY


@dataclass
class Running:
    volume: ConfigMapVolume
    metrics_url: str

    def version_in_force(self, version: str) -> bool:
        return metric(self.metrics_url, "gateway_policy_info", version=version) == 1

    def reloads(self, result: str) -> float:
        return metric(self.metrics_url, "gateway_policy_reloads", result=result)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Running]:
    """A real gateway (both listeners, the watcher every 20 ms) on a ConfigMap volume holding FIRST."""
    volume = ConfigMapVolume(tmp_path / "policy")
    volume.root.mkdir()
    volume.write(FIRST)
    settings = Settings(policy_path=str(volume.path), port=0, admin_port=0, health_checks=False)
    with serve_gateway_in_thread(settings, parse_policy(FIRST, str(volume.path))) as built:
        running = Running(volume, admin_url(built.api_url))
        assert running.version_in_force("cm-1")
        yield running


def test_the_layout_is_the_kubelets_the_key_is_a_symlink_through_data(gateway: Running) -> None:
    """The fixture's directory is what a pod sees (``ls -la`` in a ConfigMap mount)."""
    root = gateway.volume.root
    assert os.readlink(root / KEY) == f"..data/{KEY}"
    assert os.readlink(root / "..data").startswith("..")
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith("..")) == [KEY]


def test_a_new_policy_comes_into_force_when_the_data_symlink_is_swapped(gateway: Running) -> None:
    gateway.volume.write(SECOND)
    wait_until(lambda: gateway.version_in_force("cm-2"), what="cm-2 in force after the ..data swap")
    assert not gateway.version_in_force("cm-1")
    assert gateway.reloads("ok") == 1


def test_a_new_file_with_the_old_ones_size_and_mtime_is_seen_by_its_inode(tmp_path: Path) -> None:
    """A swap within the file system's timestamp granularity, to a policy of the same length: only
    the inode tells the files apart (the kubelet never rewrites a file in place). Step by step
    through ``poll()``, the watch loop's one step, so that the second look is known to come after
    the first; both files' mtime is 10 s old, past the watcher's "racily clean" re-read."""
    assert len(SECOND) == len(FIRST)
    volume = ConfigMapVolume(tmp_path / "policy")
    volume.root.mkdir()
    past = time.time_ns() - 10 * 10**9
    volume.write(FIRST, mtime_ns=past)
    source = PolicySource(volume.path, POLICY_LOADER)
    assert source.poll() is None  # the first look: the policy in force, nothing to do
    old = os.stat(volume.path)
    volume.write(SECOND, mtime_ns=past)
    new = os.stat(volume.path)
    assert (new.st_size, new.st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    assert new.st_ino != old.st_ino
    result = source.poll()
    assert result is not None
    assert (result.outcome, result.version) == (ReloadOutcome.OK, "cm-2")
    assert source.current().version == "cm-2"


def test_an_invalid_update_is_refused_the_old_policy_stays_and_the_next_valid_one_is_taken(
    gateway: Running,
) -> None:
    gateway.volume.write(INVALID)
    wait_until(lambda: gateway.reloads("invalid") == 1, what="the invalid policy to be refused")
    assert gateway.version_in_force("cm-1")
    assert not gateway.version_in_force("cm-x")
    gateway.volume.write(THIRD)
    wait_until(lambda: gateway.version_in_force("cm-3"), what="cm-3 in force after the refused one")
    assert (gateway.reloads("invalid"), gateway.reloads("ok")) == (1, 1)
