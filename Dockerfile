# The gateway's image: the gateway alone (no simulator, load generator or plotting), its
# dependencies at the versions and hashes CI tests, a non-root user, and no policy: the operator
# mounts a directory holding policy.yaml at /etc/inference-gateway/policy/ (a ConfigMap volume;
# `docker run -v "$PWD/policy:/etc/inference-gateway/policy:ro" IMAGE`), or the gateway refuses
# to start and says so. One gateway per container; `--workers N` for N cores in it (README, Workers).
#
# Base: python:3.11-slim (Python 3.11.16, Debian 13 trixie) pinned by the digest of its
# multi-arch index, as pushed on 2026-08-16, so that a rebuild gets the same bytes; the tag alone
# moves every few weeks. Both stages use it: the venv built in the first runs on the second's
# /usr/local/bin/python3. To move it: `docker buildx imagetools inspect python:3.11-slim` prints
# the index "Digest:"; put it here with the date, build, let CI run, commit it alone.
ARG PYTHON_IMAGE=python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
# The build context holds these and nothing else (.dockerignore): no policies/ (the demo's keys
# are public), no loadtests/ (the bench), no tests/.
COPY pyproject.toml README.md ./
COPY requirements/runtime.txt requirements/
COPY deploy/image/install.sh deploy/image/
COPY gateway gateway/
# requirements/runtime.txt with --require-hashes, then the project with --no-deps, into a venv
# (the steps and why: deploy/image/install.sh; CI runs this same line, tests/deploy/test_image.py).
RUN sh deploy/image/install.sh /opt/inference-gateway

FROM ${PYTHON_IMAGE}
# Fixed IDs, so that a securityContext (runAsUser/runAsGroup/fsGroup 10001) and volume ownership
# can name them; no home, no login shell. The code stays root-owned: the gateway cannot change it.
RUN groupadd --gid 10001 gateway \
 && useradd --uid 10001 --gid 10001 --no-create-home --no-log-init --home-dir /nonexistent \
      --shell /usr/sbin/nologin gateway
COPY --from=build /opt/inference-gateway /opt/inference-gateway
# PYTHONDONTWRITEBYTECODE: the root filesystem may be read-only (the venv's .pyc are compiled at
# install). The gateway writes no file unless GATEWAY_TRACE_LOG names one: then mount a writable
# volume there (an emptyDir); nothing else needs one, /tmp included. PYTHONUNBUFFERED: a log line
# reaches `docker logs` / kubectl logs when written, not when a buffer fills.
ENV PATH=/opt/inference-gateway/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# 8080: the API. 9464: the operator listener (/metrics, /admin/*, the probes again), on loopback
# unless `--admin-host 0.0.0.0` is given (deploy/kubernetes/ does, behind a NetworkPolicy).
EXPOSE 8080 9464
# SIGTERM starts the graceful drain (/readyz fails, in-flight streams finish, up to the policy's
# drain_timeout_s, then uvicorn's own shutdown of up to 30 s): the stop timeout
# (terminationGracePeriodSeconds, `docker stop -t`) must exceed their sum.
STOPSIGNAL SIGTERM
# Docker and compose only (Kubernetes ignores it and uses its probes). /healthz of the operator
# listener on loopback: it answers for every worker with --workers, whatever --port is. Python's
# urllib, as the slim image has no curl; an error or a non-2xx status raises, exit 1 = unhealthy.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as r; r.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('GATEWAY_ADMIN_PORT', '9464'), timeout=4)"]
# Exec form, no shell: the gateway is PID 1 and receives SIGTERM itself (uvicorn installs its
# handlers; with --workers the supervisor forwards signals and reaps its workers). Flags given to
# `docker run IMAGE ...` or the pod's `args` follow these and win (a later --policy, --port).
ENTRYPOINT ["inference-gateway", "serve", "--policy", "/etc/inference-gateway/policy/policy.yaml", "--host", "0.0.0.0", "--port", "8080"]
CMD []
