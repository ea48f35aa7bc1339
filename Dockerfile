# The gateway image: one gateway per container; `--workers N` (GATEWAY_WORKERS) for N cores in it (README, Workers).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/runtime.txt ./requirements/runtime.txt
COPY gateway ./gateway
COPY loadtests ./loadtests
# The versions CI tested (requirements/runtime.txt, hashes checked), then the project alone.
RUN pip install --no-cache-dir --prefix=/install --require-hashes -r requirements/runtime.txt \
 && pip install --no-cache-dir --prefix=/install --no-deps .

FROM python:3.11-slim
RUN useradd --system --uid 10001 gateway
COPY --from=build /install /usr/local
COPY policies /etc/inference-gateway/policies
USER 10001
# 8080: the API. 9464: the operator listener (/metrics, /admin/*), on loopback unless
# `--admin-host 0.0.0.0` is given (deploy/kubernetes/gateway.yaml does, behind a NetworkPolicy).
EXPOSE 8080 9464
# SIGTERM starts the graceful drain; the pod's terminationGracePeriodSeconds must exceed it.
STOPSIGNAL SIGTERM
ENTRYPOINT ["inference-gateway", "serve", "--host", "0.0.0.0", "--port", "8080"]
CMD ["--policy", "/etc/inference-gateway/policies/demo.yaml"]
